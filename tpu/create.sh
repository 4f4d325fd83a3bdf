#!/usr/bin/env bash
# Create a TPU VM slice, directly or through a queued resource.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu/create.sh [--env-file FILE] [options] [--wait] [--dry-run] [-- EXTRA_GCLOUD_FLAGS...]

Create a TPU VM slice, unless it exists already (idempotent):
  gcloud compute tpus tpu-vm describe NAME --zone=ZONE --project=PROJECT --format='value(state)'
    (queued: gcloud compute tpus queued-resources describe ... --format='value(state.state)')
An existing slice that is usable or on its way (READY, CREATING, ACTIVE, WAITING_FOR_RESOURCES,
...) is kept; one that is PREEMPTED, SUSPENDED, FAILED, ... is an error, exit status 1
(tpu/delete.sh first). Exit status 2 is a parameter error; 1 anything that may pass later.

  direct (default):
    gcloud compute tpus tpu-vm create NAME --zone=ZONE --project=PROJECT
      --accelerator-type=TYPE --version=RUNTIME [--spot|--reserved]
  --queued:
    gcloud compute tpus queued-resources create NAME --node-id=NAME --zone=ZONE
      --project=PROJECT --accelerator-type=TYPE --runtime-version=RUNTIME [--spot|--reserved]
    (the queued resource waits for capacity; the TPU node it creates is also called NAME;
    with --num-slices N: --node-count=N --node-prefix=NAME instead of --node-id)
  --wait: then poll the describe command every POLL seconds until the state is READY (direct)
    or ACTIVE (queued); FAILED, SUSPENDED, PREEMPTED, ... end the wait with that state, exit 1.

Options (flag / environment or env-file variable):
  --name NAME               TPU_NAME              TPU (and queued resource) name   [required]
  --project PROJECT         TPU_PROJECT           Google Cloud project id          [required]
  --zone ZONE               TPU_ZONE              e.g. us-west4-a (v5e)            [required]
  --accelerator-type TYPE   TPU_ACCELERATOR_TYPE  e.g. v5litepod-16, v4-32         [required]
  --runtime-version VER     TPU_RUNTIME_VERSION   e.g. v2-alpha-tpuv5-lite         [required]
  --queued                  TPU_QUEUED=1          use the queued-resources path
  --spot | --reserved | --on-demand
                            TPU_CAPACITY          spot, reserved or on-demand (default)
  --wait                    TPU_WAIT=1            wait until the slice is ready to use
  --autocheckpoint          TPU_AUTOCHECKPOINT=1  create with `gcloud alpha ... --autocheckpoint-enabled`:
                                                  SIGTERM (a save) before maintenance events
  --num-slices N            TPU_NUM_SLICES        multislice (with --queued): N slices, the
                                                  nodes NAME-0 ... NAME-(N-1) (alias --node-count)
  --poll-seconds N          TPU_POLL_SECONDS      between two describes (default: 30)
  --create-flags 'FLAGS'    TPU_CREATE_FLAGS      extra words for the create command, split at
                                                  blanks (e.g. '--network=my-net
                                                  --service-account=SA --reservation=R')
  --env-file FILE           TPU_ENV_FILE          KEY=VALUE file (see tpu/example.env)
  --dry-run                 print the gcloud command instead of running it
  -h, --help                this help
Words after `--` are appended to the gcloud create command too (e.g. -- --network=my-net).
Precedence: flags > env file > environment. Missing or invalid parameters exit with status 2.
EOF
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone accelerator-type runtime-version capacity poll-seconds create-flags \
num-slices"
BOOL_FLAGS="queued wait autocheckpoint"
tpu_parse "$@"

check_common
require TPU_ACCELERATOR_TYPE TPU_RUNTIME_VERSION
check TPU_ACCELERATOR_TYPE '^v[0-9][a-z0-9]*-[0-9]+$' 'a valid accelerator type (e.g. v5litepod-16, v4-32)'
check TPU_RUNTIME_VERSION '^[A-Za-z0-9._-]+$' 'a valid runtime version (e.g. v2-alpha-tpuv5-lite)'
bool TPU_WAIT
bool TPU_AUTOCHECKPOINT
bool TPU_QUEUED
check_slices
if ((TPU_NUM_SLICES > 1 && !TPU_QUEUED)); then
  die "--num-slices $TPU_NUM_SLICES needs --queued (TPU_QUEUED=1): only a queued resource creates several slices"
fi
TPU_POLL_SECONDS=${TPU_POLL_SECONDS:-30}
check TPU_POLL_SECONDS '^[0-9]+([.][0-9]+)?$' 'a number of seconds'
TPU_CAPACITY=${TPU_CAPACITY:-on-demand}
check TPU_CAPACITY '^(on-demand|spot|reserved)$' 'one of on-demand, spot, reserved'

capacity=()
case $TPU_CAPACITY in
  spot) capacity=(--spot) ;;
  reserved) capacity=(--reserved) ;;
