"""What runs on each TPU VM worker (tpu/worker.sh), run here in a sandboxed worker home.

The sandbox is ~/pipeline with the real tpu/worker.sh, a venv whose `python` is this
interpreter, and a stand-in scripts/train.py that records how it was started and reacts to
SIGTERM as the real trainer does (save, exit 75). Its processes run in their own session, and
`pgrep` only looks inside it, so nothing outside the sandbox is ever signalled. `sudo` runs
`lsof` and `kill` for real and records the rest; `gcloud` records `storage cp` and keeps the
copied object under gcs/ (or fails with an error line when FAKE_GCS_FAIL is set).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tpu_fakes import COMMON, TPU, TRAIN, Env, command_of, ok

TRAINER = """\
import json, os, signal, sys, time
print("hello from the trainer", flush=True)
keys = ["JAX_PLATFORMS", "TPU_STDERR_LOG_LEVEL", "PIPELINE_DATA_DIR", "LIBTPU_INIT_ARGS"]
out = {"argv": sys.argv, "cwd": os.getcwd(), "env": {k: os.environ.get(k) for k in keys}}
with open(os.environ["TRAINER_OUT"] + ".tmp", "w") as f:
    f.write(json.dumps(out))
os.rename(os.environ["TRAINER_OUT"] + ".tmp", os.environ["TRAINER_OUT"])
mode = os.environ.get("FAKE_TRAINER", "exit")
def saved(signum, frame):
    open(os.environ["TRAINER_OUT"] + ".saved", "w").close()
    sys.exit(75)
if mode == "graceful":
    signal.signal(signal.SIGTERM, saved)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "chatty":  # a line every 0.1 s, or FAKE_LINES lines at once
    lines = int(os.environ.get("FAKE_LINES", "0"))
    for i in range(lines or int(float(os.environ["FAKE_SECONDS"]) * 10)):
        print(f"step {i} " + "x" * 40, flush=True)
        time.sleep(0 if lines else 0.1)
elif mode == "beating":  # the real trainer's heartbeat, one step every 0.1 s
    sys.path.insert(0, os.environ["HEARTBEAT_MODULE"])
    from heartbeat import Heartbeat
    beat = Heartbeat.from_env(save_every=10)
    beat.every_s = 0
    for step in range(int(float(os.environ["FAKE_SECONDS"]) * 10)):
        beat.beat(step + 1, 0)
        time.sleep(0.1)
elif mode != "exit":
    time.sleep(float(os.environ.get("FAKE_SECONDS", "60")))
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""

RECORDER = """#!{python} -S
import json, os, sys
with open(os.environ["{log}"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""

# gcloud storage cp SRC gs://BUCKET/PATH: record it, keep the object in $FAKE_GCS_DIR/BUCKET/PATH.
GCLOUD = """#!{python} -S
import json, os, shutil, sys
args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if os.environ.get("FAKE_GCS_FAIL"):
    sys.exit("ERROR: (gcloud.storage.cp) HTTPError 403: permission denied")
def local(uri):
    return os.path.join(os.environ["FAKE_GCS_DIR"], uri[len("gs://"):])
words = [a for a in args if not a.startswith("--")]
if words[:2] == ["storage", "cat"]:
    if not os.path.exists(local(words[2])):
        sys.exit("ERROR: (gcloud.storage.cat) One or more URLs matched no objects.")
    sys.stdout.write(open(local(words[2])).read())
if words[:2] == ["storage", "ls"] and not os.path.exists(local(words[2])):
    sys.exit("ERROR: (gcloud.storage.ls) One or more URLs matched no objects.")
if words[:2] == ["storage", "cp"] and words[3].startswith("gs://"):
    if "--if-generation-match=0" in args and os.path.exists(local(words[3])):
        sys.exit("ERROR: (gcloud.storage.cp) HTTPError 412: precondition failed")
    os.makedirs(os.path.dirname(local(words[3])), exist_ok=True)
    shutil.copy(words[2], local(words[3]))
elif words[:2] == ["storage", "cp"]:
    shutil.copy(local(words[2]), words[3])
