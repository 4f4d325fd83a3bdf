"""Render the JobSet that runs scripts/train.py on a GKE TPU slice or multislice.

Read by tpu/gke/launch.sh, which applies the env file and flags (tpu/common.sh) and passes the
TPU_* values in the environment; this module only turns them into a manifest (JSON, which
kubectl reads as YAML). One pod per TPU VM host, each running `scripts/train.py --resume`
with its checkpoints in a bucket; any pod's failure restarts the whole JobSet (a multi-host
JAX job cannot lose a process), a preemption or maintenance eviction without spending
`failurePolicy.maxRestarts`, a parameter error (the trainer's exit status 2) not at all.

Stdlib only: it runs on the machine that launches the job, not in the project's venv.
"""

from __future__ import annotations

import json
import os
import shlex
import sys

# Generation -> (GKE's accelerator label, TensorCores per chip, topology dimensions): the
# accelerator type counts TensorCores (v5p-64 is 32 chips), GKE's topology counts chips.
GENERATIONS = {
    "v4": ("tpu-v4-podslice", 2, 3),
    "v5litepod": ("tpu-v5-lite-podslice", 1, 2),
    "v5p": ("tpu-v5p-slice", 2, 3),
    "v6e": ("tpu-v6e-slice", 1, 2),
    "tpu7x": ("tpu7x", 2, 3),  # Ironwood: GKE only (the Cloud TPU VM API ends at v6e)
}
CHIPS_PER_HOST = 4  # every multi-host TPU VM of these generations
HEARTBEAT = "/tmp/pipeline-heartbeat"  # scripts/heartbeat.py, read by the liveness probe
PREEMPTED = ".*DisruptionTarget.*"  # the Job's failure message after an eviction
JOB_INDEX = "metadata.annotations['jobset.sigs.k8s.io/job-index']"  # the slice's index


class BadParameter(Exception):
    pass


def shape(accelerator: str, topology: str = "") -> tuple[str, str, int, int]:
    """(GKE accelerator, topology, hosts per slice, chips per host) of e.g. v5p-64."""
    generation, _, count = accelerator.rpartition("-")
    if generation not in GENERATIONS or not count.isdigit():
        known = ", ".join(f"{g}-N" for g in GENERATIONS)
        raise BadParameter(f"--accelerator-type '{accelerator}' is not one of {known}")
    label, cores, dims = GENERATIONS[generation]
    chips = int(count) // cores
    if not topology:
        if chips & (chips - 1) or chips == 0:
            raise BadParameter(f"{accelerator} is {chips} chips: give --gke-topology AxB(xC)")
        sides = [1] * dims
        while sides[0] * sides[1] * sides[-1] ** (dims - 2) < chips:
            sides[sides.index(min(sides))] *= 2
        sides = sorted(s for s in sides if s > 1) + [s for s in sides if s == 1]
        topology = "x".join(map(str, sides))
    sides = [int(s) for s in topology.split("x") if s.isdigit()]
    product = 1
    for side in sides:
        product *= side
    if len(sides) != dims or product != chips:
        raise BadParameter(
            f"--gke-topology '{topology}' is not {dims} sides with {chips} chips ({accelerator})"
        )
    per_host = 1 if chips == 1 else CHIPS_PER_HOST
    return label, topology, chips // per_host, per_host


def liveness(hang_timeout: str) -> dict:
    """Fails when the heartbeat is older than the hang timeout (auto: twice the trainer's
    measured save interval, at least 600 s); passes before the first step wrote one."""
    if hang_timeout == "auto":
        limit = (
            f'save=$(sed -n "s/.* save_seconds=\\([0-9]*\\).*/\\1/p" {HEARTBEAT}); '
            'limit=$((2 * ${save:-0})); [ "$limit" -ge 600 ] || limit=600; '
        )
    else:
        limit = f"limit={int(hang_timeout)}; "
    script = (
        f"[ -e {HEARTBEAT} ] || exit 0; {limit}"
        f'[ $(($(date +%s) - $(stat -c %Y {HEARTBEAT}))) -lt "$limit" ]'
    )
    return {"exec": {"command": ["sh", "-c", script]}, "periodSeconds": 60, "failureThreshold": 1}


def environment(env: dict[str, str], name: str, slices: int) -> list[dict]:
    pairs = [
        ("JAX_PLATFORMS", "tpu"),
        ("PYTHONUNBUFFERED", "1"),
        ("PIPELINE_HEARTBEAT", HEARTBEAT),
        ("PIPELINE_DATA_DIR", env["TPU_DATA"]),
    ]
    out = [{"name": k, "value": v} for k, v in pairs]
    if slices > 1:  # what JAX and libtpu read to join the slices over the data-center network
        coordinator = f"{name}-slice-0-0.{name}"  # pod 0 of job 0, behind JobSet's service
        out += [
            {"name": "MEGASCALE_COORDINATOR_ADDRESS", "value": f"{coordinator}:8080"},
            {"name": "MEGASCALE_NUM_SLICES", "value": str(slices)},
            {"name": "MEGASCALE_PORT", "value": "8080"},
            {"name": "MEGASCALE_SLICE_ID", "valueFrom": {"fieldRef": {"fieldPath": JOB_INDEX}}},
        ]
    for pair in env.get("TPU_EXTRA_ENV", "").splitlines():  # launch.sh's --env KEY=VALUE
        if pair:
            key, _, value = pair.partition("=")
            out.append({"name": key, "value": value})
    return out


