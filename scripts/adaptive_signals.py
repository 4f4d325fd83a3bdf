"""The figure of docs/mixtures.md, "Training or held-out signal": the reference controller on
the demo's data (configs/adaptive-signals.yaml), steered by each source's training loss and by
its held-out loss, side by side.

    python scripts/adaptive_signals.py     # after `make demo` has prepared data/

Trains each run (`scripts/train.py --adaptive-mix 4 --adaptive-rate 10 --adaptive-signal S`,
60 steps, held-out losses logged every 4 steps) into runs/signals/S, then draws the docs weight
each controller set and the held-out losses to docs/images/adaptive-signals.png.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "adaptive-signals.yaml"
RUNS = ROOT / "runs" / "signals"
OUT = ROOT / "docs" / "images" / "adaptive-signals.png"
STEPS, EVERY = 60, 4
SIGNALS = {"train": "training loss (every step)", "eval": "held-out loss (every 4 steps)"}


def run(signal: str) -> list[dict]:
    """The run's per-step records, training it first when it has none."""
    metrics = RUNS / signal / "metrics.jsonl"
    if not metrics.exists():
        command = [
            sys.executable, str(ROOT / "scripts" / "train.py"), "--data-config", str(CONFIG),
            "--checkpoint-dir", str(RUNS / signal / "ckpt"), "--steps", str(STEPS),
            "--save-every", str(STEPS), "--eval-every", str(EVERY), "--width", "64",
            "--adaptive-mix", str(EVERY), "--adaptive-rate", "10", "--adaptive-signal", signal,
            "--metrics", str(metrics),
        ]  # fmt: skip
        subprocess.run(command, check=True)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (weights, losses) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for (signal, label), colour in zip(SIGNALS.items(), ("tab:blue", "tab:orange")):
        records = run(signal)
        share, shares = 0.5, []  # the config's 1:1 until the first call
        for record in records:
            shares.append(share)
            share = record.get("mix", {}).get("docs", share)  # from the next step on
        steps = [record["step"] for record in records]
        weights.step(steps, shares, where="post", color=colour, label=label)
        evaluated = [r for r in records if "eval_docs" in r]
        for source, style in (("docs", "-"), ("code", ":")):
            at = [r["step"] for r in evaluated]
            values = [r[f"eval_{source}"] for r in evaluated]
            label = f"{source}, {signal} signal"
            losses.plot(at, values, style, color=colour, marker=".", label=label)
    weights.set_ylabel("docs weight set")
    weights.set_title("ExcessLoss on configs/adaptive-signals.yaml (code and docs from 1:1)")
    weights.legend(title="steered by")
    losses.set_ylabel("held-out loss")
    losses.set_xlabel("step")
    losses.legend(ncol=2, fontsize="small")
    figure.tight_layout()
    figure.savefig(OUT, dpi=100)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
