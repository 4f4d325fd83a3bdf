#!/usr/bin/env bash
# Create a TPU VM slice, directly or through a queued resource.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu/create.sh [--env-file FILE] [options] [--dry-run] [-- EXTRA_GCLOUD_FLAGS...]

Create a TPU VM slice.

  direct (default):
    gcloud compute tpus tpu-vm create NAME --zone=ZONE --project=PROJECT
      --accelerator-type=TYPE --version=RUNTIME [--spot|--reserved]
  --queued:
    gcloud compute tpus queued-resources create NAME --node-id=NAME --zone=ZONE
      --project=PROJECT --accelerator-type=TYPE --runtime-version=RUNTIME [--spot|--reserved]
    (the queued resource waits for capacity; the TPU node it creates is also called NAME)

Options (flag / environment or env-file variable):
  --name NAME               TPU_NAME              TPU (and queued resource) name   [required]
  --project PROJECT         TPU_PROJECT           Google Cloud project id          [required]
  --zone ZONE               TPU_ZONE              e.g. us-central2-b               [required]
  --accelerator-type TYPE   TPU_ACCELERATOR_TYPE  e.g. v5litepod-16, v4-32         [required]
  --runtime-version VER     TPU_RUNTIME_VERSION   e.g. v2-alpha-tpuv5-lite         [required]
  --queued                  TPU_QUEUED=1          use the queued-resources path
  --spot | --reserved | --on-demand
                            TPU_CAPACITY          spot, reserved or on-demand (default)
  --env-file FILE           TPU_ENV_FILE          KEY=VALUE file (see tpu/example.env)
  --dry-run                 print the gcloud command instead of running it
  -h, --help                this help
Words after `--` are appended to the gcloud command (e.g. -- --network=my-net).
Precedence: flags > env file > environment. Missing or invalid parameters exit with status 2.
EOF
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone accelerator-type runtime-version capacity"
BOOL_FLAGS="queued"
tpu_parse "$@"

check_common
require TPU_ACCELERATOR_TYPE TPU_RUNTIME_VERSION
check TPU_ACCELERATOR_TYPE '^v[0-9][a-z0-9]*-[0-9]+$' 'a valid accelerator type (e.g. v5litepod-16, v4-32)'
check TPU_RUNTIME_VERSION '^[A-Za-z0-9._-]+$' 'a valid runtime version (e.g. v2-alpha-tpuv5-lite)'
bool TPU_QUEUED
TPU_CAPACITY=${TPU_CAPACITY:-on-demand}
check TPU_CAPACITY '^(on-demand|spot|reserved)$' 'one of on-demand, spot, reserved'

capacity=()
case $TPU_CAPACITY in
  spot) capacity=(--spot) ;;
  reserved) capacity=(--reserved) ;;
esac

need_gcloud
if ((TPU_QUEUED)); then
  run gcloud compute tpus queued-resources create "$TPU_NAME" --node-id="$TPU_NAME" \
    --zone="$TPU_ZONE" --project="$TPU_PROJECT" \
    --accelerator-type="$TPU_ACCELERATOR_TYPE" --runtime-version="$TPU_RUNTIME_VERSION" \
    ${capacity[@]+"${capacity[@]}"} ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
  note "queued resource $TPU_NAME requested; it is ready when its state is ACTIVE:"
  note "  gcloud compute tpus queued-resources describe $(shquote "$TPU_NAME") --zone=$(shquote "$TPU_ZONE") --project=$(shquote "$TPU_PROJECT")"
else
  run gcloud compute tpus tpu-vm create "$TPU_NAME" \
    --zone="$TPU_ZONE" --project="$TPU_PROJECT" \
    --accelerator-type="$TPU_ACCELERATOR_TYPE" --version="$TPU_RUNTIME_VERSION" \
    ${capacity[@]+"${capacity[@]}"} ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
fi