esac

# --autocheckpoint: the alpha track's --autocheckpoint-enabled makes Cloud TPU send the
# trainer SIGTERM (so it saves) before a maintenance event; without it maintenance just starts.
track=()
if ((TPU_AUTOCHECKPOINT)); then
  track=(alpha)
  capacity+=(--autocheckpoint-enabled)
fi
# One slice: --node-id=NAME; several: the nodes NAME-0 ... NAME-(N-1).
node=(--node-id="$TPU_NAME")
((TPU_NUM_SLICES > 1)) && node=(--node-count="$TPU_NUM_SLICES" --node-prefix="$TPU_NAME")

ready=READY
((TPU_QUEUED)) && ready=ACTIVE

need_gcloud
words TPU_CREATE_FLAGS
create_flags=(${WORDS[@]+"${WORDS[@]}"})
tpu_state state
if [[ -n $state ]]; then
  if [[ $state =~ $DEAD_STATES ]]; then
    # A state, not a parameter error: exit 1, so that tpu/recover.sh deletes it and tries again.
    note "error: $TPU_NAME exists in state $state; delete it first (tpu/delete.sh)"
    exit 1
  fi
  note "$TPU_NAME exists already (state $state); not creating it again"
elif ((TPU_QUEUED)); then
  run gcloud ${track[@]+"${track[@]}"} compute tpus queued-resources create "$TPU_NAME" "${node[@]}" \
    --zone="$TPU_ZONE" --project="$TPU_PROJECT" \
    --accelerator-type="$TPU_ACCELERATOR_TYPE" --runtime-version="$TPU_RUNTIME_VERSION" \
    ${capacity[@]+"${capacity[@]}"} ${create_flags[@]+"${create_flags[@]}"} ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
  ((TPU_WAIT)) || note "queued resource $TPU_NAME requested; it is ready when its state is ACTIVE (create.sh --wait waits for it)"
else
  run gcloud ${track[@]+"${track[@]}"} compute tpus tpu-vm create "$TPU_NAME" \
    --zone="$TPU_ZONE" --project="$TPU_PROJECT" \
    --accelerator-type="$TPU_ACCELERATOR_TYPE" --version="$TPU_RUNTIME_VERSION" \
    ${capacity[@]+"${capacity[@]}"} ${create_flags[@]+"${create_flags[@]}"} ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
fi

if ((TPU_WAIT)); then
  unseen=0
  while :; do
    tpu_state state
    ((DRY_RUN)) && break
    [[ $state == "$ready" ]] && break
    [[ $state =~ $DEAD_STATES ]] && { note "error: $TPU_NAME is $state, not $ready"; exit 1; }
    if [[ -z $state ]]; then
      unseen=$((unseen + 1))
      ((unseen < 10)) || { note "error: $TPU_NAME cannot be described (10 tries; see the gcloud errors above)"; exit 1; }
    fi
    note "$TPU_NAME is ${state:-not visible yet}; waiting for $ready (next check in ${TPU_POLL_SECONDS}s)"
    sleep "$TPU_POLL_SECONDS"
  done
  ((DRY_RUN)) || note "$TPU_NAME is $ready"
fi
