"""The reference trainer: it learns, and it resumes and switches data through its checkpoints."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.commands.cli import main
from pipeline.config import load_config
from pipeline.ingest.prepare import PrepareOptions, prepare
from pipeline.plan import data_state
from pipeline.plan.resume import reconcile
from pipeline.read.plan import Plan
from tests.test_gs_paths import trainer

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.multiprocess  # trainer processes: killed (kill -9), and 2 of them


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train")
    prepare(PrepareOptions(["builtin:python-docs"], root / "docs", num_shards=2, progress=False))
    base = "seed: 3\nseq_len: 64\nglobal_batch_size: 8\nsources:\n  docs: {path: docs}\n"
    rare = "  rare: {path: docs}\nmix: {docs: 15, rare: 1}\n"  # absent from most steps
    (root / "data.yaml").write_text(base + rare)
    (root / "bigger.yaml").write_text(base.replace("8\n", "16\n", 1) + rare)
    (root / "two.yaml").write_text(base + "  again: {path: docs}\nmix: {docs: 3, again: 1}\n")
    longer = base.replace("seq_len: 64", "seq_len: 128").replace("sources:", "lanes: 2\nsources:")
    (root / "long.yaml").write_text(longer + rare)  # a context extension of data.yaml
    return root


def arguments(run_dir: Path, config: str, steps: int, *extra: str, name: str) -> list[str]:
    """scripts/train.py's arguments for run `name` (its checkpoints, metrics)."""
    return [
        "--data-config", str(run_dir / config), "--checkpoint-dir",
        str(run_dir / f"{name}-ckpt"), "--steps", str(steps), "--save-every", "10", "--width",
        "32", "--metrics", str(run_dir / f"{name}.jsonl"), *extra,
    ]  # fmt: skip


@functools.cache
def trainer_main():
    """scripts/train.py's `main`, the script loaded once (at the first run, not as the tests
    are collected: it puts scripts/ on sys.path)."""
    return trainer().main


def train(run_dir: Path, config: str, steps: int, *extra: str, name: str = "run"
          ) -> subprocess.CompletedProcess:  # fmt: skip
    """scripts/train.py's `main` run in this process as its command line runs it, with the
    heartbeat file named in its environment: exit status, stdout and stderr (what it prints
    and logs). This process has JAX imported and the trainer's programs in its compilation
    cache, which a new process would spend ~5 s on; the runs killed mid-way (kill -9) are new
    processes (`train_until_killed`) and resume from the checkpoints runs here write."""
    argv = arguments(run_dir, config, steps, *extra, name=name)
    beat = {"PIPELINE_HEARTBEAT": str(run_dir / f"{name}.heartbeat")}  # scripts/heartbeat.py
    return run_in_process(trainer_main(), argv, beat)