def pod(env: dict[str, str], name: str, slices: int, chips: int, selectors: dict) -> dict:
    command = [
        "python",
        "scripts/train.py",
        "--data-config",
        env["TPU_CONFIG"],
        "--checkpoint-dir",
        env["TPU_CHECKPOINT_DIR"],
        "--resume",
        *shlex.split(env.get("TPU_TRAINER_ARGS", "")),
    ]
    container = {
        "name": "trainer",
        "image": env["TPU_GKE_IMAGE"],
        "command": command,  # logs: stdout and stderr, which GKE sends to Cloud Logging
        "env": environment(env, name, slices),
        "ports": [{"containerPort": 8471}, {"containerPort": 8080}],
        "resources": {"limits": {"google.com/tpu": chips}, "requests": {"google.com/tpu": chips}},
        "livenessProbe": liveness(env.get("TPU_HANG_TIMEOUT") or "auto"),
    }
    spec = {
        "restartPolicy": "Never",
        "nodeSelector": selectors,
        # SIGTERM first (a preemption notice: the trainer saves), SIGKILL after the grace.
        "terminationGracePeriodSeconds": int(env.get("TPU_GRACE_SECONDS") or 300),
        "containers": [container],
    }
    metadata: dict = {}
    if env.get("TPU_GKE_SERVICE_ACCOUNT"):  # Workload Identity: the bucket's reader/writer
        spec["serviceAccountName"] = env["TPU_GKE_SERVICE_ACCOUNT"]
    if env.get("TPU_GCSFUSE_BUCKET"):  # the token stores through Cloud Storage FUSE's CSI driver
        bucket = env["TPU_GCSFUSE_BUCKET"].removeprefix("gs://").rstrip("/")
        metadata["annotations"] = {"gke-gcsfuse/volumes": "true"}
        spec["volumes"] = [
            {
                "name": "stores",
                "csi": {
                    "driver": "gcsfuse.csi.storage.gke.io",
                    "readOnly": True,
                    "volumeAttributes": {"bucketName": bucket, "mountOptions": "implicit-dirs"},
                },
            }
        ]
        mount = env.get("TPU_MOUNT_POINT") or f"/mnt/{bucket}"
        container["volumeMounts"] = [{"name": "stores", "mountPath": mount, "readOnly": True}]
    return {"metadata": metadata, "spec": spec}


def jobset(env: dict[str, str]) -> dict:
    for key in (
        "TPU_NAME",
        "TPU_ACCELERATOR_TYPE",
        "TPU_GKE_IMAGE",
        "TPU_CONFIG",
        "TPU_DATA",
        "TPU_CHECKPOINT_DIR",
    ):
        if not env.get(key):
            raise BadParameter(f"missing {key} (a flag of tpu/gke/launch.sh or the env file)")
    if not env["TPU_CHECKPOINT_DIR"].startswith("gs://"):
        raise BadParameter(
            f"TPU_CHECKPOINT_DIR '{env['TPU_CHECKPOINT_DIR']}' is not gs://...: every pod, "
            "on every restart, must see the same checkpoints"
        )
    name, slices = env["TPU_NAME"], int(env.get("TPU_NUM_SLICES") or 1)
    label, topology, hosts, chips = shape(
        env["TPU_ACCELERATOR_TYPE"], env.get("TPU_GKE_TOPOLOGY", "")
    )
    selectors = {
        "cloud.google.com/gke-tpu-accelerator": label,
        "cloud.google.com/gke-tpu-topology": topology,
    }
    if env.get("TPU_CAPACITY") == "spot":
        selectors["cloud.google.com/gke-spot"] = "true"
    job = {
        "parallelism": hosts,
        "completions": hosts,
        "completionMode": "Indexed",  # pod i is host i (JAX's process order within a slice)
        "backoffLimit": 0,  # one pod fails: the Job fails, and the JobSet restarts them all
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                },
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2]},
                },
            ]
        },
        "template": pod(env, name, slices, chips, selectors),
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": name,
            "namespace": env.get("TPU_GKE_NAMESPACE") or "default",
            # One slice per node pool: the pods of a Job land on one slice's hosts.
            "annotations": {
                "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
            },
        },
        "spec": {
            "failurePolicy": {
                "maxRestarts": int(env.get("TPU_MAX_RESTARTS") or 10),
                "rules": [
                    {
                        "name": "preemption",
                        "action": "RestartJobSetAndIgnoreMaxRestarts",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                        "onJobFailureMessagePatterns": [PREEMPTED],
                    },
                    {
                        "name": "parameterError",
                        "action": "FailJobSet",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                        "onJobFailureMessagePatterns": [".*exit code 2 .*"],
                    },
                ],
            },
            "replicatedJobs": [{"name": "slice", "replicas": slices, "template": {"spec": job}}],
        },
    }


def main() -> int:
    try:
        manifest = jobset(dict(os.environ))
    except BadParameter as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    json.dump(manifest, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
