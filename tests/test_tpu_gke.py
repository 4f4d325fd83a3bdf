"""tpu/gke: the same run on GKE, as a JobSet rendered from the env file of tpu/.

Every rendered manifest is validated: the JobSet against the schema of JobSet's CRD
(vendored in tests/fixtures, unknown fields refused as `kubectl apply --validate=strict`
does), each Job template against Kubernetes' own batch/v1 schema (kubernetes-validate). A
fake `kubectl`, `xpk` and `gcloud` record what would run. Nothing here reaches a cluster.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import subprocess
import time

import jsonschema
import kubernetes_validate
import pytest

from tests.tpu_fakes import REPO, TPU, Env, ok

KUBERNETES = "1.33.0"  # GKE's regular channel
SCHEMA = json.loads((REPO / "tests" / "fixtures" / "jobset-v1alpha2.schema.json").read_text())
BASE = ["--name", "my-run", "--project", "my-project", "--zone", "us-east5-b",
        "--gke-cluster", "tpus", "--gke-image", "us-docker.pkg.dev/p/r/pipeline@sha256:ab12",
        "--config", "configs/my-run.yaml", "--data", "gs://my-bucket/stores",
        "--checkpoint-dir", "gs://my-bucket/checkpoints/my-run"]  # fmt: skip
# (accelerator type, slices) -> (GKE accelerator, topology, hosts per slice)
SHAPES = {
    ("v5litepod-16", 1): ("tpu-v5-lite-podslice", "4x4", 4),
    ("v5p-64", 1): ("tpu-v5p-slice", "2x4x4", 8),
    ("v6e-16", 2): ("tpu-v6e-slice", "4x4", 4),
    ("tpu7x-128", 1): ("tpu7x", "4x4x4", 16),
}


def strict(schema):
    """The CRD's schema, with unknown fields refused where it lists the fields."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


STRICT = strict(SCHEMA)


def validate(manifest: dict) -> None:
    jsonschema.validate(manifest, STRICT)
    for replicated in manifest["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": replicated["name"]},
               "spec": replicated["template"]["spec"]}  # fmt: skip
        kubernetes_validate.validate(job, KUBERNETES, strict=True)


@pytest.fixture
def env(tmp_path):
    env = Env(tmp_path)
    for tool in ("kubectl", "xpk"):  # record like the fake gcloud, in the same log
        (env.bin / tool).write_text(
            f"#!/bin/sh\nexec {env.bin / 'gcloud'} {tool} \"$@\"\n"
        )  # fmt: skip
        (env.bin / tool).chmod(0o755)
    return env


def launch(env: Env, *args: str, **extra: str):
    return env.run("launch", *args, extra_env=extra, path=TPU / "gke")


def render(env: Env, *args: str) -> dict:
    return json.loads(ok(launch(env, "--render", *BASE, *args)).stdout)


@pytest.mark.parametrize("accelerator, slices", list(SHAPES))
def test_the_jobset_of_each_shape_is_valid_and_runs_one_trainer_per_host(env, accelerator, slices):
    manifest = render(env, "--accelerator-type", accelerator, "--num-slices", str(slices),
                      "--capacity", "spot", "--", "--steps", "10000")  # fmt: skip
    validate(manifest)
    label, topology, hosts = SHAPES[accelerator, slices]
    [replicated] = manifest["spec"]["replicatedJobs"]
    assert replicated["replicas"] == slices
    job = replicated["template"]["spec"]
    assert job["parallelism"] == job["completions"] == hosts and job["completionMode"] == "Indexed"
    pod = job["template"]["spec"]
    assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": label,
                                   "cloud.google.com/gke-tpu-topology": topology,
                                   "cloud.google.com/gke-spot": "true"}  # fmt: skip
    [trainer] = pod["containers"]
    assert trainer["resources"]["limits"] == {"google.com/tpu": 4}
    assert trainer["command"] == ["python", "scripts/train.py", "--data-config",
                                  "configs/my-run.yaml", "--checkpoint-dir",
                                  "gs://my-bucket/checkpoints/my-run", "--resume", "--steps",
                                  "10000"]  # fmt: skip
    names = {e["name"] for e in trainer["env"]}
    assert ("MEGASCALE_SLICE_ID" in names) == (slices > 1)
    assert {"PIPELINE_HEARTBEAT", "PIPELINE_DATA_DIR"} <= names