def run_in_process(main, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`main(argv)` with `env` added to the environment, its output captured as a process's
    would be: stdout, and stderr with the log lines (the format scripts/train.py gives them).
    The logging level, the environment and the SIGTERM handler (the trainer records SIGTERM
    itself when it is one process) are put back after."""
    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root, level = logging.getLogger(), logging.getLogger().level
    previous = {name: os.environ.get(name) for name in env}
    sigterm = signal.getsignal(signal.SIGTERM)
    root.addHandler(handler)  # before main's logging.basicConfig, which adds none then
    root.setLevel(logging.INFO)
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as stop:  # argparse's refusals
                code = stop.code
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        signal.signal(signal.SIGTERM, sigterm)
        for name, value in previous.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def train_until_killed(run_dir: Path, config: str, saved: int, *extra: str, name: str) -> str:
    """Run train.py and SIGKILL it once its checkpoint `saved` is committed (as a preemption
    without notice would, a step or two later); its stderr."""
    log, checkpoint = run_dir / f"{name}.stderr", run_dir / f"{name}-ckpt" / str(saved)
    argv = [sys.executable, str(ROOT / "scripts" / "train.py"),
            *arguments(run_dir, config, saved + 100, *extra, name=name)]  # fmt: skip
    with (
        open(log, "w") as err,
        subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err) as run,
    ):
        deadline = time.monotonic() + 300
        while run.poll() is None and time.monotonic() < deadline and not checkpoint.is_dir():
            time.sleep(0.05)
        run.kill()
        run.wait()
    assert run.returncode == -signal.SIGKILL, log.read_text()
    return log.read_text()


def records(run_dir: Path, name: str = "run") -> list[dict]:
    return [json.loads(line) for line in (run_dir / f"{name}.jsonl").read_text().splitlines()]


POSITIONS = ("--positions", "128")
"""The shared first run's position table: long enough for long.yaml's seq_len, so the
context-extension test can switch from it (every resume of it passes the same)."""


@pytest.fixture(scope="module")
def first_run(run_dir) -> subprocess.CompletedProcess:
    """data.yaml trained for 20 steps from scratch (checkpoints 10 and 20) under the name
    "base": the first run of several tests, trained once; each test continues a copy
    (`copy_first_run`), never the original."""
    return train(run_dir, "data.yaml", 20, *POSITIONS, name="base")


def copy_first_run(run_dir: Path, first: subprocess.CompletedProcess, name: str) -> None:
    """Give run `name` the shared first run's checkpoints and metrics, as if it had trained
    them itself."""
    assert first.returncode == 0, first.stderr
    shutil.copytree(run_dir / "base-ckpt", run_dir / f"{name}-ckpt", dirs_exist_ok=True)
    shutil.copyfile(run_dir / "base.jsonl", run_dir / f"{name}.jsonl")


def test_the_trainer_writes_a_heartbeat_for_the_watchdog(run_dir, first_run):
    """tpu/recover.sh and the GKE liveness probe read it (tpu/gke, scripts/heartbeat.py)."""
    assert first_run.returncode == 0, first_run.stderr
    beat = (run_dir / "base.heartbeat").read_text()
    assert re.fullmatch(
        r"step=[1-9]\d* time=\d+ host=\S+ process=0 save_seconds=\d+ slowest_process=-?\d+\n", beat
    ), beat


def test_the_trainer_logs_each_sources_loss_and_the_input_wait(run_dir):
    done = train(run_dir, "two.yaml", 6, "--resume", name="two")
    assert done.returncode == 0, done.stderr
    assert "--resume: no checkpoint in" in done.stderr and "starting at step 0" in done.stderr
    plan = Plan.from_config(load_config(run_dir / "two.yaml"))
    for record in records(run_dir, "two"):
        draws = plan.draws(record["step"])
        rows = {n: int((draws.source == i).sum()) for i, n in enumerate(draws.source_names)}
        assert set(record["source_loss"]) == {n for n, r in rows.items() if r}
        # no padding: every row weighs seq_len, so the rows weigh the sources' losses
        mean = sum(record["source_loss"][n] * r for n, r in rows.items() if r) / 8
        assert mean == pytest.approx(record["loss"], rel=1e-5)
        assert record["input_wait_s"] > 0
    line = next(x for x in done.stderr.splitlines() if x.startswith("step 5 |"))
    assert re.search(r"loss \d+\.\d{4} \(again=\d+\.\d{3} docs=\d+\.\d{3}\)", line), line
    assert re.search(r"\| wait \d+\.\d ms \|", line), line


def test_the_trainer_learns_resumes_and_switches(run_dir, first_run):
    first = first_run
    copy_first_run(run_dir, first, "run")
    seen = records(run_dir)
    assert [r["step"] for r in seen] == list(range(20))
    assert all(r["total_weights"] == 8 * 64 for r in seen)
    assert sum(r["loss"] for r in seen[-3:]) / 3 < seen[0]["loss"] - 0.5
    assert "step 19 | stage main | loss" in first.stderr
    assert "joins" not in first.stderr  # rare is in the mixture from step 0, drawn or not

    saved = sorted(p.name for p in (run_dir / "run-ckpt").iterdir())
    again = train(run_dir, "data.yaml", 30)  # no --resume: would start over at step 0 here
    assert (again.returncode, again.stdout) == (2, "")
    assert again.stderr == (
        f"error: {run_dir / 'run-ckpt'}: holds a run's checkpoints (latest step 20); pass "
        "--resume to continue it, or give another --checkpoint-dir\n"
    )
    assert sorted(p.name for p in (run_dir / "run-ckpt").iterdir()) == saved
    assert [r["step"] for r in records(run_dir)] == list(range(20))

    refused = train(run_dir, "bigger.yaml", 30, "--resume", *POSITIONS)
    assert refused.returncode == 2
    assert "global_batch_size: 8 -> 16" in refused.stderr
    assert "declare the switch with --switch-data to switch at step 20" in refused.stderr
    assert "Traceback" not in refused.stderr

    switched = train(run_dir, "bigger.yaml", 30, "--resume", "--switch-data", *POSITIONS)
    assert switched.returncode == 0, switched.stderr
    assert "resumed at step 20" in switched.stderr
    assert "ledger switch at step 20" in switched.stderr
    after = [r for r in records(run_dir) if r["step"] >= 20]
    assert [r["step"] for r in after] == list(range(20, 30))
    assert all(r["total_weights"] == 16 * 64 for r in after)


def checksum(inputs: np.ndarray) -> int:
    """tiny_lm's batch_checksum, in NumPy (uint32 arithmetic wraps the same way)."""
    flat = inputs.reshape(-1).astype(np.uint32)
    weights = np.arange(1, flat.size + 1, dtype=np.uint32) * np.uint32(2654435761)
    return int(np.sum((flat + np.uint32(1)) * weights, dtype=np.uint32))


def dumped_inputs(run_dir: Path, config: str, name: str, checkpoint: int, steps: str):
    """The inputs `pipeline dump --ledger` gives for `steps` of run `name`, from its checkpoint
    `checkpoint`'s ledger."""
    out = run_dir / f"{name}.npz"
    dump = [
        "dump", str(run_dir / config), "--ledger", str(run_dir / f"{name}-ckpt" / str(checkpoint)),
        "--steps", steps, "--out", str(out),
    ]  # fmt: skip
    assert main(dump) == 0  # the CLI's own entry point, in this process: no Python to start
    return np.load(out)["inputs"]


def dumped_checksums(run_dir: Path, config: str, name: str, checkpoint: int, steps: str):
    """The checksums of the batches `dumped_inputs` gives."""
    return [checksum(inputs) for inputs in dumped_inputs(run_dir, config, name, checkpoint, steps)]


def test_the_trainer_skips_data_on_resume_and_dump_replays_what_it_trained(run_dir, first_run):
    copy_first_run(run_dir, first_run, "skip")
    skip = ("--resume", "--skip-data", "10", *POSITIONS)
    skipped = train(run_dir, "data.yaml", 30, *skip, name="skip")
    assert skipped.returncode == 0, skipped.stderr
    assert "ledger skip at step 20: skips 10 steps (serves plan step 30)" in skipped.stderr
    plan = Plan.from_config(load_config(run_dir / "data.yaml"))
    after = [r for r in records(run_dir, "skip") if r["step"] >= 20]
    assert [r["step"] for r in after] == list(range(20, 30))
    assert [r["checksum"] for r in after] == [
        checksum(plan.batch(step + 10)["inputs"]) for step in range(20, 30)
    ]
    dumped = dumped_checksums(run_dir, "data.yaml", "skip", 30, "20:30")
    assert dumped == [r["checksum"] for r in after]


def test_the_trainer_extends_the_context_at_a_switch_and_dump_replays_it(run_dir, first_run):
    """seq_len 64 -> 128 and lanes 1 -> 2 through --switch-data: the trainer trains on the
    switched plan's batches (its position table sized by --positions), dump --ledger agrees."""
    copy_first_run(run_dir, first_run, "long")  # data.yaml, --positions 128
    longer = train(run_dir, "long.yaml", 26, "--resume", "--switch-data", *POSITIONS, name="long")
    assert longer.returncode == 0, longer.stderr
    assert "ledger switch at step 20" in longer.stderr
    after = [r for r in records(run_dir, "long") if r["step"] >= 20]
    assert [r["step"] for r in after] == list(range(20, 26))
    assert all(r["total_weights"] == 8 * 128 for r in after)
    dumped = dumped_checksums(run_dir, "long.yaml", "long", 26, "20:26")
    assert dumped == [r["checksum"] for r in after]
    short = train(run_dir, "long.yaml", 3, "--positions", "64", name="short")
    assert (short.returncode, short.stderr.count("\n")) == (2, 1), short.stderr
    assert "--positions 64 is below the data config's seq_len 128" in short.stderr


def test_a_position_table_of_another_size_is_one_line_before_the_restore(run_dir, first_run):
    """The first run's table holds 128 positions; resuming without --positions sizes the model
    by seq_len 64: one line naming --positions, exit 2, and no ledger switch is logged."""
    copy_first_run(run_dir, first_run, "positions")
    done = train(run_dir, "two.yaml", 22, "--resume", "--switch-data", name="positions")
    assert (done.returncode, done.stdout) == (2, "")
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("error: ")]
    assert line == (
        f"error: {run_dir / 'positions-ckpt'} step 20: the checkpoint's position table holds "
        "128 positions, this run's model 64 (the data config's seq_len, no --positions); give "
        "--positions 128"
    )
    assert "Traceback" not in done.stderr and "ledger switch" not in done.stderr


