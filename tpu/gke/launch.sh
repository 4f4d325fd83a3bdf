#!/usr/bin/env bash
# Run the same training on GKE: render the JobSet from the env file of tpu/, then apply it.
# shellcheck source-path=SCRIPTDIR/..
set -euo pipefail

usage() {
  cat <<'EOF_USAGE'
Usage: tpu/gke/launch.sh [--env-file FILE] [options] [--render | --xpk | --delete] [--dry-run]
                         [-- TRAINER_ARGS...]

The run of tpu/recover.sh, on a GKE cluster with a TPU slice node pool (the path for TPU7x
and later, which the Cloud TPU VM API does not offer). From the same env file:
  --render   print the JobSet (tpu/gke/jobset.py): one pod per TPU VM host, each running
             `python scripts/train.py --data-config CONFIG --checkpoint-dir CKPT --resume
             TRAINER_ARGS`, node selectors for the accelerator and topology, a restart of the
             whole JobSet on any pod's failure (preemptions not counted against
             --max-restarts, the trainer's parameter errors, exit status 2, never restarted),
             a liveness probe on the trainer's heartbeat, logs on stdout (Cloud Logging)
  (default)  render it to TMPDIR/jobset-NAME.json and apply it:
               gcloud container clusters get-credentials CLUSTER --location=REGION --project=PROJECT
               kubectl apply -f TMPDIR/jobset-NAME.json
  --xpk      the xpk command that creates an equivalent workload instead
  --delete   kubectl delete jobset NAME (the checkpoints stay in the bucket)

Options (flag / environment or env-file variable), besides the keys of tpu/example.env:
  --name NAME               TPU_NAME              the JobSet's name                  [required]
  --project PROJECT         TPU_PROJECT           Google Cloud project id            [required]
  --zone ZONE               TPU_ZONE              the cluster's zone (its region: --location)
  --gke-cluster NAME        TPU_GKE_CLUSTER       the GKE cluster                    [required]
  --gke-image IMAGE         TPU_GKE_IMAGE         a container image with the project installed
                                                  (its digest pins the run's code)   [required]
  --accelerator-type TYPE   TPU_ACCELERATOR_TYPE  v5litepod-16, v5p-64, v6e-16, tpu7x-128, ...
  --gke-topology AxB[xC]    TPU_GKE_TOPOLOGY      the slice's chips (default: from the type)
  --num-slices N            TPU_NUM_SLICES        multislice: N slices, one Job each
  --config, --data, --checkpoint-dir (gs://), --capacity spot, --max-restarts,
  --grace-seconds, --hang-timeout, --gcsfuse-bucket, --mount-point, --env KEY=VALUE
  --gke-namespace NS        TPU_GKE_NAMESPACE     (default: default)
  --gke-service-account SA  TPU_GKE_SERVICE_ACCOUNT  Kubernetes service account (Workload
                                                  Identity) that may use the bucket
  --env-file FILE           TPU_ENV_FILE          KEY=VALUE file (see tpu/example.env)
  --dry-run                 print the commands instead of running them
  -h, --help                this help
Words after `--` are passed to scripts/train.py.
EOF_USAGE
}

# shellcheck source=SCRIPTDIR/../common.sh
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

VALUE_FLAGS="name project zone accelerator-type capacity config data checkpoint-dir num-slices \
max-restarts grace-seconds hang-timeout gcsfuse-bucket mount-point gke-cluster gke-image \
gke-topology gke-namespace gke-service-account env"
BOOL_FLAGS="render xpk delete"
unset TPU_RENDER TPU_XPK TPU_DELETE # flags only
tpu_parse "$@"

check_common
require TPU_GKE_CLUSTER
bool TPU_RENDER
bool TPU_XPK
bool TPU_DELETE
check_slices
check_mount
check TPU_GKE_CLUSTER '^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$' 'a GKE cluster name'
check TPU_GKE_NAMESPACE '^[a-z0-9]([-a-z0-9]*[a-z0-9])?$' 'a Kubernetes namespace'
TPU_GKE_NAMESPACE=${TPU_GKE_NAMESPACE:-default}

# jobset.py reads the values from its environment.
for var in $TPU_KNOWN_KEYS; do
  if [[ -n ${!var:-} ]]; then
    export "${var?}"
  fi
done
TPU_TRAINER_ARGS=$(quote_cmd ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
TPU_EXTRA_ENV=$(printf '%s\n' ${REMOTE_ENV[@]+"${REMOTE_ENV[@]}"})
export TPU_TRAINER_ARGS TPU_EXTRA_ENV
render() { "${PYTHON:-python3}" "$(dirname "${BASH_SOURCE[0]}")/jobset.py"; }

if ((TPU_RENDER)); then
  render
  exit 0
fi
if ((TPU_XPK && !TPU_DELETE)); then
  require TPU_ACCELERATOR_TYPE TPU_GKE_IMAGE TPU_CONFIG TPU_DATA TPU_CHECKPOINT_DIR
  command="python scripts/train.py --data-config $(shquote "$TPU_CONFIG") --checkpoint-dir $(shquote "$TPU_CHECKPOINT_DIR") --resume${TPU_TRAINER_ARGS:+ $TPU_TRAINER_ARGS}"
  capacity=()
  [[ ${TPU_CAPACITY:-} == spot ]] && capacity=(--spot)
  [[ ${TPU_CAPACITY:-} == on-demand ]] && capacity=(--on-demand)
  envs=(--env "PIPELINE_DATA_DIR=$TPU_DATA")
  for kv in ${REMOTE_ENV[@]+"${REMOTE_ENV[@]}"}; do envs+=(--env "$kv"); done
  run xpk workload create --cluster="$TPU_GKE_CLUSTER" --project="$TPU_PROJECT" --zone="$TPU_ZONE" \
    --workload="$TPU_NAME" --tpu-type="$TPU_ACCELERATOR_TYPE" --num-slices="$TPU_NUM_SLICES" \
    --docker-image="$TPU_GKE_IMAGE" --max-restarts="${TPU_MAX_RESTARTS:-10}" \
    ${capacity[@]+"${capacity[@]}"} "${envs[@]}" --command="$command"
  exit 0
fi

manifest="${TMPDIR:-/tmp}/jobset-$TPU_NAME.json"
if ((!TPU_DELETE)); then
  # Rendered first: a bad parameter is one line, before anything is run.
  rendered=$(render) || exit 2
  ((DRY_RUN)) || printf '%s\n' "$rendered" >"$manifest"
fi
need_gcloud
run gcloud container clusters get-credentials "$TPU_GKE_CLUSTER" --location="${TPU_ZONE%-*}" \
  --project="$TPU_PROJECT"
if ((TPU_DELETE)); then
  run kubectl delete jobset "$TPU_NAME" --namespace="$TPU_GKE_NAMESPACE"
else
  run kubectl apply -f "$manifest"
  note "follow it: kubectl get jobset $TPU_NAME -n $TPU_GKE_NAMESPACE; logs: kubectl logs -f -n $TPU_GKE_NAMESPACE -l jobset.sigs.k8s.io/jobset-name=$TPU_NAME --prefix --max-log-requests 64"
fi
