"""tpu/recover.sh left alone for a week: the scenarios an outside review found ending or
wasting an unattended run, each driven against the fake `gcloud` of tests/tpu_fakes.py.

A THEN command of a rule is what happens meanwhile: `sleep 30` is an ssh that never returns
(a hung job, a vanished VM), tpu/stop.sh is a user elsewhere. The watch beside a long step runs
every --watch-seconds (0 here: every tenth of a second).
"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.test_tpu_scripts import HEALTH, RECOVER, START, UP, kinds, saves
from tests.tpu_fakes import COMMON, NAME, TPU, Env, ok

WATCH = {"TPU_WATCH_SECONDS": "0"}
# The watch describes the slice's health often: rules for the state describe alone.
STATE = "--format=value(state)"
UPS = [(STATE, 1, ""), (STATE, 1, ""), (STATE, 0, "READY")]
HEALTHY = ("*" + HEALTH, 0, "READY\\tHEALTHY")  # from now on


@pytest.fixture
def env(tmp_path):
    return Env(tmp_path)


def test_a_package_index_failing_once_is_retried_not_permanent(env):
    """uv exits 2 when it cannot reach the index once: that is not a parameter error."""
    env.rules(
        *UP, ("worker.sh setup", 2, "error: Failed to fetch: 503 Service Unavailable"),
        ("describe", 0, "READY"), ("describe", 0, "READY"), ("describe", 0, "READY"),
    )  # fmt: skip
    result = ok(env.run("recover", *RECOVER))
    assert "creating or installing my-tpu failed (exit status 1; try 1)" in result.stderr
    assert kinds(env).count("tpu-vm create") == 1 and kinds(env).count("start") == 1
    assert "training finished" in result.stderr


def test_503s_on_the_delete_of_a_preempted_slice_are_retried(env):
    env.rules(
        *UP, (START, 1, "", saves(env, 10)), (HEALTH, 0, "PREEMPTED"),
        ("tpu-vm delete", 1, "ERROR: 503"),  # the delete after the preemption
        ("describe", 0, "PREEMPTED"), ("tpu-vm delete", 1, "ERROR: 503"),  # bring-up: again
        ("describe", 0, "PREEMPTED"),  # create.sh: still there, exit 1 (was 2: the end)
        ("describe", 0, "PREEMPTED"), *UP[1:],  # deleted now; created; ready
    )  # fmt: skip
    result = ok(env.run("recover", *RECOVER))
    assert "error: my-tpu exists in state PREEMPTED; delete it first" in result.stderr
    assert "(exit status 1; try 1): next try" in result.stderr
    assert kinds(env).count("tpu-vm delete") == 3 and kinds(env).count("start") == 2


def test_stop_while_the_queued_resource_waits_is_honoured(env):
    waiting = [("describe", 0, "WAITING_FOR_RESOURCES", "sleep 0.2")] * 40
    env.rules(
        ("describe", 1, ""), ("describe", 1, ""),  # gone; create.sh: gone, so create
        ("describe", 0, "WAITING_FOR_RESOURCES", f"{TPU}/stop.sh"),  # a user stops the run
        *waiting, ("describe", 0, "ACTIVE"),
    )  # fmt: skip
    result = ok(env.run("recover", *RECOVER, "--queued", extra_env=WATCH))
    assert "the stop marker gs://bucket/ckpt.recover-stop is there" in result.stderr
    assert "worker.sh setup" not in str(env.calls())  # not installed
    assert "start" not in kinds(env)  # not trained


def test_a_hung_job_is_restarted_in_place_naming_the_host_that_stopped_first(env):
    beats = env.gcs / "bucket" / "ckpt.heartbeat"
    beats.mkdir(parents=True)
    for host, step in (("w-0", 7), ("w-1", 5)):
        (beats / host).write_text(
            f"step={step} time=1 host={host} process=0 save_seconds=30 slowest_process=1\n"
        )
    # Every trainer alive, no step moving; the restarted job finishes (on a loaded machine its
    # start may itself outlast the timeout once more: counted as a second hang).
    env.rules(*UPS, (START, 0, "", "sleep 30"), HEALTHY)
    result = ok(env.run("recover", *RECOVER, "--hang-timeout", "2", extra_env=WATCH))
    assert re.search(
        r"hung \(hang 1\): no step progress for \d+s \(--hang-timeout 2\): w-1 stopped "
        r"progressing first, at step 5 \(the feed's straggler: process 1\): stopping the job",
        result.stderr,
    ), result.stderr
    assert "resume in place (restart 1)" in result.stderr and "training finished" in result.stderr
    assert kinds(env).count("start") == kinds(env).count("stop") + 1 >= 2
    assert kinds(env).count("tpu-vm create") == 1  # in place: the slice is kept


def test_a_vanished_vm_is_noticed_by_describe_beside_the_ssh(env):
    # Once the trainers run, the VM vanishes: the next two describes (the watch's, then the
    # recovery's) find nothing, and the ssh would wait for its keepalive.
    rules = env.rules_file
    vanish = (f"{{ printf '%s\\t1\\t\\n' '{HEALTH}' '{HEALTH}'; cat {rules}; }} >{rules}.new && "
              f"mv {rules}.new {rules} && sleep 30")  # fmt: skip
    env.rules(*UPS, (START, 0, "", vanish), HEALTHY, *UPS)
    result = ok(env.run("recover", *RECOVER, extra_env=WATCH))
    assert "my-tpu is gone while the run's ssh still waits: ending the ssh" in result.stderr
    assert kinds(env).count("tpu-vm create") == 2 and kinds(env).count("start") == 2


def test_recover_restarted_mid_run_attaches_to_the_live_trainers(env):
    env.rules(("describe", 0, "READY"), (HEALTH, 0, "READY\\tHEALTHY"),
              ("worker.sh status", 0, "a trainer runs"))  # fmt: skip
    result = ok(env.run("recover", *RECOVER))
    assert "attaching to them (no install, no restart)" in result.stderr
    assert "worker.sh setup" not in str(env.calls())  # no reinstall under the live trainer
    assert kinds(env)[-1] == "start" and "preflight" not in kinds(env) and "stop" not in kinds(env)
    env.reset()
    env.rules(
        ("describe", 0, "READY"),
        (HEALTH, 0, "READY\\tHEALTHY"),
        ("worker.sh status", 3, "no trainer runs"),
        ("describe", 0, "READY"),
        ("describe", 0, "READY"),
    )  # create.sh: it exists
    result = ok(env.run("recover", *RECOVER))
    assert "worker.sh setup" in str(env.calls()) and kinds(env)[-2:] == ["preflight", "start"]


def test_a_stockout_longer_than_the_bound_moves_zone_same_region_first(env):
    env.rules(("describe", 1, ""), ("describe", 1, ""), ("tpu-vm create", 1, "ERROR: stockout"),
              *UP)  # fmt: skip
    zones = "us-west4-a,us-east5-b,us-west4-b"
    result = ok(env.run("recover", *RECOVER, "--zones", zones, "--zone-seconds", "0"))
    creates = [c for c in env.calls() if c[2:4] == ["tpu-vm", "create"]]
    assert [c[5] for c in creates] == ["--zone=us-west4-a", "--zone=us-west4-b"]
    deletes = [c for c in env.calls() if c[2:4] == ["tpu-vm", "delete"]]
    assert [c[5] for c in deletes] == ["--zone=us-west4-a"]  # the old zone's request
    assert "moving to us-west4-b; the checkpoints stay in gs://bucket/ckpt" in result.stderr
    starts = [c for c in env.calls() if START in " ".join(c)]
    assert [c[5] for c in starts] == ["--zone=us-west4-b"]


def test_the_give_up_hook_runs_with_the_reason(env, tmp_path):
    env.rules(("describe", 1, ""), ("describe", 1, ""), ("tpu-vm create", 1, "ERROR: stockout"))
    said = tmp_path / "said"
    hook = f'echo "$TPU_GIVE_UP_STATUS $TPU_GIVE_UP_REASON" >{said}'
    result = env.run("recover", *RECOVER, "--create-tries", "1", "--on-give-up", hook)
    assert result.returncode == 1
    assert said.read_text() == f"1 creating or installing {NAME} failed 1 times in a row " \
                               "(--create-tries 1)\n"  # fmt: skip


def test_only_restarts_without_checkpoint_progress_count(env):
    """Preemptions that each come after a new checkpoint never spend the budget."""
    rules = [*UP]
    for n in range(1, 4):
        rules += [(START, 1, "", saves(env, 10 * n)), (HEALTH, 0, "PREEMPTED"), *UP]
    env.rules(*rules)
    result = ok(env.run("recover", *RECOVER, "--max-restarts", "0"))
    assert "training finished on my-tpu after 3 restart(s)" in result.stderr
    assert "progress: checkpoint step 20 -> step 30" in result.stderr


def test_one_code_version_per_run(env, tmp_path):
    """The first install pins its commit beside the run's checkpoints; a later one (a
    re-created slice, after the controller's checkout moved on) ships that commit."""
    repo = tmp_path / "src"
    (repo / "scripts").mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(repo)]

    def commit(text: str) -> str:
        (repo / "scripts" / "train.py").write_text(text)
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-q", "-m", text], check=True)
        return subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    def shipped() -> str:
        tarball = env.scp_dir / f"tpu-install-{NAME}.tar.gz"
        return subprocess.run(["tar", "-xzOf", str(tarball), "scripts/train.py"],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip

    subprocess.run([*git, "init", "-q"], check=True)
    first = commit("first")
    pin = env.gcs / "bucket" / "ckpt.commit"
    install = ["install", *COMMON, "--source", str(repo), "--checkpoint-dir", "gs://bucket/ckpt"]
    env.rules(("networkEndpoints", 0, "1"))  # one host: no ssh-agent needed
    result = ok(env.run(*install))
    assert pin.read_text() == f"{first}\n" and shipped() == "first"
    assert f"pinned this run to commit {first}" in result.stderr
    second = commit("second")
    env.rules(("networkEndpoints", 0, "1"))
    result = ok(env.run(*install))
    assert shipped() == "first" and pin.read_text() == f"{first}\n"
    assert f"the run is pinned to commit {first} (gs://bucket/ckpt.commit): shipping it, not " \
           f"HEAD {second}" in result.stderr  # fmt: skip
    env.rules(("networkEndpoints", 0, "1"))
    ok(env.run(*install, "--new-code"))
    assert shipped() == "second" and pin.read_text() == f"{second}\n"
    pin.write_text("0123456789abcdef0123456789abcdef01234567\n")
    env.rules(("networkEndpoints", 0, "1"))
    refused = env.run(*install)
    assert refused.returncode == 2 and refused.stderr.count("error:") == 1
    assert "pinned to commit 0123456789abcdef0123456789abcdef01234567" in refused.stderr