GRAM = 4  # printable random text: no 4 characters in a row recur elsewhere in the corpus


def random_documents(count: int) -> dict[str, str]:
    """Documents of random printable characters (one byte token each, the store's bytes
    tokenizer), so that any 4 tokens in a row tell which document they come from."""
    rng = random.Random(11)
    return {
        f"doc-{i}": "".join(chr(rng.randint(33, 126)) for _ in range(rng.randint(12, 60)))
        for i in range(count)
    }


def served_documents(inputs: np.ndarray, documents: dict[str, str]) -> set[str]:
    """The documents of which some row of `inputs` holds `GRAM` tokens in a row."""
    pieces = {
        bytes(row[i : i + GRAM].astype(np.uint8).tolist())
        for row in inputs.reshape(-1, inputs.shape[-1])
        for i in range(row.size - GRAM + 1)
        if (row[i : i + GRAM] < 256).all()  # not across an end-of-document token
    }
    return {
        name
        for name, text in documents.items()
        if any(text[i : i + GRAM].encode() in pieces for i in range(len(text) - GRAM + 1))
    }


def test_the_trainer_takes_documents_down_at_a_switch_and_dump_replays_it(run_dir):
    """`exclude: FILE` added at --resume --switch-data: from the restored step on, no excluded
    document's content is trained (concat and best_fit), the steps before replay unchanged, and
    `pipeline dump --ledger` reproduces what the trainer trained on both sides of the switch."""
    documents = random_documents(150)
    corpus = run_dir / "ids.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in documents.items())
    )
    prepare(PrepareOptions([str(corpus)], run_dir / "ids", num_shards=2, id_field="id",
                           progress=False))  # fmt: skip
    sources = (
        "  web: {path: ids%s}\n  chat: {path: ids, packing: best_fit%s}\nmix: {web: 1, chat: 1}\n"
    )
    head = "seed: 3\nseq_len: 64\nglobal_batch_size: 8\nsources:\n"
    (run_dir / "kept.yaml").write_text(head + sources % ("", ""))
    (run_dir / "taken.yaml").write_text(head + sources % ((", exclude: takedown.txt",) * 2))
    plain = Plan.from_config(load_config(run_dir / "kept.yaml"))
    later = np.stack([plain.batch(step)["inputs"] for step in range(10, 14)])
    taken = sorted(served_documents(later, documents))[:6]  # what steps 10.. would have trained
    assert len(taken) == 6
    (run_dir / "takedown.txt").write_text("".join(f"{i}\n" for i in taken))

    first = train(run_dir, "kept.yaml", 10, name="taken")
    assert first.returncode == 0, first.stderr
    switched = train(run_dir, "taken.yaml", 20, "--resume", "--switch-data", name="taken")
    assert switched.returncode == 0, switched.stderr
    assert "ledger switch at step 10: exclude changed" in switched.stderr
    seen = records(run_dir, "taken")
    assert [r["step"] for r in seen] == list(range(20))
    assert [r["checksum"] for r in seen[:10]] == [
        checksum(plain.batch(s)["inputs"]) for s in range(10)
    ]
    dumped = dumped_inputs(run_dir, "taken.yaml", "taken", 20, "0:20")
    assert [checksum(inputs) for inputs in dumped] == [r["checksum"] for r in seen]
    assert served_documents(dumped[10:], documents).isdisjoint(taken)
    assert len(served_documents(dumped[10:], documents)) > 50  # the rest goes on


