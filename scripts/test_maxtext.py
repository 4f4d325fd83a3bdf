"""`make test-maxtext`: the adapter inside MaxText's real trainer, on the CPU, opt-in.

    python3 scripts/test_maxtext.py [--work runs/maxtext-test] [--python PYTHON3.12]
                                    [--maxtext CHECKOUT]

1. Finds a Python >= 3.12 (MaxText's syntax needs it): --python, $MAXTEXT_PYTHON,
   python3.12 or python3.13 on PATH, or a pyenv version. Stops with one line if there is none.
2. Creates `.venv-maxtext` with the pinned `maxtext` package and the dependencies its trainer
   imports (tests/maxtext_real/requirements.txt, jax/grain/orbax as ours), and this package
   with --no-deps, as docs/maxtext.md tells users to. With `--maxtext CHECKOUT`:
   `.venv-maxtext-checkout`, with the dependencies alone and the GitHub checkout installed
   with `pip install --no-deps -e` (docs/maxtext.md's checkout path).
3. Runs `pipeline maxtext install` on the installed maxtext package (twice: idempotent).
4. Trains a tiny model 20 steps (checkpoints every 5), 1 process x 4 CPU devices: the
   reference. Kills it with -9 after checkpoint 10 and resumes: every logged loss equals the
   reference's bit for bit. Elastic 2 -> 1 (no file edits): 2 processes x 2 devices for 10
   steps, then 1 process x 4 devices, with learning_rate=0 so that each loss fingerprints its
   batch (the train step rounds differently across process counts): every loss within 1e-5 of
   a 1-process run's. From checkpoint 10, a changed data config: refused without the switch,
   recorded in the ledger with it.
5. Steering, from a copy of the learning_rate=0 run's checkpoint 10 (so that each loss is its
   batch's fingerprint): a restore with pipeline_data_skip=4 logs at each step s the loss that
   the uninterrupted run logged at step s + 4, bit for bit, and `pipeline stages --ledger` on
   its checkpoint lists the skip; two launches with pipeline_data_skip=4 and
   pipeline_data_skip_at=8 (from checkpoint 5, the first killed with -9 after checkpoint 10)
   skip once at step 8. A restore with pipeline_data_switch=true and seq_len 64 ->
   128 (max_target_length with it): MaxText's total_weights of each step equals the trained
   targets of the checkpoint ledger's batch, `pipeline verify --ledger` passes across the
   switch (no window served twice in an epoch), and kill -9 after checkpoint 15 and a resume
   log the losses of the run that was not killed, bit for bit. A take-down (the store is
   prepared with --record-ids): a restore with pipeline_data_switch=true and `exclude: FILE`
   naming TAKEN documents that the uninterrupted run trains after checkpoint 10: MaxText's
   total_weights are the checkpoint ledger's batches', `pipeline inspect --ledger` finds none
   of the documents in them (and the uninterrupted plan did), and `pipeline dump --ledger`
   gives the steps before the switch unchanged.
6. Packed SFT: `builtin:python-docstrings` prepared (a masked store), `packing: best_fit`,
   256 tokens, 6 steps: MaxText's own `total_weights` of every step equals the trained targets
   of the plan's batch (`targets_segmentation != 0`), fewer than its document targets.
7. A data error on one of 2 processes: each reads its own copy of the store, process 1's is
   replaced (`prepare --overwrite`) once step 3 is logged: both processes end with exit status
   2 (not MaxText's "Training stopped", status 0) and the line in both logs.

Prints a transcript (also written to WORK/transcript.txt); exits 1 on the first failure.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "tests" / "maxtext_real" / "requirements.txt"  # maxtext==0.2.4 and its deps
DEPENDENCIES = REQUIREMENTS.with_name("requirements-deps.txt")  # the deps alone, for a checkout
STEPS, PERIOD, SWITCH_AT = 20, 5, 10
MODEL = [  # a tiny decoder: what matters is the data path, bit for bit
    "base_emb_dim=64", "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=128",
    "base_num_decoder_layers=2", "head_dim=32", "vocab_size=257", "per_device_batch_size=2",
    "attention=dot_product", "dtype=float32",
]  # fmt: skip
CPU = ["hardware=cpu", "enable_goodput_recording=false", "monitor_goodput=false"]
GLOO_TIMEOUT = "Gloo context initialization failed: DEADLINE_EXCEEDED"
# XLA:CPU's fixed 40 s rendezvous between one process's simulated devices (jax-ml/jax#31818):
# its message, and the function in the stack trace of the abort when the message is cut off
XLA_CPU_STUCK = ("Termination timeout for all reduce", "AwaitAndLogIfStuck")
SEQ_LEN = 64  # the data configs' seq_len, and MaxText's max_target_length with them
DATA = "seed: 5\nseq_len: %d\nglobal_batch_size: 8\nsources:\n  docs: {path: %s}\n"
SKIP = 4  # pipeline_data_skip of the restore at checkpoint SWITCH_AT
SKIP_AT = 8  # pipeline_data_skip_at of the restart loop that restores checkpoint PERIOD
LONG_SEQ_LEN, LONG_KILL = 128, 15  # the seq_len switch, and the checkpoint its kill -9 follows
TAKEN = 3  # documents taken down at the switch, of those the uninterrupted run trains after it
SFT_SEQ_LEN, SFT_STEPS = 256, 6  # docstring pairs fit 256 tokens, several to a row
SFT = (f"seed: 5\nseq_len: {SFT_SEQ_LEN}\nglobal_batch_size: 8\n"
       "sources:\n  sft: {path: %s, packing: best_fit}\nmix: {sft: 1}\n")  # fmt: skip
STOP_STEPS, STOP_AFTER, STOP_WAIT = 400, 3, 120  # the store is replaced once step 3 is logged
REPLACED = "the store was replaced or changed after it was opened"


class Failed(Exception):
    pass


def cpu_flake(logs: list[Path]) -> str | None:
    """The known timeout of the simulated CPU setup (not ours) that ended a launch, if any:
    XLA:CPU's stuck all-reduce in any process's log, or with several processes Gloo's."""
    every = "\n".join(log.read_text() for log in logs)  # either process may be stuck
    if any(sign in every for sign in XLA_CPU_STUCK):
        return XLA_CPU_STUCK[0]
    if len(logs) > 1 and GLOO_TIMEOUT in every:
        return GLOO_TIMEOUT
    return None


