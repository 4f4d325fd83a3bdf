"""`make demo`: the whole product on the builtin corpora, in a few minutes on 2 CPU cores.

1. prepare the builtin corpora (stdlib code, its tests, its docs, and the instruction pairs of
   builtin:python-docstrings) into data/ (once);
2. train with 2 processes x 2 simulated devices through the three-stage curriculum of
   configs/demo-curriculum.yaml, saving model + data state every few steps;
3. kill -9 the whole job at a random step, then resume it from the latest checkpoint;
4. resume again with configs/demo-switch.yaml and --switch-data (a recorded ledger switch),
   whose last stage is instruction tuning: whole documents packed best-fit, prompts masked;
5. at step 110, restore once more with --skip-data 5, as after a loss spike
   (docs/steering.md): a recorded ledger skip, so steps 110..119 train on what the plan had
   for steps 115..124;
6. check that every step the job trained on, including steps replayed after the kill, saw
   exactly the batch an uninterrupted run computes from the final ledger, with no padding
   before the instruction stage and exactly the planned trained tokens in it; that the steps
   after the skip got the batches of plan steps 115.. of checkpoint 110's ledger and none got
   those of plan steps 110..114; and print `pipeline stages --ledger`, which lists both entries;
7. draw the loss curve, each source's loss (the trainer's per-source loss, from the feed's
   `source` field) and the realised mixture (with stage boundaries, epoch rollovers and the
   ledger's entries);
8. a short run on code and docs whose weights the reference controller sets from their losses
   (`--adaptive-mix`, configs/demo-adaptive.yaml), checked against the replay of its ledger,
   and a plot of the weights it set over the steps.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.commands.cli import main as cli  # noqa: E402
from pipeline.commands.summary import describe_store  # noqa: E402
from pipeline.ingest.prepare import PrepareOptions, prepare  # noqa: E402
from pipeline.plan import data_state  # noqa: E402
from pipeline.plan.ledger import Ledger  # noqa: E402
from pipeline.read.plan import Plan  # noqa: E402
from pipeline.store.token_store import TokenStore, is_store  # noqa: E402

DATA = ROOT / "data"
RUN = ROOT / "runs" / "demo"
CURRICULUM = ROOT / "configs" / "demo-curriculum.yaml"
SWITCH = ROOT / "configs" / "demo-switch.yaml"
BUILTIN = {"python-code": 8, "python-tests": 8, "python-docs": 4, "python-docstrings": 4}
SWITCH_AT, SKIP_AT, SKIP, LAST_STEP = 100, 110, 5, 120
ADAPTIVE = ROOT / "configs" / "demo-adaptive.yaml"
ADAPTIVE_STEPS, ADAPTIVE_EVERY = 48, 4
TRAINER = [
    sys.executable, str(ROOT / "scripts" / "train.py"), "--checkpoint-dir", str(RUN / "ckpt"),
    "--num-processes", "2", "--devices-per-process", "2", "--save-every", "10",
    "--eval-every", "25", "--width", "64", "--metrics", str(RUN / "metrics.jsonl"),
]  # fmt: skip


def prepare_builtin_stores() -> None:
    for name, shards in BUILTIN.items():
        out = DATA / name
        if not (is_store(out) and is_store(out.with_name(f"{name}-eval"))):
            print(f"== preparing builtin:{name} -> {out}", flush=True)
            options = PrepareOptions([f"builtin:{name}"], out, num_shards=shards,
                                     eval_fraction=0.05, overwrite=True)  # fmt: skip
            prepare(options)
        print(f"   {describe_store(TokenStore(out))}")


def train(*extra: str, kill_at: int | None = None) -> None:
    """Run the trainer; with `kill_at`, SIGKILL the whole job once that step is logged."""
    command = [*TRAINER, *extra]
    print(f"== {' '.join(Path(c).name if c.startswith('/') else c for c in command[1:])}",
          flush=True)  # fmt: skip
    job = subprocess.Popen(command, start_new_session=True)
    deadline = time.monotonic() + 900
    while job.poll() is None:
        if kill_at is not None and kill_at in logged_steps():
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            print(f"== kill -9 at step {kill_at}: the job is gone, mid-run", flush=True)
            return
        if time.monotonic() > deadline:
            os.killpg(job.pid, signal.SIGKILL)
            raise SystemExit("demo: the trainer did not finish in 15 minutes")
        time.sleep(0.2)
    if job.returncode:
        raise SystemExit(f"demo: the trainer failed with exit code {job.returncode}")


def records() -> list[dict]:
    path = RUN / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    if lines and not lines[-1].endswith("}"):
        lines.pop()  # the line being written when the job was killed
    return [json.loads(line) for line in lines]


def logged_steps() -> set[int]:
    return {r["step"] for r in records()}


def checkpoint_steps() -> list[int]:
    """Steps of the complete checkpoints (Orbax renames a step's directory into place last)."""
    return sorted(int(p.name) for p in (RUN / "ckpt").iterdir() if p.name.isdigit())


def final_ledger() -> Ledger:
    return data_state.load_ledger(RUN / "ckpt" / str(checkpoint_steps()[-1]))


def checksum(inputs: np.ndarray) -> int:
    """numpy twin of tiny_lm.batch_checksum (uint32 arithmetic, wrapping)."""
    flat = inputs.reshape(-1).astype(np.uint32)
    weights = np.arange(1, flat.size + 1, dtype=np.uint32) * np.uint32(2654435761)
    return int(np.sum((flat + 1) * weights, dtype=np.uint32))


def check_skip(before: Ledger) -> None:
    """The steps trained after the skipping restore at SKIP_AT got the batches that the ledger
    of checkpoint SKIP_AT (saved before the skip) plans for SKIP steps later; no step trained
    got those of the plan steps skipped."""
    plan = Plan(before)
    trained = {r["step"]: r["checksum"] for r in records()}
    for step in range(SKIP_AT, LAST_STEP):
        if trained[step] != checksum(plan.batch(step + SKIP)["inputs"]):
            raise SystemExit(f"demo: step {step} did not train on plan step {step + SKIP}")
    for step in range(SKIP_AT, SKIP_AT + SKIP):
        if checksum(plan.batch(step)["inputs"]) in trained.values():
            raise SystemExit(f"demo: the batch of skipped plan step {step} was trained on")
    print(f"== skip check passed: steps {SKIP_AT}..{LAST_STEP - 1} trained on the batches "
          f"that checkpoint {SKIP_AT}'s ledger plans for steps {SKIP_AT + SKIP}.."
          f"{LAST_STEP - 1 + SKIP}; those of plan steps {SKIP_AT}..{SKIP_AT + SKIP - 1} were "
          "never trained on", flush=True)  # fmt: skip


def check_against_uninterrupted(ledger: Ledger) -> None:
    plan = Plan(ledger)
    seen = records()
    replayed = len(seen) - len({r["step"] for r in seen})
    for record in seen:
        step = record["step"]
        batch = plan.batch(step)
        if record["checksum"] != checksum(batch["inputs"]):
            raise SystemExit(f"demo: step {step} trained on a different batch than planned")
        if record["total_weights"] != int((batch["targets_segmentation"] != 0).sum()):
            raise SystemExit(f"demo: step {step} trained on other tokens than planned")
        if "sft" not in record["stage"].split("+") and record["trained_fraction"] != 1.0:
            raise SystemExit(f"demo: step {step} had padding (total_weights)")
    steps = sorted({r["step"] for r in seen})
    if steps != list(range(LAST_STEP)):
        raise SystemExit(f"demo: steps trained are not 0..{LAST_STEP - 1}")
    print(f"== check passed: {len(seen)} trained steps ({replayed} replayed after the kill) "
          "match the uninterrupted plan batch for batch; total_weights is full before the "
          "sft stage and exactly the planned trained tokens in it")  # fmt: skip


def plot_loss(path: Path, kill_at: int, resumed_at: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = {r["step"]: r for r in records()}  # the last record of a replayed step
    steps = sorted(seen)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(steps, [seen[s]["loss"] for s in steps], label="train loss")
    for key in sorted({k for r in seen.values() for k in r if k.startswith("eval_")}):
        points = [(s, seen[s][key]) for s in steps if key in seen[s]]
        ax.plot(*zip(*points), "o-", label=key.replace("_", " "))
    marks = ((kill_at, f" kill -9 (resumed at {resumed_at})"), (SWITCH_AT, " switch"),
             (SKIP_AT, f" skip {SKIP}"))  # fmt: skip
    for step, label in marks:
        ax.axvline(step, color="gray", linestyle="--")
        ax.text(step, ax.get_ylim()[1], label, va="top", ha="right", rotation=90, color="gray")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("tiny LM on the Python stdlib: curriculum, kill -9, resume, switch, skip")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_source_loss(path: Path) -> None:
    """Each source's loss per step (its rows' mean loss), with stage boundaries, the switch and
    the skip."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = {r["step"]: r for r in records()}
    steps = sorted(seen)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(steps, [seen[s]["loss"] for s in steps], color="0.75", label="all rows")
    for name in sorted({n for r in seen.values() for n in r["source_loss"]}):
        losses = [seen[s]["source_loss"].get(name, np.nan) for s in steps]  # gaps: not drawn
        ax.plot(steps, losses, ".-", markersize=3, linewidth=1, label=name)
    started: set[str] = set()
    for step in steps:
        for stage in seen[step]["stage"].split("+"):
            if stage not in started and step > steps[0]:
                ax.axvline(step, color="gray", linestyle=":", linewidth=1)
                ax.text(step, 0.98, f" {stage}", va="top", ha="left", rotation=90,
                        color="gray", fontsize=8, transform=ax.get_xaxis_transform())  # fmt: skip
            started.add(stage)
    for step, label in ((SWITCH_AT, " switch"), (SKIP_AT, f" skip {SKIP}")):
        ax.axvline(step, color="red", linewidth=1)
        ax.text(step, 0.98, label, va="top", ha="right", rotation=90, color="red",
                fontsize=8, transform=ax.get_xaxis_transform())  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("loss of the source's rows")
    ax.set_title("per-source training loss (the batch's `source` field)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_source_losses(last: int = 10) -> None:
    """The mean of each source's loss over the last `last` steps trained."""
    seen = {r["step"]: r for r in records()}
    tail = [seen[s]["source_loss"] for s in sorted(seen)[-last:]]
    means = {
        n: np.mean([t[n] for t in tail if n in t]) for n in sorted({n for t in tail for n in t})
    }
    print(f"== loss per source, mean of the last {last} steps: "
          + ", ".join(f"{n} {v:.3f}" for n, v in means.items()), flush=True)  # fmt: skip


def adaptive_run() -> None:
    """Train on code and docs with the reference controller setting the weights every few
    steps (`train.py --adaptive-mix`), check that the ledger of the last checkpoint replays
    every trained batch, and draw the weights it set against the realised shares."""
    run = RUN / "adaptive"
    command = [
        "--data-config", str(ADAPTIVE), "--checkpoint-dir", str(run / "ckpt"), "--steps",
        str(ADAPTIVE_STEPS), "--save-every", str(ADAPTIVE_STEPS), "--width", "64",
        "--adaptive-mix", str(ADAPTIVE_EVERY), "--adaptive-rate", "10", "--metrics",
        str(run / "metrics.jsonl"),
    ]  # fmt: skip
    print(f"== train.py {' '.join(Path(c).name if c.startswith('/') else c for c in command)}",
          flush=True)  # fmt: skip
    subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *command], check=True)
    ledger = data_state.load_ledger(run / "ckpt" / str(ADAPTIVE_STEPS))
    plan = Plan(ledger)
    seen = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in seen:
        if record["checksum"] != checksum(plan.batch(record["step"])["inputs"]):
            raise SystemExit(f"demo: adaptive step {record['step']} differs from its replay")
    docs = [dict(m.weights).get("docs", 0) / sum(dict(m.weights).values()) for m in ledger.mixes]
    if len(set(docs)) < 2:
        raise SystemExit("demo: the adaptive controller never changed the weights")
    print(f"== adaptive check passed: {len(seen)} trained steps match the replay of the "
          f"checkpoint's ledger, whose {len(docs)} set_mix calls moved docs' weight between "
          f"{min(docs):.2f} and {max(docs):.2f}", flush=True)  # fmt: skip
    ledger.save(run / "ledger.json")
    subprocess.run(
        [sys.executable, "-m", "pipeline", "plot", str(ADAPTIVE), "--ledger",
         str(run / "ledger.json"), "--steps", f"0:{ADAPTIVE_STEPS}", "--out",
         str(RUN / "adaptive-mixture.png")],
        check=True,
    )  # fmt: skip