def test_the_trainers_adaptive_mix_changes_the_weights_and_replays_exactly(run_dir):
    done = train(run_dir, "two.yaml", 14, "--adaptive-mix", "4", name="adaptive")
    assert done.returncode == 0, done.stderr
    seen = records(run_dir, "adaptive")
    mixes = {r["step"]: r["mix"] for r in seen if "mix" in r}
    assert sorted(mixes) == [3, 7, 11]  # set from steps 4, 8, 12
    # the config's 3:1 until the losses have references (10 observations)
    assert mixes[3] == mixes[7] == pytest.approx({"docs": 0.75, "again": 0.25})
    assert mixes[11]["again"] != pytest.approx(0.25, abs=1e-6)  # the losses moved it
    assert "step 11: adaptive mix from step 12" in done.stderr
    dumped = dumped_checksums(run_dir, "two.yaml", "adaptive", 14, "0:14")
    assert dumped == [r["checksum"] for r in seen]
    # resumed, it continues from the weights the ledger holds (none learned yet: the same)
    done = train(run_dir, "two.yaml", 18, "--adaptive-mix", "4", "--resume", name="adaptive")
    assert done.returncode == 0, done.stderr
    resumed = {r["step"]: r["mix"] for r in records(run_dir, "adaptive") if "mix" in r}
    assert resumed[15] == pytest.approx(mixes[11], abs=2**-19)


