"""A fake `gcloud` and a clean environment for the tests of the TPU VM scripts in tpu/.

The fake appends each argument list, one JSON line per call, to a log. Its answers are
scripted by rules, `PATTERN<TAB>STATUS<TAB>STDOUT[<TAB>THEN]` lines: a call takes (and removes)
the first rule whose PATTERN occurs in its space-joined arguments (a PATTERN that starts with `*`
stays for later calls too), runs the shell command THEN
if there is one (what happens meanwhile, e.g. a tpu/stop.sh from elsewhere), prints STDOUT
(`\\t` is a tab) and exits with STATUS. Without a rule, `storage ls|cp|rm` act on a local
directory standing for Cloud Storage (gs://BUCKET/PATH is FAKE_GCS_DIR/BUCKET/PATH); any other
call prints nothing and succeeds (`storage cat` prints the objects a glob matches). `scp` of
a local file copies it into a directory the test
can read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TPU = REPO / "tpu"

NAME, PROJECT, ZONE = "my-tpu", "my-project", "us-west4-a"
COMMON = ["--name", NAME, "--project", PROJECT, "--zone", ZONE]
LOC = [f"--zone={ZONE}", f"--project={PROJECT}"]
SLICE = ["--accelerator-type", "v5litepod-16", "--runtime-version", "v2-alpha-tpuv5-lite"]
TRAIN = [
    "--config", "configs/run.yaml", "--data", "/mnt/bucket/stores",
    "--checkpoint-dir", "gs://bucket/ckpt",
]  # fmt: skip
KEEPALIVE = [
    "--ssh-flag=-oServerAliveInterval=30", "--ssh-flag=-oServerAliveCountMax=4",
    "--ssh-flag=-oConnectTimeout=20",
]  # fmt: skip
SSH = ["compute", "tpus", "tpu-vm", "ssh", NAME, *LOC, "--worker=all", *KEEPALIVE]
DESCRIBE_VM = ["compute", "tpus", "tpu-vm", "describe", NAME, *LOC, "--format=value(state)"]
DESCRIBE_QR = [
    "compute", "tpus", "queued-resources", "describe", NAME, *LOC, "--format=value(state.state)",
]  # fmt: skip

FAKE_GCLOUD = """#!{python} -S
import json, os, shutil, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:4] == ["compute", "tpus", "tpu-vm", "scp"]:
    for a in args[4:]:
        if not a.startswith("-") and os.path.isfile(a):
            shutil.copy(a, os.environ["FAKE_GCLOUD_SCP_DIR"])
rules_file = os.environ["FAKE_GCLOUD_RULES"]
rules = open(rules_file).read().splitlines() if os.path.exists(rules_file) else []
joined = " ".join(args)
for i, rule in enumerate(rules):
    pattern, status, out, then = (rule.split("\\t") + ["", "", ""])[:4]
    sticky = pattern.startswith("*")
    if pattern.lstrip("*") in joined:
        if not sticky:
            del rules[i]
            with open(rules_file, "w") as f:
                f.write("".join(r + "\\n" for r in rules))
        if then:
            subprocess.run(then, shell=True, check=True)
        print(out.replace("\\\\t", "\\t"))
        sys.exit(int(status or 0))
def local(uri):
    return os.path.join(os.environ["FAKE_GCS_DIR"], uri[len("gs://"):])
if args[:2] == ["storage", "ls"]:
    path = local(args[2])
    if os.path.isfile(path):
        print(args[2])
    elif os.path.isdir(path):
        for name in sorted(os.listdir(path)):
            sub = os.path.isdir(os.path.join(path, name))
            print(args[2].rstrip("/") + "/" + name + ("/" if sub else ""))
    else:
        sys.exit("ERROR: (gcloud.storage.ls) One or more URLs matched no objects.")
elif args[:2] == ["storage", "cp"]:
    os.makedirs(os.path.dirname(local(args[3])), exist_ok=True)
    shutil.copy(args[2], local(args[3]))
elif args[:2] == ["storage", "rm"]:
    os.remove(local(args[2]))
elif args[:2] == ["storage", "cat"]:
    import glob
    found = sorted(glob.glob(local(args[2])))
    if not found:
        sys.exit("ERROR: (gcloud.storage.cat) One or more URLs matched no objects.")
    for path in found:
        sys.stdout.write(open(path).read())
"""


class Env:
    """A clean environment (no TPU_*, a fresh HOME) with the fake gcloud first on PATH."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.bin = tmp / "bin"
        self.bin.mkdir()
        self.home = tmp / "home"
        self.home.mkdir()
        self.log = tmp / "gcloud.jsonl"
        self.rules_file = tmp / "rules.tsv"
        self.scp_dir = tmp / "scp"
        self.scp_dir.mkdir()
        self.gcs = tmp / "gcs"
        gcloud = self.bin / "gcloud"
        gcloud.write_text(FAKE_GCLOUD.format(python=sys.executable))
        gcloud.chmod(0o755)
        self.vars = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "SSH_AUTH"))}
        self.vars.update(
            PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            HOME=str(self.home),
            FAKE_GCLOUD_LOG=str(self.log),
            FAKE_GCLOUD_RULES=str(self.rules_file),
            FAKE_GCLOUD_SCP_DIR=str(self.scp_dir),
            FAKE_GCS_DIR=str(self.gcs),
            TMPDIR=str(tmp),
            TPU_POLL_SECONDS="0",
            TPU_RETRY_SECONDS="0",
        )

    def run(self, script: str, *args: str, extra_env: dict | None = None, path: Path = TPU):
        env = dict(self.vars, **(extra_env or {}))
        return subprocess.run(
            [str(path / f"{script}.sh"), *args],
            env=env,
            cwd=self.tmp,
            capture_output=True,
            text=True,
            timeout=120,  # a loaded machine: the 12-preemption scenario takes ~20 s alone
        )

    def rules(self, *rules: tuple[str, ...]) -> None:
        """Script the fake's answers: (pattern, exit status, stdout[, then]), first match first."""
        self.rules_file.write_text("".join("\t".join(map(str, r)) + "\n" for r in rules))

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def reset(self):
        self.log.unlink(missing_ok=True)
        self.rules_file.unlink(missing_ok=True)


def ok(result):
    assert result.returncode == 0, (
        f"rc={result.returncode}\nstdout:{result.stdout}\nstderr:{result.stderr}"
    )
    return result


def command_of(call: list[str]) -> str:
    [cmd] = [a[len("--command=") :] for a in call if a.startswith("--command=")]
    return cmd