def test_preemptions_restart_the_jobset_without_spending_its_budget(env):
    spec = render(env, "--accelerator-type", "v5litepod-16", "--max-restarts", "4")["spec"]
    policy = spec["failurePolicy"]
    assert policy["maxRestarts"] == 4
    free, fatal = policy["rules"]
    assert free["action"] == "RestartJobSetAndIgnoreMaxRestarts"
    assert free["onJobFailureReasons"] == ["PodFailurePolicy"]
    assert fatal["action"] == "FailJobSet"
    pod_rules = spec["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    assert pod_rules[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert pod_rules[1]["onExitCodes"]["values"] == [2]
    # The Job controller's messages for those two rules (Kubernetes' pod failure policy):
    evicted = (
        "Pod default/my-run-slice-0-1-x has condition DisruptionTarget matching FailJob rule at "
        "index 0"
    )
    bad_config = (
        "Container trainer for pod default/my-run-slice-0-0-x failed with exit code 2 matching "
        "FailJob rule at index 1"
    )
    assert re.fullmatch(free["onJobFailureMessagePatterns"][0], evicted)
    assert not re.fullmatch(free["onJobFailureMessagePatterns"][0], bad_config)
    assert re.fullmatch(fatal["onJobFailureMessagePatterns"][0], bad_config)


def test_the_liveness_probe_fails_on_a_stale_heartbeat(env, tmp_path):
    probe = render(env, "--accelerator-type", "v6e-16")["spec"]["replicatedJobs"][0]
    probe = probe["template"]["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
    script = probe["exec"]["command"][2].replace("/tmp/pipeline-heartbeat", str(tmp_path / "beat"))
    beat = tmp_path / "beat"

    def alive() -> bool:
        return subprocess.run(["sh", "-c", script]).returncode == 0

    assert alive()  # no heartbeat yet: starting up
    beat.write_text("step=5 time=1 host=h process=0 save_seconds=400 slowest_process=-1\n")
    assert alive()
    os.utime(beat, (time.time() - 700, time.time() - 700))
    assert alive()  # 700 s: within twice the save interval (800 s)
    os.utime(beat, (time.time() - 900, time.time() - 900))
    assert not alive()
    fixed = render(env, "--accelerator-type", "v6e-16", "--hang-timeout", "60")
    command = fixed["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert "limit=60;" in command["containers"][0]["livenessProbe"]["exec"]["command"][2]


def test_the_token_stores_through_gcsfuse_and_a_workload_identity(env):
    fuse = ["--gcsfuse-bucket", "my-bucket", "--data", "/mnt/my-bucket/stores"]
    manifest = render(
        env, "--accelerator-type", "v5p-64", *fuse, "--gke-service-account", "trainer"
    )
    validate(manifest)
    template = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert template["metadata"]["annotations"] == {"gke-gcsfuse/volumes": "true"}
    assert template["spec"]["serviceAccountName"] == "trainer"
    assert template["spec"]["containers"][0]["volumeMounts"][0]["mountPath"] == "/mnt/my-bucket"


def test_the_validation_refuses_what_the_api_server_would(env):
    manifest = render(env, "--accelerator-type", "v5litepod-16")
    bad = copy.deepcopy(manifest)
    bad["spec"]["failurePolicy"]["rules"][0]["action"] = "RestartForever"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    bad = copy.deepcopy(manifest)
    bad["spec"]["failurePolicy"]["maxRestart"] = 3
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    bad = copy.deepcopy(manifest)
    bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["nodeSelectors"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)


def test_launch_applies_the_rendered_manifest(env):
    args = [*BASE, "--accelerator-type", "v6e-16", "--num-slices", "2"]
    result = ok(launch(env, *args))
    manifest = env.tmp / "jobset-my-run.json"
    assert env.calls() == [
        ["container", "clusters", "get-credentials", "tpus", "--location=us-east5",
         "--project=my-project"],
        ["kubectl", "apply", "-f", str(manifest)],
    ]  # fmt: skip
    assert json.loads(manifest.read_text()) == render(env, "--accelerator-type", "v6e-16",
                                                      "--num-slices", "2")  # fmt: skip
    assert "kubectl logs -f -n default -l jobset.sigs.k8s.io/jobset-name=my-run" in result.stderr
    env.reset()
    dry = ok(launch(env, *args, "--dry-run"))
    assert env.calls() == [] and [shlex.split(x)[0] for x in dry.stdout.splitlines()] == [
        "gcloud", "kubectl"]  # fmt: skip
    env.reset()
    ok(launch(env, *BASE, "--delete"))
    assert env.calls()[-1] == ["kubectl", "delete", "jobset", "my-run", "--namespace=default"]


def test_xpk_creates_the_same_workload(env):
    ok(launch(env, *BASE, "--accelerator-type", "tpu7x-128", "--capacity", "spot", "--xpk",
              "--", "--steps", "100"))  # fmt: skip
    assert env.calls() == [[
        "xpk", "workload", "create", "--cluster=tpus", "--project=my-project",
        "--zone=us-east5-b", "--workload=my-run", "--tpu-type=tpu7x-128", "--num-slices=1",
        "--docker-image=us-docker.pkg.dev/p/r/pipeline@sha256:ab12", "--max-restarts=10",
        "--spot", "--env", "PIPELINE_DATA_DIR=gs://my-bucket/stores",
        "--command=python scripts/train.py --data-config configs/my-run.yaml --checkpoint-dir "
        "gs://my-bucket/checkpoints/my-run --resume --steps 100",
    ]]  # fmt: skip


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--accelerator-type", "v9-8"], "--accelerator-type 'v9-8' is not one of"),
        (["--accelerator-type", "v5p-48"], "v5p-48 is 24 chips: give --gke-topology"),
        (["--accelerator-type", "v5p-64", "--gke-topology", "4x4"], "is not 3 sides with 32"),
        (["--accelerator-type", "v6e-16", "--checkpoint-dir", "/ckpt"], "is not gs://"),
    ],
)
def test_bad_parameters_are_one_line_with_exit_2(env, args, needle):
    result = launch(env, *BASE, *args)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert needle in result.stderr and env.calls() == []


def test_the_example_env_file_renders(env):
    result = ok(launch(env, "--env-file", str(TPU / "example.env"), "--gke-cluster", "c",
                       "--gke-image", "img", "--render"))  # fmt: skip
    validate(json.loads(result.stdout))


def test_the_guides_jobset_is_what_render_prints(env):
    """docs/tpu.md shows the JobSet of its walkthrough's env file: the current rendering."""
    doc = (REPO / "docs" / "tpu.md").read_text()
    [env_text] = re.findall(r"```bash\n# tpu/my\.env\n(.*?)```", doc, re.S)
    (env.tmp / "my.env").write_text(env_text)
    [(prompt, shown)] = re.findall(r"```console\n(\$ tpu/gke/launch.sh [^\n]*--render[^\n]*)\n```"
                                   r"\n+```json\n(.*?)```", doc, re.S)  # fmt: skip
    words = [str(env.tmp / "my.env") if w == "tpu/my.env" else w for w in shlex.split(prompt)]
    result = ok(launch(env, *words[2:]))
    assert json.loads(result.stdout) == json.loads(shown)
    validate(json.loads(shown))