def test_the_trainer_logs_the_trained_fraction_of_instruction_data(run_dir):
    prepare(
        PrepareOptions(["builtin:python-docstrings"], run_dir / "sft", num_shards=2, progress=False)
    )
    (run_dir / "sft.yaml").write_text(
        "seed: 3\nseq_len: 64\nglobal_batch_size: 8\nsources:\n"
        "  sft: {path: sft, packing: best_fit}\nmix: {sft: 1}\n"
    )
    metrics = run_dir / "sft.jsonl"
    extra = ("--checkpoint-dir", str(run_dir / "sft-ckpt"), "--metrics", str(metrics))
    done = train(run_dir, "sft.yaml", 5, *extra)
    assert done.returncode == 0, done.stderr
    plan = Plan.from_config(load_config(run_dir / "sft.yaml"))
    seen = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in seen] == list(range(5))
    for record in seen:
        trained = int((plan.batch(record["step"])["targets_segmentation"] != 0).sum())
        assert record["total_weights"] == trained
        assert record["trained_fraction"] == trained / (8 * 64) < 1
    assert "| trained " in done.stderr


def test_the_launcher_drops_gloo_lines_also_when_two_threads_split_one(capsys):
    """Gloo prints its connection line from several threads at once: a line can arrive cut in
    two around another ("3 peer ranks. Expected ..." or its last number "3" on a line of its
    own, both seen in a resumed run's stdout), or two written as one with their two newlines
    left as an empty line; neither
    piece nor the empty line is relayed, every other line is."""
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    child = io.StringIO(
        "[Gloo] Rank 0 is connected to [Gloo] Rank 1 is connected to 1 peer ranks. Expected "
        "number of connected peer ranks is : 1\n"
        "3 peer ranks. Expected number of connected peer ranks is : 3\n"
        "step 0 | loss 5.5\n"
        "[Gloo] Rank 2 is connected to 3 peer ranks. Expected number of connected peer ranks "
        "is : [Gloo] Rank 3 is connected to 3 peer ranks. Expected number of connected peer "
        "ranks is : 3\n"
        "3\n"
        "\n"
        "step 1 | loss 5.4\n"
    )
    train.relay_stdout(child)
    assert capsys.readouterr().out == "step 0 | loss 5.5\nstep 1 | loss 5.4\n"