class Transcript:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("w")

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self._file.write(line + "\n")
        self._file.flush()


def find_python(given: str | None) -> str:
    candidates = [given, os.environ.get("MAXTEXT_PYTHON"), "python3.12", "python3.13"]
    root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(f"{root}/versions/3.1[2-9]*/bin/python3"))
    for candidate in filter(None, candidates):
        try:
            done = subprocess.run(
                [candidate, "-c", "import sys, venv; print(sys.version_info >= (3, 12))"],
                capture_output=True,
                text=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if done.returncode == 0 and done.stdout.strip() == "True":
            return candidate
    raise Failed(
        "make test-maxtext needs python3.12 (or newer) with venv: MaxText's source uses "
        "Python 3.12 syntax; install one (e.g. Debian's python3.12 package or pyenv) or set "
        "MAXTEXT_PYTHON=/path/to/python3.12"
    )


def ensure_venv(python: str, say: Transcript, checkout: Path | None) -> Path:
    """`.venv-maxtext` with the maxtext package, or `.venv-maxtext-checkout` with a GitHub
    checkout installed editable (importable as `maxtext`), as docs/maxtext.md section 1 says."""
    venv = ROOT / (".venv-maxtext-checkout" if checkout else ".venv-maxtext")
    stamp = venv / ".installed"
    inputs = [REQUIREMENTS, DEPENDENCIES, ROOT / "pyproject.toml"]
    fresh = stamp.exists() and all(p.stat().st_mtime <= stamp.stat().st_mtime for p in inputs)
    if fresh and stamp.read_text() == str(checkout or ""):
        return venv / "bin" / "python"
    started = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    run([python, "-m", "venv", str(venv)])
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    run([*pip, "--upgrade", "pip"])
    if checkout:
        run([*pip, "-r", str(DEPENDENCIES)])
        run([*pip, "--no-deps", "-e", str(checkout)])
    else:
        run([*pip, "-r", str(REQUIREMENTS)])
    run([*pip, "--no-deps", "-e", str(ROOT)])  # MaxText's jax/grain/orbax pins stay
    stamp.write_text(str(checkout or ""))
    say(f"== {venv.name} created in {time.monotonic() - started:.0f} s ({python})")
    return venv / "bin" / "python"


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise Failed(f"{' '.join(command[:4])} ... exited {done.returncode}:\n" + "\n".join(tail))
    return done


class MaxText:
    """Launches MaxText's trainer on the CPU: one or several processes of one run."""

    def __init__(self, python: Path, work: Path, say: Transcript) -> None:
        self.python, self.work, self.say = python, work, say
        found = run([str(python), "-c", "import importlib.util as u; "
                     "print(u.find_spec('maxtext').submodule_search_locations[0])"])  # fmt: skip
        self.package = Path(found.stdout.strip())
        self.base_yml = self.package / "configs" / "base.yml"

    def command(
        self, run_name: str, data: Path, steps: int, metrics: Path, seq_len: int, *extra: str
    ) -> list[str]:
        return [
            str(self.python), "-m", "maxtext.trainers.pre_train.train", str(self.base_yml),
            f"run_name={run_name}", f"base_output_directory={self.work / 'out'}",
            "dataset_type=grain", "grain_train_files=unused",  # MaxText requires a value
            f"pipeline_data_config={data}", f"steps={steps}", f"checkpoint_period={PERIOD}",
            "enable_checkpointing=true", "eval_interval=-1", f"metrics_file={metrics}",
            f"max_target_length={seq_len}", *MODEL, *CPU, *extra,
        ]  # fmt: skip

    def env(self, devices: int, process: int | None = None, processes: int = 1) -> dict:
        env = dict(os.environ, DECOUPLE_GCLOUD="TRUE", JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
        env.pop("PIPELINE_DATA_CONFIG", None)
        if process is not None:  # MaxText's CPU launcher variables (max_utils)
            env.update(JAX_COORDINATOR_ADDRESS="127.0.0.1", JOB_INDEX="0",
                       JOB_COMPLETION_INDEX=str(process), PROCESSES_IN_JOB=str(processes),
                       JAX_PROCESS_COUNT=str(processes))  # fmt: skip
        return env

    def launch(
        self, name: str, data: list[Path], steps: int, extra: tuple[str, ...], seq_len: int
    ) -> tuple[list[subprocess.Popen], list[Path]]:
        """Start the processes of one launch of run `name` (`data`: one config per process),
        each with its own log and metrics file (`name-<launch>-p<process>`)."""
        processes = len(data)
        procs, logs = [], []
        launch = len(list(self.work.glob(f"{name}-*-p0.log")))
        for i in range(processes):
            log = self.work / f"{name}-{launch}-p{i}.log"
            metrics = log.with_suffix(".jsonl")
            flags = [*extra] + (["skip_jax_distributed_system=true"] if processes == 1 else [])
            env = self.env(4 // processes, i if processes > 1 else None, processes)
            with log.open("w") as out:
                command = self.command(name, data[i], steps, metrics, seq_len, *flags)
                procs.append(subprocess.Popen(command, env=env, stdout=out, stderr=out))
            logs.append(log)
        return procs, logs

    def train(
        self,
        name: str,
        data: Path,
        steps: int,
        *extra: str,
        processes: int = 1,
        kill_after: int | None = None,
        expect_failure: bool = False,
        retry: bool = True,
        seq_len: int = SEQ_LEN,
    ) -> list[str]:
        """Run to the end (or kill -9 once checkpoint `kill_after` exists); the logs.

        MaxText stops a run with exit code 0 when a checkpoint fails, so a run that did not
        log its last step fails here. Two causes are not ours, both fixed timeouts of the
        simulated CPU setup on an oversubscribed CPU: one process may reach the first
        cross-process collective (the first checkpoint) more than Gloo's 30 s after the other,
        or XLA:CPU aborts a step whose all-reduce between one process's simulated devices
        waited over 40 s. Such a launch is retried once, from scratch, and the transcript says
        so.
        """
        started = time.monotonic()
        procs, logs = self.launch(name, [data] * processes, steps, extra, seq_len)
        launch = logs[0].name.split("-")[-2]
        killed = False
        deadline = time.monotonic() + 900
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise Failed(f"{name}: still running after 900 s ({logs[0]})")
            ckpt = self.work / "out" / name / "checkpoints" / str(kill_after)
            if kill_after is not None and ckpt.is_dir() and not killed:
                for p in procs:
                    p.send_signal(signal.SIGKILL)
                killed = True
            time.sleep(0.2)
        codes = [p.returncode for p in procs]
        what = self.what(processes)
        took = f"{time.monotonic() - started:.0f} s"
        if killed:
            self.say(f"== {name}: {what}: kill -9 once checkpoint {kill_after} exists ({took})")
        elif expect_failure:
            if not any(codes):
                raise Failed(f"{name}: expected a refusal, but it ran ({logs[0]})")
            self.say(f"== {name}: {what}: refused as expected ({took})")
        elif any(codes) or steps - 1 not in self.losses(name, launch):
            text = logs[0].read_text()
            cause = cpu_flake(logs)
            if retry and cause:
                self.say(f"== {name}: {what}: {cause} ({took}), once more")
                self.forget(name, logs)
                return self.train(name, data, steps, *extra, processes=processes, retry=False,
                                  seq_len=seq_len)  # fmt: skip
            if any(codes):
                tail = text.strip().splitlines()[-15:]
                raise Failed(f"{name}: exited {codes}:\n" + "\n".join(tail))
            stopped = next((x for x in text.splitlines() if "Training stopped" in x), "")
            raise Failed(f"{name}: exited 0 before step {steps - 1} ({logs[0]}) {stopped}")
        else:
            self.say(
                f"== {name}: {what}, to step {steps}{''.join(' ' + x for x in extra)} ({took})"
            )
        return [log.read_text() for log in logs]

    def stop_on_data_error(
        self, name: str, data: list[Path], replace: Callable[[], None], retry: bool = True
    ) -> list[str]:
        """Start `len(data)` processes for STOP_STEPS steps, call `replace()` once step
        STOP_AFTER is logged, then wait for every process to end; the logs."""
        started = time.monotonic()
        procs, logs = self.launch(name, data, STOP_STEPS, (), SEQ_LEN)
        metrics = logs[0].with_suffix(".jsonl")
        deadline = time.monotonic() + 900
        while not (metrics.exists() and f'"step": {STOP_AFTER}' in metrics.read_text()):
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                    p.wait()
                cause = cpu_flake(logs)
                if retry and cause:
                    self.say(f"== {name}: {cause}, once more")
                    self.forget(name, logs)
                    return self.stop_on_data_error(name, data, replace, retry=False)
                tail = logs[0].read_text().strip().splitlines()[-15:]
                raise Failed(f"{name}: ended before step {STOP_AFTER}:\n" + "\n".join(tail))
            time.sleep(0.2)
        replace()
        replaced = time.monotonic()
        while any(p.poll() is None for p in procs):
            if time.monotonic() - replaced > STOP_WAIT:
                for p in procs:
                    p.kill()
                    p.wait()
                raise Failed(f"{name}: still running {STOP_WAIT} s after the replacement")
            time.sleep(0.2)
        codes = [p.returncode for p in procs]
        last = max(self.losses(name), default=-1)
        self.say(f"== {name}: {self.what(len(data))}: store replaced after step {STOP_AFTER}, "
                 f"stopped after step {last} in {time.monotonic() - replaced:.0f} s, exit "
                 f"codes {codes} ({time.monotonic() - started:.0f} s)")  # fmt: skip
        if codes != [2] * len(data):
            raise Failed(f"{name}: exit codes {codes}, expected 2 (a data error) from each")
        return [log.read_text() for log in logs]

    def what(self, processes: int) -> str:
        return f"{processes} process{'es' if processes > 1 else ''} x {4 // processes} CPU devices"

    def forget(self, name: str, logs: list[Path]) -> None:
        """Remove a launch's files, to launch it once more from scratch."""
        for path in [*logs, *(log.with_suffix(".jsonl") for log in logs)]:
            path.unlink(missing_ok=True)
        shutil.rmtree(self.work / "out" / name, ignore_errors=True)

    def losses(self, name: str, launch: int | str = "*") -> dict[int, float]:
        """step -> loss over the metrics files of run `name`, in launch order (MaxText writes
        one per launch here: its own file is rewritten by a step-0 record and shared by
        processes)."""
        return self.metric(name, "learning/loss", launch)

    def weights(self, name: str) -> dict[int, int]:
        """step -> MaxText's `total_weights`: the targets its loss counted."""
        return {s: int(w) for s, w in self.metric(name, "learning/total_weights").items()}

    def metric(self, name: str, key: str, launch: int | str = "*") -> dict[int, float]:
        out: dict[int, float] = {}
        for path in sorted(self.work.glob(f"{name}-{launch}-p0.jsonl")):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                out[int(record["step"])] = record[key]
        return out


def same_losses(
    say: Transcript, mt: MaxText, name: str, reference: dict[int, float], tolerance: float = 0.0
) -> None:
    """Every step's loss equals the reference's: bit for bit, or within a relative `tolerance`
    where the process count differs (a cross-process sum on the CPU rounds differently: the
    losses of step 0, before any restore, already differ in the 7th digit)."""
    got = mt.losses(name)
    if sorted(got) != list(range(STEPS)):
        raise Failed(f"{name}: logged steps {sorted(got)}, expected 0..{STEPS - 1}")
    error = {s: abs(got[s] - reference[s]) / abs(reference[s]) for s in got}
    worst = max(error, key=error.get)
    if error[worst] > tolerance:
        raise Failed(f"{name}: step {worst} loss {got[worst]!r} != reference {reference[worst]!r}")
    if tolerance == 0.0:
        say(f"   {name}: all {STEPS} losses equal the reference bit for bit "
            f"(step 0 {got[0]!r}, step {STEPS - 1} {got[STEPS - 1]!r})")  # fmt: skip
    else:
        same = sum(got[s] == reference[s] for s in got)
        shift = min(abs(reference[s + 1] - reference[s]) / reference[s] for s in range(STEPS - 1))
        say(f"   {name}: all {STEPS} losses within {error[worst]:.1e} (relative) of the "
            f"reference, {same} bit for bit (the next step's batch would differ by "
            f">= {shift:.1e})")  # fmt: skip
        if shift <= 10 * tolerance:
            raise Failed(f"{name}: the losses cannot tell batches apart (steps differ by {shift})")


PLANNED_TARGETS = """import json, sys
from pipeline.config import load_config
from pipeline.plan import data_state
from pipeline.read.plan import Plan
config, ledger, first, stop = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
plan = Plan.from_config(load_config(config))
if ledger:
    plan = Plan(data_state.load_ledger(ledger), plan.store_set, exclude_files=plan.exclude_files)
for step in range(first, stop):
    batch = plan.batch(step)
    print(json.dumps([int((batch[k] != 0).sum()) for k in
                      ('targets_segmentation', 'inputs_segmentation')] + [batch['inputs'].size]))
"""


def planned_targets(
    python: Path, data: Path, steps: range, ledger: Path | None = None
) -> list[list[int]]:
    """[trained targets, document targets, target slots] of each step's batch, from the plan
    of `data` (or of the ledger of checkpoint `ledger`), computed in MaxText's venv."""
    argv = [str(data), str(ledger or ""), str(steps.start), str(steps.stop)]
    out = run([str(python), "-c", PLANNED_TARGETS, *argv]).stdout.splitlines()
    return [json.loads(line) for line in out]


def same_trained_targets(say: Transcript, mt: MaxText, python: Path, data: Path) -> None:
    """MaxText's `total_weights` (its loss weights, `targets_segmentation != 0`, summed) of
    every step equals the trained targets of the plan's batch, fewer than its real targets:
    the prompts and the rows' padded tails carried no loss in MaxText's own train step."""
    planned = planned_targets(python, data, range(SFT_STEPS))
    weights = mt.weights("sft")
    if sorted(weights) != list(range(SFT_STEPS)):
        raise Failed(f"sft: logged steps {sorted(weights)}, expected 0..{SFT_STEPS - 1}")
    for step, (trained, real, _) in enumerate(planned):
        if weights[step] != trained:
            raise Failed(f"sft: step {step}: MaxText's total_weights {weights[step]} != the "
                         f"plan's {trained} trained targets")  # fmt: skip
        if trained >= real:
            raise Failed(f"sft: step {step}: {trained} trained of {real} targets: no prompt")
    trained, real, slots = map(sum, zip(*planned))
    if real == slots:
        raise Failed(f"sft: {slots} target slots and no padding: no row was packed best-fit")
    say(f"   sft: MaxText's total_weights of all {SFT_STEPS} steps equal the planned trained "
        f"targets: {trained:,} of {real:,} document targets ({slots:,} slots; prompts and "
        "padding have targets_segmentation 0)")  # fmt: skip


def skip_data(say: Transcript, mt: MaxText, python: Path, data: Path) -> None:
    """Restore the learning_rate=0 run's checkpoint SWITCH_AT with pipeline_data_skip=SKIP:
    each loss is its batch's fingerprint, so step s must log the loss of the uninterrupted
    run's step s + SKIP (the plan's batch of that step), bit for bit (same process count)."""
    work = mt.work
    shutil.copytree(work / "out/frozen/checkpoints" / str(SWITCH_AT),
                    work / "out/skip/checkpoints" / str(SWITCH_AT))  # fmt: skip
    stop = STEPS - SKIP
    log = mt.train("skip", data, stop, "learning_rate=0", f"pipeline_data_skip={SKIP}")[0]
    first = SWITCH_AT + 1  # MaxText's checkpoint N holds the data state of step N + 1
    entry = f"ledger skip at step {first}: skips {SKIP} steps (serves plan step {first + SKIP})"
    if entry not in log:
        raise Failed(f"skip: the log does not say '{entry}'")
    say(f"   {entry}")
    got, frozen = mt.losses("skip"), mt.losses("frozen")
    if sorted(got) != list(range(first, stop)):
        raise Failed(f"skip: logged steps {sorted(got)}, expected {first}..{stop - 1}")
    for step in got:
        if got[step] != frozen[step + SKIP]:
            raise Failed(f"skip: step {step} loss {got[step]!r} != the loss of plan step "
                         f"{step + SKIP} {frozen[step + SKIP]!r}")  # fmt: skip
    if all(got[step] == frozen[step] for step in got):
        raise Failed("skip: the losses cannot tell the skipped batches apart")
    say(f"   skip: steps {first}..{stop - 1} logged the losses of the uninterrupted run's steps "
        f"{first + SKIP}..{stop - 1 + SKIP}, bit for bit")  # fmt: skip
    checkpoint = work / "out/skip/checkpoints" / str(stop - 1)
    out = run([str(python), "-m", "pipeline", "stages", str(data), "--ledger", str(checkpoint)])
    listed = f"ledger segment from step {first}: skip {SKIP} steps"
    line = next((x for x in out.stdout.splitlines() if listed in x), None)
    if line is None:
        raise Failed(f"skip: pipeline stages --ledger {checkpoint} does not list '{listed}'")
    shown = line.split(";")[0].strip()
    say(f"   $ pipeline stages --ledger {checkpoint.relative_to(work)}: {shown}")


def skip_at(say: Transcript, mt: MaxText, data: Path) -> None:
    """The idempotent skip: pipeline_data_skip=SKIP with pipeline_data_skip_at=SKIP_AT, given to
    every launch of a restart loop. From the learning_rate=0 run's checkpoint PERIOD (before
    SKIP_AT: the skip is scheduled), killed with -9 once checkpoint SWITCH_AT exists (past
    SKIP_AT, holding the skip), then again with the same keys: nothing more is skipped, and
    step s logs the uninterrupted run's loss of step s (s < SKIP_AT) or s + SKIP, bit for bit."""
    work = mt.work
    shutil.copytree(work / "out/frozen/checkpoints" / str(PERIOD),
                    work / "out/skipat/checkpoints" / str(PERIOD))  # fmt: skip
    keys = ("learning_rate=0", f"pipeline_data_skip={SKIP}", f"pipeline_data_skip_at={SKIP_AT}")
    first = mt.train("skipat", data, STEPS, *keys, kill_after=SWITCH_AT)[0]
    stop = STEPS - SKIP
    again = mt.train("skipat", data, stop, *keys)[0]
    for log, said in ((first, f"at step {SKIP_AT} scheduled (restored at step {PERIOD + 1})"),
                      (again, f"at step {SKIP_AT}: already in the ledger (restored at step "
                              f"{SWITCH_AT + 1})")):  # fmt: skip
        line = next((x for x in log.splitlines() if f"skip of {SKIP} steps {said}" in x), None)
        if line is None:
            raise Failed(f"skip_at: a launch does not log 'skip of {SKIP} steps {said}'")
        say(f"   {line.strip()}")
    got, frozen = mt.losses("skipat"), mt.losses("frozen")
    if sorted(got) != list(range(PERIOD + 1, stop)):
        raise Failed(f"skip_at: logged steps {sorted(got)}, expected {PERIOD + 1}..{stop - 1}")
    for step in got:
        planned = step + SKIP * (step >= SKIP_AT)
        if got[step] != frozen[planned]:
            raise Failed(f"skip_at: step {step} loss {got[step]!r} != the loss of plan step "
                         f"{planned} {frozen[planned]!r}")  # fmt: skip
    say(f"   skip_at: two launches with the same keys skipped {SKIP} steps once, at step "
        f"{SKIP_AT}: steps {SKIP_AT}..{stop - 1} logged the uninterrupted run's losses of steps "
        f"{SKIP_AT + SKIP}..{stop - 1 + SKIP}, bit for bit")  # fmt: skip


def switch_seq_len(say: Transcript, mt: MaxText, python: Path, docs: Path) -> None:
    """Restore the learning_rate=0 run's checkpoint SWITCH_AT with pipeline_data_switch=true and
    seq_len SEQ_LEN -> LONG_SEQ_LEN: MaxText trains the switched plan's batches (its
    total_weights of each step are their targets), `pipeline verify --ledger` passes across the
    switch, and kill -9 after checkpoint LONG_KILL and a resume log the uninterrupted losses."""
    work = mt.work
    data = work / "data-long.yaml"
    data.write_text(DATA % (LONG_SEQ_LEN, docs) + "mix: {docs: 1}\n")
    flags = ("learning_rate=0", "pipeline_data_switch=true")
    for name in ("long", "longkill"):
        shutil.copytree(work / "out/frozen/checkpoints" / str(SWITCH_AT),
                        work / "out" / name / "checkpoints" / str(SWITCH_AT))  # fmt: skip
    log = mt.train("long", data, STEPS, *flags, seq_len=LONG_SEQ_LEN)[0]
    said = "ledger switch at step"
    line = next((x[x.index(said) :] for x in log.splitlines() if said in x), "")
    if "seq_len" not in line.split(";")[0]:
        raise Failed(f"long: the log does not say that the switch changed seq_len: {line!r}")
    say(f"   {line.strip()}")
    first = SWITCH_AT + 1
    checkpoint = work / "out/long/checkpoints" / str(STEPS - 1)
    planned = planned_targets(python, data, range(first, STEPS), checkpoint)
    weights = mt.weights("long")
    for step, (trained, _, slots) in zip(range(first, STEPS), planned):
        if weights.get(step) != trained or slots != 8 * LONG_SEQ_LEN:
            raise Failed(f"long: step {step}: MaxText's total_weights {weights.get(step)} != the "
                         f"plan's {trained} trained targets of {slots} slots")  # fmt: skip
    say(f"   long: MaxText's total_weights of steps {first}..{STEPS - 1} equal the trained "
        f"targets of the checkpoint ledger's batches, {8 * LONG_SEQ_LEN} each "
        f"(8 x {LONG_SEQ_LEN})")  # fmt: skip
    out = run([str(python), "-m", "pipeline", "verify", str(data), "--ledger", str(checkpoint),
               "--steps", f"0:{STEPS}"])  # fmt: skip
    say(f"   $ pipeline verify --ledger {checkpoint.relative_to(work)} --steps 0:{STEPS}: "
        f"{out.stdout.strip().splitlines()[-1]}")  # fmt: skip
    mt.train("longkill", data, STEPS, *flags, seq_len=LONG_SEQ_LEN, kill_after=LONG_KILL)
    mt.train("longkill", data, STEPS, "learning_rate=0", seq_len=LONG_SEQ_LEN)
    got, want = mt.losses("longkill"), mt.losses("long")
    if sorted(got) != list(range(first, STEPS)) or any(got[s] != want[s] for s in got):
        raise Failed(f"longkill: losses {got} != the uninterrupted run's {want}")
    say(
        f"   longkill: kill -9 after checkpoint {LONG_KILL} and a resume (no switch key): "
        f"steps {first}..{STEPS - 1} logged the uninterrupted run's losses, bit for bit"
    )


def served_ids(python: Path, data: Path, steps: range, ledger: Path | None = None) -> set[str]:
    """The ids of the documents with a token in the batches of `steps`, as `pipeline inspect`
    lists them (of `data`'s plan, or of the ledger of checkpoint `ledger`)."""
    ids: set[str] = set()
    for step in steps:
        command = [str(python), "-m", "pipeline", "inspect", str(data), "--step", str(step),
                   "--preview", "0"] + (["--ledger", str(ledger)] if ledger else [])  # fmt: skip
        for line in run(command).stdout.splitlines():
            listed = re.fullmatch(r"\s*ids? (.*)", line)
            if listed:
                ids.update(ast.literal_eval(f"[{listed[1]}]"))
    return ids


SAME_INPUTS = """import sys, numpy as np
a, b = (np.load(path)["inputs"] for path in sys.argv[1:])
print(a.shape == b.shape and bool((a == b).all()))
"""


def same_dumps(python: Path, steps: range, *dumps: tuple[Path, Path | None]) -> bool:
    """Whether `pipeline dump` gives the same inputs for `steps` of each (config, ledger)."""
    outs = []
    for i, (config, ledger) in enumerate(dumps):
        out = config.with_name(f"{config.stem}-{i}.npz")
        run([str(python), "-m", "pipeline", "dump", str(config), "--steps",
             f"{steps.start}:{steps.stop}", "--out", str(out)]
            + (["--ledger", str(ledger)] if ledger else []))  # fmt: skip
        outs.append(str(out))
    return run([str(python), "-c", SAME_INPUTS, *outs]).stdout.strip() == "True"


def take_down(say: Transcript, mt: MaxText, python: Path, data: Path, docs: Path) -> None:
    """Restore the learning_rate=0 run's checkpoint SWITCH_AT with pipeline_data_switch=true and
    `exclude: FILE` listing TAKEN documents the uninterrupted run trains after it: MaxText trains
    the checkpoint ledger's batches (total_weights), which hold no token of them, and the ledger
    replays the steps before the switch as the uninterrupted plan."""
    work, after = mt.work, range(SWITCH_AT + 1, STEPS)
    would = served_ids(python, data, after)
    taken = sorted(would)[:TAKEN]
    if len(taken) < TAKEN:
        raise Failed(f"taken: steps {after.start}..{STEPS - 1} serve {len(would)} documents")
    listing = work / "takedown.txt"
    listing.write_text("".join(json.dumps(i) + "\n" for i in taken))  # a JSON string per line
    config = work / "data-taken.yaml"
    config.write_text(DATA % (SEQ_LEN, f"{docs}, exclude: {listing}") + "mix: {docs: 1}\n")
    shutil.copytree(work / "out/frozen/checkpoints" / str(SWITCH_AT),
                    work / "out/taken/checkpoints" / str(SWITCH_AT))  # fmt: skip
    log = mt.train("taken", config, STEPS, "learning_rate=0", "pipeline_data_switch=true")[0]
    said = f"ledger switch at step {after.start}: exclude changed"
    if said not in log:
        raise Failed(f"taken: the log does not say '{said}'")
    say(f"   {said}; {listing.name} lists {', '.join(taken)}")
    checkpoint = work / "out/taken/checkpoints" / str(STEPS - 1)
    weights, got, frozen = mt.weights("taken"), mt.losses("taken"), mt.losses("frozen")
    for step, (trained, _, _) in zip(after, planned_targets(python, config, after, checkpoint)):
        if weights.get(step) != trained:
            raise Failed(f"taken: step {step}: MaxText's total_weights {weights.get(step)} != "
                         f"the ledger plan's {trained} trained targets")  # fmt: skip
    if sorted(got) != list(after) or all(got[s] == frozen[s] for s in after):
        raise Failed(f"taken: losses {got}: the uninterrupted run's {frozen}, or steps missing")
    served = served_ids(python, config, after, checkpoint)
    if served & set(taken) or not served:
        raise Failed(f"taken: steps {after.start}..{STEPS - 1} of the ledger serve {served}")
    say(f"   taken: MaxText's total_weights of steps {after.start}..{STEPS - 1} equal the "
        f"checkpoint ledger's batches; pipeline inspect --ledger finds {len(served)} "
        f"documents in them, none taken down (the uninterrupted plan's: {len(would)})")  # fmt: skip
    before = range(after.start)
    if not same_dumps(python, before, (config, checkpoint), (data, None)):
        raise Failed(f"taken: pipeline dump --ledger {checkpoint} --steps 0:{after.start} "
                     "differs from the uninterrupted plan's batches")  # fmt: skip
    say(f"   $ pipeline dump --ledger {checkpoint.relative_to(work)} --steps 0:{after.start}: "
        "the uninterrupted plan's batches")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "maxtext-test")
    parser.add_argument("--python", help="a Python >= 3.12 for .venv-maxtext")
    parser.add_argument(
        "--maxtext",
        type=Path,
        metavar="CHECKOUT",
        help="a GitHub checkout of MaxText to test instead of the maxtext package",
    )
    args = parser.parse_args(argv)
    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    say = Transcript(work / "transcript.txt")
    started = time.monotonic()
    try:
        checkout = args.maxtext.resolve() if args.maxtext else None
        python = ensure_venv(find_python(args.python), say, checkout)
        mt = MaxText(python, work, say)
        for _ in range(2):
            out = run([str(python), "-m", "pipeline", "maxtext", "install", str(mt.package)])
            say(f"$ pipeline maxtext install {mt.package}")
            for line in out.stdout.strip().splitlines():
                say(f"  {line}")
        docs = work / "docs"
        run([str(python), "-m", "pipeline", "prepare", "builtin:python-docs", "--out", str(docs),
             "--num-shards", "2", "--record-ids", "--no-progress"])  # fmt: skip
        data = work / "data.yaml"
        data.write_text(DATA % (SEQ_LEN, docs) + "mix: {docs: 1}\n")
        switched = work / "data-switch.yaml"
        switched.write_text(
            DATA % (SEQ_LEN, docs) + f"  again: {{path: {docs}}}\nmix: {{docs: 1, again: 1}}\n"
        )

        mt.train("reference", data, STEPS)
        reference = mt.losses("reference")

        mt.train("resume", data, STEPS, kill_after=SWITCH_AT)
        log = mt.train("resume", data, STEPS)[0]
        model = re.search(r"restoring from this run's directory step (\d+)", log)
        data_step = re.search(r"restored the data state at step (\d+)", log)
        if model is None or data_step is None:
            raise Failed("resume: the model or the data state was not restored")
        if int(data_step[1]) != int(model[1]) + 1:  # what set_state cannot check itself
            raise Failed(f"resume: checkpoint {model[1]} restored data step {data_step[1]}")
        say(f"   resume: MaxText restored checkpoint {model[1]}, the data state step "
            f"{data_step[1]} (the step after it)")  # fmt: skip
        same_losses(say, mt, "resume", reference)

        # Across process counts the train step itself rounds differently, and the optimizer
        # amplifies that; with learning_rate=0 each loss is a fingerprint of its batch alone.
        frozen = "learning_rate=0"
        mt.train("frozen", data, STEPS, frozen)
        mt.train("elastic", data, SWITCH_AT, frozen, processes=2)
        iter_files = sorted(p.name for p in (work / "out/elastic/checkpoints/9/iter").iterdir())
        say(f"   elastic: checkpoint 9 iter/ holds {', '.join(iter_files)}")
        mt.train("elastic", data, STEPS, frozen)
        same_losses(say, mt, "elastic", mt.losses("frozen"), tolerance=1e-5)

        shutil.copytree(work / "out/reference/checkpoints" / str(SWITCH_AT),
                        work / "out/switch/checkpoints" / str(SWITCH_AT))  # fmt: skip
        refused = mt.train("switch", switched, STEPS, expect_failure=True)[0]
        flag = "declare the switch with pipeline_data_switch=true"
        line = next((x for x in refused.splitlines() if flag in x), None)
        if line is None:
            raise Failed(f"switch: the refusal does not say '{flag}'")
        say(f"   {line.strip()}")
        added = f"sources.again: <absent> -> {docs} (store "  # the added source, by its path
        line = next((x for x in refused.splitlines() if added in x), None)
        if line is None:
            raise Failed(f"switch: the refusal does not name the added source: '{added}'")
        say(f"   {line.strip()}")
        mt.train("switch", switched, STEPS, "pipeline_data_switch=true")
        state = json.loads((work / f"out/switch/checkpoints/{STEPS - 1}/iter/process_0.json")
                           .read_text())  # fmt: skip
        starts = [segment["start_step"] for segment in state["ledger"]["segments"]]
        if starts != [0, SWITCH_AT + 1]:
            raise Failed(f"switch: ledger segments start at {starts}")
        say(f"   switch: the ledger records the switch: segments start at steps {starts}")

        skip_data(say, mt, python, data)
        skip_at(say, mt, data)
        switch_seq_len(say, mt, python, docs)
        take_down(say, mt, python, data, docs)

        sft_store = work / "docstrings"
        run([str(python), "-m", "pipeline", "prepare", "builtin:python-docstrings", "--out",
             str(sft_store), "--num-shards", "2", "--no-progress"])  # fmt: skip
        sft = work / "data-sft.yaml"
        sft.write_text(SFT % sft_store)
        mt.train("sft", sft, SFT_STEPS, seq_len=SFT_SEQ_LEN)
        same_trained_targets(say, mt, python, sft)

        copy = work / "docs-p1"  # process 1 reads its own copy: the error is on one host
        shutil.copytree(docs, copy)
        configs = [work / "data-p0.yaml", work / "data-p1.yaml"]
        for config, store in zip(configs, (docs, copy)):
            config.write_text(DATA % (SEQ_LEN, store) + "mix: {docs: 1}\n")
        overwrite = [str(python), "-m", "pipeline", "prepare", "builtin:python-docs", "--out",
                     str(copy), "--num-shards", "3", "--overwrite", "--no-progress"]  # fmt: skip
        logs = mt.stop_on_data_error("hoststop", configs, lambda: run(overwrite))
        line = f"{configs[1]}: sources.docs.path: {copy / 'manifest.json'}: {REPLACED}"
        for i, text in enumerate(logs):  # process 0 names the host that failed
            found = [x for x in text.splitlines() if ("host 1: " if i == 0 else "") + line in x]
            if not found:
                raise Failed(f"hoststop: process {i}'s log does not say '{line}'")
            say(f"   p{i}: {found[-1].strip()}")
    except Failed as error:
        say(f"FAILED: {error}")
        return 1
    say(f"== passed in {time.monotonic() - started:.0f} s; transcript in {work / 'transcript.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