"""

# uv: record the arguments; `pip freeze` prints $FAKE_UV_FREEZE.
UV = """#!{python} -S
import json, os, sys
with open(os.environ["FAKE_UV_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1:3] == ["pip", "freeze"]:
    print(os.environ["FAKE_UV_FREEZE"])
"""

# sudo: run lsof and kill for real (they only ever see the sandbox's files and pids).
SUDO = """#!/bin/sh
case $1 in lsof|kill) exec "$@" ;; esac
exec "{recorder}" "$@"
"""


class Worker:
    """A sandboxed worker home with the project installed and a session of its own."""

    def __init__(self, tmp: Path, env: Env):
        self.tmp = tmp
        self.env = env
        self.home = tmp / "worker"
        self.project = self.home / "pipeline"
        venv_bin = self.project / ".venv" / "bin"
        venv_bin.mkdir(parents=True)
        (venv_bin / "activate").write_text(f'PATH="{venv_bin}:$PATH"; export PATH\n')
        (venv_bin / "python").symlink_to(sys.executable)
        (self.project / "tpu").mkdir()
        shutil.copy(TPU / "worker.sh", self.project / "tpu" / "worker.sh")
        (self.project / "scripts").mkdir()
        (self.project / "scripts" / "train.py").write_text(TRAINER)
        tools = tmp / "worker-bin"
        tools.mkdir()
        recorder = RECORDER.format(python=sys.executable, log="FAKE_SUDO_RECORD_LOG")
        (tools / "sudo-record").write_text(recorder)
        (tools / "gcloud").write_text(GCLOUD.format(python=sys.executable))
        (tools / "uv").write_text(UV.format(python=sys.executable))
        for tool in ("gcloud", "sudo-record", "uv"):
            (tools / tool).chmod(0o755)
        (tools / "sudo").write_text(SUDO.format(recorder=tools / "sudo-record"))
        (tools / "pgrep").write_text(f'#!/bin/sh\nexec {shutil.which("pgrep")} -s 0 "$@"\n')
        for tool in ("sudo", "pgrep"):
            (tools / tool).chmod(0o755)
        self.devices = [tmp / "accel0", tmp / "accel1"]
        for device in self.devices:
            device.touch()
        self.out = tmp / "trainer.json"
        self.vars = dict(
            env.vars,
            HOME=str(self.home),
            PATH=f"{tools}{os.pathsep}{os.environ['PATH']}",
            TRAINER_OUT=str(self.out),
            FAKE_GCLOUD_LOG=str(tmp / "worker-gcloud.jsonl"),
            FAKE_SUDO_RECORD_LOG=str(tmp / "sudo.jsonl"),
            FAKE_GCS_DIR=str(tmp / "gcs"),
            FAKE_UV_LOG=str(tmp / "uv.jsonl"),
            FAKE_UV_FREEZE="jax==0.10.2\nnumpy==2.1.0",
            PIPELINE_TPU_DEVICES=f"{tmp}/accel*",
            HEARTBEAT_MODULE=str(TPU.parent / "scripts"),
        )
        self.log = self.project / "logs" / f"train-{socket.gethostname()}.log"

    def shell(self, command: str, timeout: float = 30, **extra: str):
        return subprocess.run(
            ["bash", "-c", command], cwd=self.home, env=dict(self.vars, **extra),
            capture_output=True, text=True, timeout=timeout, start_new_session=True,
        )  # fmt: skip

    def spawn(self, command: str, **extra: str) -> subprocess.Popen:
        """`shell` without waiting: a first ssh session that is still running."""
        return subprocess.Popen(
            ["bash", "-c", command], cwd=self.home, env=dict(self.vars, **extra),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip

    def objects(self) -> dict[str, str]:
        """The fake bucket: gs:// URI -> content."""
        root = self.tmp / "gcs"
        if not root.exists():
            return {}
        files = sorted(p for p in root.rglob("*") if p.is_file())
        return {f"gs://{p.relative_to(root)}": p.read_text() for p in files}

    def recorded(self, name: str) -> list[list[str]]:
        path = self.tmp / name
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


HOST = socket.gethostname()


@pytest.fixture
def worker(tmp_path):
    return Worker(tmp_path, Env(tmp_path))


def wait_for(predicate, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


RUN_EXTRAS = ("--env", "LIBTPU_INIT_ARGS=--xla_foo=1 --xla_bar", "--", "--resume", "--note",
              "it's a test")  # fmt: skip


def start_command(worker: Worker, *args: str) -> str:
    ok(worker.env.run("run", *COMMON, *TRAIN, *args))
    return command_of(worker.env.calls()[-1])


def test_run_remote_command_starts_the_trainer_in_the_background(worker):
    result = worker.shell(start_command(worker, *RUN_EXTRAS))
    assert result.returncode == 0, result.stderr
    assert "started on" in result.stdout
    wait_for(worker.out.exists)
    got = json.loads(worker.out.read_text())
    assert got["argv"] == ["scripts/train.py", "--data-config", "configs/run.yaml",
                           "--checkpoint-dir", "gs://bucket/ckpt", "--resume", "--note",
                           "it's a test"]  # fmt: skip
    assert got["cwd"] == str(worker.project)
    assert got["env"] == {
        "JAX_PLATFORMS": "tpu",
        "TPU_STDERR_LOG_LEVEL": "0",
        "PIPELINE_DATA_DIR": "/mnt/bucket/stores",
        "LIBTPU_INIT_ARGS": "--xla_foo=1 --xla_bar",
    }
    wait_for(lambda: "hello" in (worker.log.read_text() if worker.log.exists() else ""))


def test_foreground_run_returns_the_trainer_status_and_copies_the_log_at_exit(worker):
    command = start_command(worker, "--foreground", "--log-uri", "gs://bucket/logs/r1/")
    result = worker.shell(command, FAKE_EXIT="75")
    assert result.returncode == 75, result.stderr
    assert "scripts/train.py exited with status 75" in result.stdout
    [(uri, text)] = worker.objects().items()
    assert re.fullmatch(rf"gs://bucket/logs/r1/train-{HOST}-\d{{8}}T\d{{6}}Z[.]log[.]000001", uri)
    assert [c[:2] for c in worker.recorded("worker-gcloud.jsonl")] == [["storage", "cp"]]
    assert text == worker.log.read_text()  # the first attempt: the whole log
    assert text.startswith("==== ") and f"attempt started on {HOST}: python scripts/train" in text
    assert f"this attempt is copied to {uri[: -len('000001')]}NNNNNN\n" in text
    assert "hello from the trainer" in text and text.endswith("exit status 75\n")


def test_log_copy_errors_are_reported(worker):
    command = start_command(worker, "--foreground", "--log-uri", "gs://bucket/logs/r1")
    result = worker.shell(command, FAKE_GCS_FAIL="1")
    assert result.returncode == 0, result.stderr
    assert re.search(
        rf"warning: could not copy the log to gs://bucket/logs/r1/train-{HOST}-\S+[.]log.000001 on "
        rf"{HOST}: ERROR: [(]gcloud.storage.cp[)] HTTPError 403: permission denied\n",
        result.stderr,
    ), result.stderr


def log_count(worker: Worker, text: str) -> int:
    return worker.log.read_text().count(text) if worker.log.exists() else 0


def test_rerunning_the_start_command_while_the_trainer_runs_waits_for_that_trainer(worker):
    """What gcloud does after a dropped connection (ssh exit 255): the same --command again."""
    command = start_command(worker, "--foreground", "--log-uri", "gs://bucket/logs/r1")
    trainer = dict(FAKE_TRAINER="sleep", FAKE_SECONDS="2", FAKE_EXIT="75")
    first = worker.spawn(command, **trainer)
    try:
        wait_for(lambda: log_count(worker, "hello from the trainer") == 1)
        again = worker.shell(command, **trainer)
        assert first.wait(timeout=30) == 75
    finally:
        first.kill()
    assert again.returncode == 75, again.stderr
    assert "scripts/train.py is already running on" in again.stdout
    assert "waiting for it, not starting another" in again.stdout
    assert "scripts/train.py exited with status 75" in again.stdout
    # One trainer, one attempt, the whole log.
    assert log_count(worker, "hello from the trainer") == 1
    assert log_count(worker, "attempt started") == 1
    assert worker.log.read_text().endswith("exit status 75\n")
    # A retry that comes after the trainer ended reports that attempt, starts nothing.
    late = worker.shell(command, **trainer)
    assert late.returncode == 75 and "not starting it again" in late.stdout
    assert log_count(worker, "hello from the trainer") == 1
    # A preflight (tpu/run.sh's first command) arms a new attempt: appended, never truncated.
    ok(worker.shell("cd pipeline && tpu/worker.sh preflight"))
    second = worker.shell(command, FAKE_EXIT="0")
    assert second.returncode == 0, second.stderr
    assert log_count(worker, "hello from the trainer") == 2
    assert log_count(worker, "attempt started") == 2
    # One object per attempt in the bucket, each with that attempt's part of the log.
    objects = worker.objects()
    assert len(objects) == 2
    parts = [objects[uri] for uri in sorted(objects)]
    assert "".join(parts) == worker.log.read_text()
    assert [p.count("attempt started") for p in parts] == [1, 1]


def test_a_second_background_start_does_not_start_a_second_trainer(worker):
    command = start_command(worker)
    trainer = dict(FAKE_TRAINER="sleep", FAKE_SECONDS="1.5")
    ok(worker.shell(command, **trainer))
    wait_for(lambda: log_count(worker, "hello from the trainer") == 1)
    again = ok(worker.shell(command, **trainer))
    assert "already running on" in again.stdout and "not starting another" in again.stdout
    wait_for(lambda: log_count(worker, "exit status 0") == 1)
    assert log_count(worker, "hello from the trainer") == 1


def test_the_log_is_copied_incrementally_while_the_trainer_runs(worker):
    """Each sync sends only the lines written since the last one (it used to send the whole
    attempt every minute: quadratic); the chunks, in order, are the attempt's log."""
    result = worker.shell(
        "cd pipeline && tpu/worker.sh start --log-dir logs --log-uri gs://b/l --sync-seconds 1 "
        "--foreground -- python scripts/train.py",
        FAKE_TRAINER="chatty", FAKE_SECONDS="3.5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    objects = worker.objects()
    assert len(objects) >= 3, objects  # the syncs while it ran, and the rest at exit
    assert "".join(objects[uri] for uri in sorted(objects)) == worker.log.read_text()
    sent = sum(len(c) for c in objects.values())
    assert sent == len(worker.log.read_text())  # every byte sent once


def test_the_log_is_rotated_by_size(worker):
    result = worker.shell(
        "cd pipeline && tpu/worker.sh start --log-dir logs --max-log-bytes 2000 --foreground "
        "-- python scripts/train.py",
        FAKE_TRAINER="chatty", FAKE_SECONDS="1", FAKE_LINES="200",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rotated = worker.log.with_name(worker.log.name + ".1")
    assert rotated.exists() and len(rotated.read_text()) >= 2000
    assert len(worker.log.read_text()) < 2000 + 100
    assert worker.log.read_text().endswith("exit status 0\n")


def test_a_full_log_disk_does_not_stop_the_trainer(worker):
    """Every restart used to die writing its log header on a full disk; now the trainer runs,
    its output is lost until there is room, and the run's status is the trainer's."""
    worker.log.parent.mkdir(parents=True)
    worker.log.symlink_to("/dev/full")  # every write: ENOSPC
    result = worker.shell(
        "cd pipeline && tpu/worker.sh start --log-dir logs --foreground -- python scripts/train.py",
        FAKE_EXIT="75",
    )  # fmt: skip
    assert result.returncode == 75, result.stdout + result.stderr
    assert "scripts/train.py exited with status 75" in result.stdout
    assert "disk full?): the trainer runs on" in result.stderr
    assert json.loads(worker.out.read_text())["argv"][0] == "scripts/train.py"


def test_the_heartbeat_is_copied_beside_the_checkpoints(worker):
    result = worker.shell(
        "cd pipeline && tpu/worker.sh start --log-dir logs --heartbeat-uri gs://bkt/ckpt.heartbeat "
        "--sync-seconds 1 --foreground -- python scripts/train.py",
        FAKE_TRAINER="beating", FAKE_SECONDS="1.5",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    beat = worker.objects()[f"gs://bkt/ckpt.heartbeat/{HOST}"]
    assert re.fullmatch(r"step=\d+ time=\d+ host=\S+ process=0 save_seconds=\d+ "
                        r"slowest_process=-1\n", beat), beat  # fmt: skip


def test_status_says_whether_a_trainer_runs(worker):
    none = worker.shell("cd pipeline && tpu/worker.sh status")
    assert none.returncode == 3 and "no trainer runs on" in none.stdout
    command = "cd pipeline && tpu/worker.sh start --log-dir logs -- python scripts/train.py"
    ok(worker.shell(command, FAKE_TRAINER="sleep", FAKE_SECONDS="2"))
    wait_for(lambda: log_count(worker, "hello from the trainer") == 1)
    running = worker.shell("cd pipeline && tpu/worker.sh status")
    assert running.returncode == 0 and "a trainer runs on" in running.stdout
    wait_for(lambda: log_count(worker, "exit status 0") == 1)


def test_preflight_kills_stale_tpu_holders_and_counts_the_chips(worker):
    holder = subprocess.Popen(["sleep", "60"], stdin=worker.devices[0].open())
    try:
        result = worker.shell("cd pipeline && tpu/worker.sh preflight")
        assert result.returncode == 0, result.stderr
        assert f"killing stale TPU holders on {socket.gethostname()}: {holder.pid}" in result.stdout
        assert f"ok: {socket.gethostname()} sees 2 TPU chips, none in use" in result.stdout
        assert holder.wait(timeout=5) == -9
        assert ["rm", "-f", "/tmp/libtpu_lockfile"] in worker.recorded("sudo.jsonl")
    finally:
        holder.kill()


def test_preflight_fails_without_chips_or_with_a_running_trainer(worker):
    for device in worker.devices:
        device.unlink()
    result = worker.shell("cd pipeline && tpu/worker.sh preflight")
    assert result.returncode == 1 and "no TPU chips visible" in result.stderr
    running = worker.shell(
        "cd pipeline && . .venv/bin/activate && (python scripts/train.py &) && "
        "sleep 0.5 && tpu/worker.sh preflight",
        FAKE_TRAINER="sleep", FAKE_SECONDS="3",
    )  # fmt: skip
    assert running.returncode == 1 and "already running; run tpu/stop.sh first" in running.stderr


def test_stop_asks_the_trainer_to_save_first(worker):
    result = worker.shell(
        "cd pipeline && . .venv/bin/activate && (python scripts/train.py &) && "
        "while [ ! -e \"$TRAINER_OUT\" ]; do sleep 0.05; done && tpu/worker.sh stop 20",
        FAKE_TRAINER="graceful",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "SIGTERM to the trainer" in result.stdout and "SIGKILL" not in result.stdout
    assert Path(f"{worker.out}.saved").exists()
    assert "stopped on" in result.stdout


def test_stop_escalates_when_the_trainer_does_not_exit(worker):
    result = worker.shell(
        "cd pipeline && . .venv/bin/activate && (python scripts/train.py &) && "
        "while [ ! -e \"$TRAINER_OUT\" ]; do sleep 0.05; done && tpu/worker.sh stop 1 && "
        "sleep 0.2 && ! pgrep -f '^python scripts/train'",
        FAKE_TRAINER="stubborn",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "still running after 1s" in result.stdout and "SIGKILL" in result.stdout
    assert not Path(f"{worker.out}.saved").exists()


def test_stop_succeeds_when_nothing_runs(worker):
    result = worker.shell("cd pipeline && tpu/worker.sh stop 5")
    assert result.returncode == 0 and "stopped on" in result.stdout
    assert "SIGTERM" not in result.stdout


def test_mount_uses_maxtexts_gcsfuse_cache_flags(worker, tmp_path):
    tools = Path(worker.vars["PATH"].split(os.pathsep)[0])
    for tool in ("gcsfuse",):
        (tools / tool).write_text(RECORDER.format(python=sys.executable, log="FAKE_GCSFUSE_LOG"))
        (tools / tool).chmod(0o755)
    (tools / "mountpoint").write_text("#!/bin/sh\nexit 1\n")
    (tools / "mountpoint").chmod(0o755)
    result = worker.shell(
        "cd pipeline && tpu/worker.sh mount gs://my-bucket /mnt/my-bucket",
        FAKE_GCSFUSE_LOG=str(tmp_path / "gcsfuse.jsonl"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert worker.recorded("gcsfuse.jsonl") == [[
        "-o", "ro", "--implicit-dirs", "--type-cache-max-size-mb=-1",
        "--stat-cache-max-size-mb=-1", "--kernel-list-cache-ttl-secs=-1",
        "--metadata-cache-ttl-secs=-1", f"--log-file={worker.home}/gcsfuse.json", "my-bucket",
        "/mnt/my-bucket",
    ]]  # fmt: skip
    assert ["mkdir", "-p", "/mnt/my-bucket"] in worker.recorded("sudo.jsonl")


def test_mount_replaces_a_mount_whose_gcsfuse_died(worker, tmp_path):
    """After a crash of gcsfuse the mount point stays a mount point but cannot be read."""
    tools = Path(worker.vars["PATH"].split(os.pathsep)[0])
    (tools / "gcsfuse").write_text(RECORDER.format(python=sys.executable, log="FAKE_GCSFUSE_LOG"))
    (tools / "mountpoint").write_text("#!/bin/sh\nexit 0\n")  # mounted, and unreadable:
    for tool in ("gcsfuse", "mountpoint"):  # /mnt/dead-bucket does not exist here
        (tools / tool).chmod(0o755)
    result = worker.shell(
        "cd pipeline && tpu/worker.sh mount dead-bucket /mnt/dead-bucket",
        FAKE_GCSFUSE_LOG=str(tmp_path / "gcsfuse.jsonl"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "mounted but unreadable" in result.stdout
    assert ["umount", "-l", "/mnt/dead-bucket"] in worker.recorded("sudo.jsonl")
    assert worker.recorded("gcsfuse.jsonl")[0][-2:] == ["dead-bucket", "/mnt/dead-bucket"]


LOCK = "gs://bucket/ckpt.requirements.txt"
SETUP = f"cd pipeline && tpu/worker.sh setup --python 3.12 --jax 0.10.2 --lock {LOCK}"
# setup ends by importing jax and pipeline with the venv's python (this interpreter here).
IMPORTS = os.pathsep.join(p for p in sys.path if p)


def test_the_first_install_of_a_run_records_its_lock_and_every_later_one_installs_it(worker):
    first = worker.shell(SETUP, timeout=120, PYTHONPATH=IMPORTS)
    assert first.returncode == 0, first.stderr
    assert f"recorded this run's environment in {LOCK}" in first.stdout
    assert worker.objects() == {LOCK: "jax==0.10.2\nnumpy==2.1.0\n"}
    uv = worker.recorded("uv.jsonl")
    resolved = ["pip", "install", "--quiet", "--python", ".venv/bin/python", "-e", ".[tpu,train]",
                "jax[tpu]==0.10.2"]  # fmt: skip
    locked = str(worker.project / ".trainer" / "requirements.txt")
    venv = ["--quiet", "--python", ".venv/bin/python"]
    assert resolved in uv and ["pip", "sync", *venv, locked] in uv
    assert uv[-1] == ["pip", "install", *venv, "--no-deps", "-e", "."]
    # A re-created slice: the lock is there, nothing is resolved again.
    (worker.tmp / "uv.jsonl").unlink()
    again = worker.shell(SETUP.replace("0.10.2", "0.10.3"), timeout=120, PYTHONPATH=IMPORTS)
    assert again.returncode == 0, again.stderr
    assert resolved not in worker.recorded("uv.jsonl")
    assert "installed the run's locked environment (2 packages from" in again.stdout
    assert f"warning: the run's lock {LOCK} has jax==0.10.2, not jax==0.10.3" in again.stderr


def test_a_trainer_in_another_environment_than_the_runs_lock_is_one_line(worker):
    state = worker.project / ".trainer"
    state.mkdir()
    seen = worker.shell(  # a distribution the trainer's python sees, with its version
        "cd pipeline && . .venv/bin/activate && python -c 'import importlib.metadata as m; "
        'd = next(iter(m.distributions())); print(d.metadata["Name"] + "==" + d.version)\''
    ).stdout.strip()
    (state / "requirements.txt").write_text(f"{seen}\nnot-installed==1.0\n")
    result = worker.shell(
        "cd pipeline && . .venv/bin/activate && tpu/worker.sh start --log-dir logs --foreground "
        "-- python scripts/train.py"
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    [line] = [x for x in result.stdout.splitlines() if x.startswith("warning:")]
    assert line.endswith(": not-installed==1.0 (installed: none)"), line
    assert line in worker.log.read_text()


def test_a_copy_install_replaces_the_tree_and_keeps_the_venv_state_and_logs(worker, tmp_path):
    source = tmp_path / "src"
    (source / "scripts").mkdir(parents=True)
    (source / "scripts" / "train.py").write_text("print('new')\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(source)]
    for step in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "new"]):
        subprocess.run([*git, *step], check=True)
    (worker.project / "deleted-since.py").write_text("old\n")
    for kept in (".venv/kept", ".trainer/status", "logs/train-old.log"):
        (worker.project / kept).parent.mkdir(exist_ok=True)
        (worker.project / kept).write_text("kept\n")
    worker.env.rules(("networkEndpoints", 0, "1"))  # one host: no ssh-agent needed
    ok(worker.env.run("install", *COMMON, "--source", str(source)))
    scp = worker.env.calls()[-2]
    [remote_tarball] = [a.split(":", 1)[1] for a in scp if a.startswith("my-tpu:")]
    shutil.copy(next(worker.env.scp_dir.iterdir()), worker.home / remote_tarball)
    unpack = command_of(worker.env.calls()[-1]).split("cd pipeline && tpu/worker.sh setup")[0]
    ok(worker.shell(unpack))
    # gcloud runs the command again after a dropped connection: the tarball is gone by then.
    again = ok(worker.shell(unpack))
    assert "is unpacked already on" in again.stdout
    assert not (worker.project / "deleted-since.py").exists()
    assert (worker.project / "scripts" / "train.py").read_text() == "print('new')\n"
    for kept in (".venv/kept", ".trainer/status", "logs/train-old.log"):
        assert (worker.project / kept).read_text() == "kept\n"
    assert (worker.project / ".venv" / "bin" / "activate").exists()
    assert sorted(p.name for p in worker.home.iterdir()) == ["pipeline"]
    # A tarball of another commit that never arrived is an error (exit 1: try again).
    other = unpack.replace(remote_tarball[len("pipeline-src-") : -len(".tar.gz")], "0" * 12)
    unpacked = (worker.project / ".commit").read_text().strip()
    missing = worker.shell(other.replace(f"= {unpacked}", "= x"))
    assert missing.returncode == 1 and "is missing on" in missing.stderr


def test_clone_mode_checks_out_the_runs_pinned_commit(worker, tmp_path):
    """The workers of a --repo install record the commit they checked out beside the
    checkpoints; a later install (a re-created slice) checks that one out, not the branch."""
    origin = tmp_path / "origin"
    (origin / "scripts").mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(origin)]

    def commit(text: str) -> str:
        (origin / "scripts" / "train.py").write_text(text)
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", text], check=True)
        return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    subprocess.run([*git, "init", "-q"], check=True)
    # fetching a commit by its id, as GitHub allows
    subprocess.run([*git, "config", "uploadpack.allowReachableSHA1InWant", "true"], check=True)
    first = commit("first")
    shutil.rmtree(worker.project)  # a fresh VM: nothing installed yet
    ok(worker.env.run("install", *COMMON, "--repo", str(origin), "--checkpoint-dir", "gs://bkt/ck"))
    clone = command_of(worker.env.calls()[-1]).split(" cd pipeline && tpu/worker.sh setup")[0]
    ok(worker.shell(clone))
    assert worker.objects()["gs://bkt/ck.commit"] == f"{first}\n"
    commit("second")  # the branch moves on
    again = ok(worker.shell(clone))
    assert f"the run's commit {first} (gs://bkt/ck.commit)" in again.stdout
    assert (worker.project / "scripts" / "train.py").read_text() == "first"
