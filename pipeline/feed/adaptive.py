"""A reference controller for adaptive mixtures: exponentiated gradient on excess loss.

    controller = ExcessLoss(feed.source_names(), every=50, initial=stage_weights)
    for batch in feed:
        step = feed.step - 1
        ...train, get each source's mean loss of the step (NaN: not drawn)...
        controller.observe(source_losses)
        controller.steer(feed)             # every `every` steps: feed.set_mix(...)

The weights start as `initial` (default: equal; a share below `floor` starts at the floor),
so a run resumed with the weights in force at its step (the ledger's last `set_mix` entry,
which `report.target_shares` of the restored plan gives) continues from them. Each source's
loss is smoothed (an exponential moving average); the first smoothed value after `warmup`
observations is its reference. Every `every` steps the log-weights move by `rate` times each
source's relative excess loss, (loss - reference) / reference, so a source whose loss falls
less than the others' gains weight; the weights are then mixed with the uniform ones so that
each source keeps at least `floor` of the total. The weights depend only on the losses given,
so processes that pass the same globally reduced losses (e.g. computed inside a jitted step on
the global batch) make the same `set_mix` calls, which `set_mix` checks. Only the weights are
checkpointed (in the ledger): after a restore the smoothed losses and references are learned
again (`warmup` observations, the weights unchanged meanwhile), while every step before it
replays exactly from the ledger. It illustrates the mechanism; the Aioli paper found no mixing
rule that reliably beats a fixed stratified mixture.

Its signal may also be held-out loss (ODM, DoReMi and AC-ODM steer on validation losses): each
training source's eval set (`EvalFeed`, named like the source: `held_out`) is evaluated at every
steering step and observed once, `HELD_OUT` (no smoothing, the first evaluation the reference):

    controller = ExcessLoss(feed.source_names(), every=50, **HELD_OUT)
    ...
        if controller.due(feed.step):
            controller.observe({ev.name: mean loss of ev's batches for ev in held})
        controller.steer(feed)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from pipeline.errors import ConfigError
from pipeline.feed.data_feed import DataFeed
from pipeline.feed.eval_feed import EvalFeed

SIGNALS = ("train", "eval")
"""What the reference trainer's controller observes (`scripts/train.py --adaptive-signal`): each
source's training loss of every step, or its held-out loss at every steering step."""
HELD_OUT = {"smoothing": 0.0, "warmup": 1}
"""`ExcessLoss` settings for a held-out signal: one observation per steering step, already a
mean over fixed batches, so no smoothing, and the first one is the reference."""


def held_out(sources: Sequence[str], evals: Sequence[EvalFeed]) -> list[EvalFeed]:
    """The eval feeds named like training `sources` (the held-out signal of each); a
    `ConfigError` when there are none."""
    held = [feed for feed in evals if feed.name in sources]
    if not held:
        names = ", ".join(feed.name for feed in evals) or "none"
        raise ConfigError(
            f"a held-out signal needs an eval set named like a training source (eval.sources: "
            f"{names}; training sources: {', '.join(sources)})"
        )
    return held


class ExcessLoss:
    def __init__(
        self,
        sources: Sequence[str],
        *,
        every: int = 50,
        rate: float = 1.0,
        floor: float = 0.05,
        smoothing: float = 0.9,
        warmup: int = 10,
        initial: Mapping[str, float] | None = None,
    ) -> None:
        bad_rate = not 0 < rate < math.inf  # nan too: it would freeze the weights
        if every < 1 or bad_rate or not 0 <= floor * len(sources) < 1 or not 0 <= smoothing < 1:
            raise ConfigError(
                "ExcessLoss: expected every >= 1, a finite rate > 0, 0 <= floor < 1 / sources, "
                f"0 <= smoothing < 1; got every={every}, rate={rate}, floor={floor}, "
                f"smoothing={smoothing}"
            )
        self.sources = tuple(sources)
        self.every, self.rate, self.floor = every, rate, floor
        self.smoothing, self.warmup = smoothing, warmup
        start = initial or dict.fromkeys(self.sources, 1.0)  # e.g. the stage's own weights
        total = math.fsum(max(start.get(n, 0.0), 0.0) for n in self.sources)
        if not total > 0:
            raise ConfigError(
                f"ExcessLoss: initial weights {dict(start)} give none of the sources "
                f"{', '.join(self.sources)} a weight > 0"
            )
        uniform = floor * len(self.sources)
        # the log-weights whose `weights()` are `initial` (those below the floor: the floor)
        self.log_weights = {
            n: math.log(max((max(start.get(n, 0.0), 0.0) / total - floor) / (1 - uniform), 1e-9))
            for n in self.sources
        }
        self.smoothed: dict[str, float] = {}
        self.seen = dict.fromkeys(self.sources, 0)
        self.reference: dict[str, float] = {}

    def observe(self, losses: Mapping[str, float]) -> None:
        """One step's mean loss per source (NaN or absent: the step drew none of its rows)."""
        for name in self.sources:
            loss = losses.get(name, math.nan)
            if not math.isfinite(loss):
                continue
            before = self.smoothed.get(name, loss)
            self.smoothed[name] = self.smoothing * before + (1 - self.smoothing) * loss
            self.seen[name] += 1
            if self.seen[name] == self.warmup:
                self.reference[name] = self.smoothed[name]

    def weights(self) -> dict[str, float]:
        """The current weights: softmax of the log-weights, mixed with uniform for the floor."""
        top = max(self.log_weights.values())
        raw = {n: math.exp(w - top) for n, w in self.log_weights.items()}
        total = math.fsum(raw.values())
        uniform = self.floor * len(self.sources)
        return {n: (1 - uniform) * v / total + self.floor for n, v in raw.items()}

    def due(self, step: int) -> bool:
        """Whether the feed's next step `step` is a steering step (every `every`-th, not 0)."""
        return step > 0 and step % self.every == 0

    def steer(self, feed: DataFeed) -> dict[str, float] | None:
        """At every `every`-th step (feed.step > 0), update the log-weights from the excess
        losses of the sources with a reference, and `set_mix` the weights from the feed's next
        step; returns them (None when it is not a steering step)."""
        if not self.due(feed.step):
            return None
        for name, reference in self.reference.items():
            excess = (self.smoothed[name] - reference) / max(abs(reference), 1e-9)
            self.log_weights[name] += self.rate * excess
        weights = self.weights()
        feed.set_mix(weights, step=feed.step)
        return weights