def in_process(argv: list[str]) -> tuple[int, str]:
    """scripts/train.py's `main(argv)` in this process: (exit status, stderr)."""
    done = run_in_process(trainer_main(), argv, {})
    return done.returncode, done.stderr


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--skip-data", "3"], "error: --skip-data needs --resume and a checkpoint to restore "
         "from"),
        (["--switch-data"], "error: --switch-data needs --resume and a checkpoint to restore from"),
        (["--adaptive-mix", "4", "--adaptive-rate", "nan"],
         "argument --adaptive-rate: expected a finite number > 0, got nan"),
        (["--adaptive-mix", "-1"], "argument --adaptive-mix: expected an integer >= 0, got -1"),
        (["--skip-data", "x"], "argument --skip-data: expected an integer >= 0, got 'x'"),
        (["--resume", "--skip-at", "30"], "error: --skip-at S needs --skip-data N (the steps to "
         "pass over at step S)"),
        (["--skip-data", "3", "--skip-at", "-2"],
         "argument --skip-at: expected an integer >= 0, got -2"),
    ],
)  # fmt: skip
def test_the_trainers_usage_errors_name_the_flag_and_exit_2(tmp_path, extra, said):
    argv = ["--data-config", str(tmp_path / "d.yaml"), "--checkpoint-dir", str(tmp_path / "c")]
    code, error = in_process([*argv, *extra])
    assert code == 2 and said in error.splitlines()[-1], error


def test_a_checkpoint_dir_in_an_unreachable_bucket_is_one_line_exit_2(tmp_path, monkeypatch):
    from tests.test_gs_paths import closed_port

    port = closed_port()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    argv = ["--data-config", str(tmp_path / "d.yaml"), "--checkpoint-dir", "gs://b/run"]
    code, error = in_process(argv)
    assert (code, error.count("\n")) == (2, 1), error
    assert error.startswith(
        f"error: gs://b/run: cannot connect to Cloud Storage at 127.0.0.1:{port}"
    )


def test_a_skip_at_a_step_given_to_every_restart_is_made_once(run_dir, first_run):
    """A restart loop re-runs `--resume --skip-data 4 --skip-at 30` after every kill -9: from
    checkpoint 20 (before step 30: scheduled), from 25 (which holds it scheduled), from 35
    (which holds it made): every step trained is the plan's that skips 4 steps at step 30
    once, the last checkpoint's ledger holds that one skip, and `verify --ledger` passes. From
    a checkpoint past step 30 without it the command is refused in one line."""
    copy_first_run(run_dir, first_run, "late")  # checkpoints 10 and 20, no skip
    late = train(run_dir, "data.yaml", 30, "--resume", "--skip-data", "4", "--skip-at", "15",
                 *POSITIONS, name="late")  # fmt: skip
    assert late.returncode == 2, late.stderr
    assert late.stderr.strip().splitlines()[-1] == (
        "error: skip_at 15: the restored step 20 is past it and the checkpoint's ledger holds "
        "no skip there, so a skip of 4 steps at step 15 cannot be made; restore a checkpoint "
        "at or before that step, or skip at the restored step (skip_steps without skip_at)"
    )
    copy_first_run(run_dir, first_run, "loop")
    loop = ("--resume", "--skip-data", "4", "--skip-at", "30", "--save-every", "5", *POSITIONS)
    logs = [train_until_killed(run_dir, "data.yaml", at, *loop, name="loop") for at in (25, 35)]
    done = train(run_dir, "data.yaml", 40, *loop, name="loop")
    assert done.returncode == 0, done.stderr
    assert "skip of 4 steps at step 30 scheduled (restored at step 20)" in logs[0]
    for log, step in ((logs[1], 25), (done.stderr, 35)):  # checkpoint N holds data step N
        assert f"skip of 4 steps at step 30: already in the ledger (restored at step {step})" in log
    config = load_config(run_dir / "data.yaml")
    plan = Plan.from_config(config)
    skipped = Plan(reconcile(plan, config, 30, skip=4), plan.stores())
    trained = records(run_dir, "loop")
    assert {r["step"] for r in trained} == set(range(40))
    for record in trained:  # replayed steps too: the same batch every time
        assert record["checksum"] == checksum(skipped.batch(record["step"])["inputs"]), record
    ledger = data_state.load_ledger(run_dir / "loop-ckpt" / "40")
    assert [(s.start_step, s.skip) for s in ledger.segments] == [(0, 0), (30, 4)]
    verify = ["verify", str(run_dir / "data.yaml"), "--ledger", str(run_dir / "loop-ckpt" / "40"),
              "--steps", "0:40"]  # fmt: skip
    assert main(verify) == 0