def main() -> int:
    prepare_builtin_stores()
    shutil.rmtree(RUN, ignore_errors=True)
    RUN.mkdir(parents=True)
    kill_at = random.Random().randint(25, SWITCH_AT - 10)
    train("--data-config", str(CURRICULUM), "--steps", str(SWITCH_AT), kill_at=kill_at)
    resumed_at = max(checkpoint_steps())
    train("--data-config", str(CURRICULUM), "--steps", str(SWITCH_AT), "--resume")
    train("--data-config", str(SWITCH), "--steps", str(SKIP_AT), "--resume", "--switch-data")
    before_skip = final_ledger()  # checkpoint SKIP_AT's
    train("--data-config", str(SWITCH), "--steps", str(LAST_STEP), "--resume",
          "--skip-data", str(SKIP))  # fmt: skip
    ledger = final_ledger()
    ledger.save(RUN / "ledger.json")
    check_against_uninterrupted(ledger)
    check_skip(before_skip)
    print(f"== pipeline stages {SWITCH.name} --ledger {(RUN / 'ledger.json').relative_to(ROOT)}",
          flush=True)  # fmt: skip
    if cli(["stages", str(SWITCH), "--ledger", str(RUN / "ledger.json")]):
        raise SystemExit("demo: pipeline stages --ledger failed")
    plot_loss(RUN / "loss.png", kill_at, resumed_at)
    print_source_losses()
    plot_source_loss(RUN / "source-loss.png")
    subprocess.run(
        [sys.executable, "-m", "pipeline", "plot", str(CURRICULUM), "--ledger",
         str(RUN / "ledger.json"), "--steps", f"0:{LAST_STEP}", "--out", str(RUN / "mixture.png")],
        check=True,
    )  # fmt: skip
    print(f"== outputs in {RUN}: metrics.jsonl, ledger.json, loss.png, source-loss.png, "
          "mixture.png, ckpt/")  # fmt: skip
    adaptive_run()
    print(f"== adaptive run in {(RUN / 'adaptive').relative_to(ROOT)}: metrics.jsonl, "
          "ledger.json, ckpt/; its weights in adaptive-mixture.png")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
