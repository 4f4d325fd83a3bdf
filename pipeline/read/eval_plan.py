"""The plan of an eval set: the training geometry over one held-out store, full batches only.

Used by the JAX `EvalFeed` and by every CLI command that loads a config, so a missing or
too-small eval store is refused wherever the config is read, not first in the trainer.
"""

from __future__ import annotations

import dataclasses

from pipeline.config import DataConfig, SourceSpec, StageSpec
from pipeline.config.schedule import WeightSchedule
from pipeline.errors import ConfigError
from pipeline.plan.sources import load_metas
from pipeline.plan.vocabulary import check_one_vocabulary
from pipeline.read.plan import Plan
from pipeline.wording import counted

ALWAYS = WeightSchedule("constant", ((0, 1.0),))


def eval_config(config: DataConfig, source: SourceSpec) -> DataConfig:
    """The training config's batch geometry over one eval store (no grad_accum, one lane);
    with a batch schedule, the batch it ends at (one shape to compile); the six fields only,
    and no metrics endpoint of its own."""
    return DataConfig(
        seed=config.seed,
        seq_len=config.seq_len,
        batch_sizes=((0, config.final_batch_size),),
        sources=(source,),
        stages=(StageSpec("eval", None, ((source.name, ALWAYS),)),),
        feed=dataclasses.replace(config.feed, provenance=(), metrics_port=None),  # train only
        origin=config.origin,
        sources_key="eval.sources",
    )


def eval_plan(
    config: DataConfig, source: SourceSpec, *, open_store: bool = True
) -> tuple[Plan, int]:
    """(the eval set's plan, how many full batches it serves); refuses a store too small or
    one prepared with another tokenizer than the training sources (`check_one_vocabulary`).
    Reads manifests only, and opens the eval store (its files checked) if `open_store`."""
    settings = eval_config(config, source)
    meta = load_metas(settings)[source.name]
    train = {f"sources.{name}": m for name, m in load_metas(config).items()}
    check_one_vocabulary(config, {**train, f"eval.sources.{source.name}": meta})
    plan = Plan.from_config(settings, None if open_store else {source.name: meta})
    windows = plan.segment_plan(0).layouts[source.name].windows_per_lane
    available = windows // config.final_batch_size
    if available == 0:
        raise ConfigError(
            f"{config.origin}: eval.sources.{source.name}: {counted(windows, 'window')} of "
            f"{config.seq_len + 1} tokens do not fill one batch of "
            f"{counted(config.final_batch_size, 'row')}; use a bigger eval store"
        )
    batches = available if config.eval_batches is None else min(config.eval_batches, available)
    return plan, batches


def check_eval(config: DataConfig) -> None:
    """Check every eval store of `config` as `eval_plan` does, from its manifest alone."""
    for source in config.eval_sources:
        eval_plan(config, source, open_store=False)