@pytest.fixture(scope="module")
def held_dir(tmp_path_factory) -> Path:
    """Two sources, each with its held-out store named like it (`prepare --eval-fraction`)."""
    root = tmp_path_factory.mktemp("held")
    for name in ("python-docs", "python-docstrings"):
        options = PrepareOptions([f"builtin:{name}"], root / name, num_shards=2,
                                 eval_fraction=0.1, progress=False)  # fmt: skip
        prepare(options)
    (root / "held.yaml").write_text(
        "seed: 3\nseq_len: 64\nglobal_batch_size: 8\nlanes: 2\nsources:\n"
        "  docs: {path: python-docs}\n  strings: {path: python-docstrings}\n"
        "mix: {docs: 1, strings: 1}\neval:\n  batches: 2\n  sources:\n"
        "    docs: {path: python-docs-eval}\n    strings: {path: python-docstrings-eval}\n"
    )
    return root


def latest_records(path: Path) -> dict[int, dict]:
    """Each step's record; a step trained again after a kill: the last one."""
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.multiprocess
def test_a_held_out_signal_steers_and_a_kill_resumed_on_one_process_replays(held_dir):
    """`--adaptive-signal eval`: at steps 4, 8, ... the controller observes each source's
    held-out loss (its first evaluation the reference) and sets the mix. Killed (SIGKILL,
    2 processes) after checkpoint 8 and resumed on 1 process, every trained step, before and
    after the kill, is the batch `pipeline dump --ledger` replays from the last checkpoint."""
    ckpt, metrics = held_dir / "ckpt", held_dir / "held.jsonl"
    common = [
        "--data-config", str(held_dir / "held.yaml"), "--checkpoint-dir", str(ckpt),
        "--save-every", "8", "--width", "16", "--depth", "1", "--metrics", str(metrics),
        "--adaptive-mix", "4", "--adaptive-rate", "20", "--adaptive-signal", "eval",
    ]  # fmt: skip
    two = [sys.executable, str(ROOT / "scripts" / "train.py"), *common, "--steps", "1000",
           "--num-processes", "2", "--devices-per-process", "2"]  # fmt: skip
    launcher = subprocess.Popen(two, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 14):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read()
            time.sleep(0.2)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher and both of its processes
        launcher.wait(timeout=60)
    killed = latest_records(metrics)
    assert sorted(r["step"] for r in killed.values() if "held_out_loss" in r)[:3] == [3, 7, 11]
    assert set(killed[3]["held_out_loss"]) == {"docs", "strings"}
    assert killed[3]["mix"] == pytest.approx({"docs": 0.5, "strings": 0.5})  # the reference
    assert killed[7]["mix"]["docs"] != pytest.approx(0.5, abs=1e-3)  # the held-out losses moved it
    resumed = run_in_process(trainer_main(), [*common, "--steps", "20", "--resume"], {})
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed at step 8" in resumed.stderr
    seen = latest_records(metrics)
    assert sorted(seen) == list(range(20)) and "mix" in seen[15]
    out = held_dir / "replay.npz"
    dump = ["dump", str(held_dir / "held.yaml"), "--ledger", str(ckpt / "20"), "--steps", "0:20",
            "--out", str(out)]  # fmt: skip
    assert main(dump) == 0
    replayed = [checksum(inputs) for inputs in np.load(out)["inputs"]]
    assert replayed == [seen[step]["checksum"] for step in range(20)]
