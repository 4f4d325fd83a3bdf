#!/usr/bin/env bash
# Start the reference trainer on every worker of the slice, in the background.
# shellcheck source-path=SCRIPTDIR
# shellcheck disable=SC2016  # $(hostname), $$ and $! in single quotes are for the workers' shell
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu/run.sh [--env-file FILE] [options] [--dry-run] [-- TRAINER_ARGS...]

Start scripts/train.py on all workers at once (one JAX process per worker), in two steps:
  1. preflight, on every worker (`tpu/worker.sh preflight`): refuse while a scripts/train.py
     runs (tpu/stop.sh), kill stale processes still holding /dev/accel* or /dev/vfio/*, and
     fail unless the worker sees its TPU chips. If any worker fails, none is started.
       gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --project=PROJECT --worker=all
         --command='cd REMOTE_DIR && tpu/worker.sh preflight'
  2. start, on every worker, in REMOTE_DIR with the venv of tpu/install.sh active:
       tpu/worker.sh start --log-dir LOG_DIR --max-log-bytes N [--log-uri URI]
         [--heartbeat-uri CKPT.heartbeat] [--sync-seconds SYNC] -- \
         python scripts/train.py --data-config CONFIG --checkpoint-dir CKPT [TRAINER_ARGS...]
     which appends to LOG_DIR/train-$(hostname).log under an attempt header (rotated to .1 at
     N bytes) and, with --log-uri, sends the lines written since the last copy to the next
     object URI/train-$(hostname)-STAMP.log.NNNNNN every SYNC seconds and when the trainer
     exits; the trainer's heartbeat (step, time) goes to CKPT.heartbeat/$(hostname) for
     tpu/recover.sh's watchdog (a gs:// CKPT). In the background (nohup) by default; --foreground
     waits for the trainer on every worker and fails when one fails (what tpu/recover.sh
     uses). The start is idempotent: gcloud's retry after a dropped connection waits for the
     running trainer (or reports the ended attempt) instead of starting another.

Multi-host: jax.distributed.initialize() is called with no arguments. On a TPU VM slice JAX
reads the coordinator address, process count and process index from the TPU metadata, so
no address or rank is passed here; all workers must start (this command starts them together).

Environment on the workers: JAX_PLATFORMS=tpu, TPU_STDERR_LOG_LEVEL=0, TPU_MIN_LOG_LEVEL=0,
TF_CPP_MIN_LOG_LEVEL=0 (libtpu start-up messages go to the log), PYTHONUNBUFFERED=1, and
PIPELINE_DATA_DIR=DATA; then every --env KEY=VALUE in order (they can override the above).

Options (flag / environment or env-file variable):
  --name NAME             TPU_NAME            TPU name                                [required]
  --project PROJECT       TPU_PROJECT         Google Cloud project id                 [required]
  --zone ZONE             TPU_ZONE            e.g. us-west4-a                         [required]
  --config FILE           TPU_CONFIG          data config: relative to REMOTE_DIR, or gs://...
                                                                                      [required]
  --data DIR              TPU_DATA            where the token stores are: gs://bucket/stores
                                              (read directly) or a directory on every worker,
                                              exported as PIPELINE_DATA_DIR             [required]
  --checkpoint-dir DIR    TPU_CHECKPOINT_DIR  Orbax checkpoints; gs://... so that all
                                              workers share it                        [required]
  --remote-dir DIR        TPU_REMOTE_DIR      project dir on the workers (default: pipeline)
  --log-dir DIR           TPU_LOG_DIR         log dir, relative to REMOTE_DIR unless absolute
                                              (default: logs)
  --log-uri URI           TPU_LOG_URI         gs://... to copy each worker's log to, so that it
                                              outlives the slice
  --sync-seconds N        TPU_SYNC_SECONDS    between two log and heartbeat copies (default: 60)
  --log-max-bytes N       TPU_LOG_MAX_BYTES   rotate the worker's log at this size (default: 100 MiB)
  --attach                TPU_ATTACH=1        no preflight: wait for the trainers that run
                                              (tpu/recover.sh restarted mid-run)
  --foreground            TPU_FOREGROUND=1    wait for the trainers; exit 1 if one fails
  --gcsfuse-bucket BUCKET TPU_GCSFUSE_BUCKET  mount it again before the preflight, since a
                                              restarted VM loses its mount (tpu/install.sh)
  --mount-point DIR       TPU_MOUNT_POINT     where (default: /mnt/BUCKET)
  --ssh-flags 'FLAGS'     TPU_SSH_FLAGS       extra words for every gcloud ssh (e.g. --internal-ip)
  --num-slices N          TPU_NUM_SLICES      multislice (tpu/create.sh --num-slices): run on the
                                              nodes NAME-0 ... NAME-(N-1) at once, with the
                                              MEGASCALE_* environment JAX needs to join them
  --env KEY=VALUE         (repeatable)        extra environment for the trainer
  --env-file FILE         TPU_ENV_FILE        KEY=VALUE file (see tpu/example.env)
  --dry-run               print the gcloud commands instead of running them
  -h, --help              this help
Words after `--` are passed to scripts/train.py (e.g. -- --resume --steps 1000).
EOF
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone config data checkpoint-dir remote-dir log-dir log-uri sync-seconds \
gcsfuse-bucket mount-point ssh-flags num-slices env log-max-bytes"
BOOL_FLAGS="foreground attach"
tpu_parse "$@"

check_common
require TPU_CONFIG TPU_DATA TPU_CHECKPOINT_DIR
remote_layout
check_mount
check_slices
bool TPU_FOREGROUND
TPU_SYNC_SECONDS=${TPU_SYNC_SECONDS:-60}
check TPU_SYNC_SECONDS '^[0-9]+$' 'a number of seconds'
TPU_LOG_MAX_BYTES=${TPU_LOG_MAX_BYTES:-104857600}
check TPU_LOG_MAX_BYTES '^[0-9]+$' 'a number of bytes'
bool TPU_ATTACH
check TPU_LOG_URI '^gs://[a-z0-9][-a-z0-9_.]*[a-z0-9](/.*)?$' 'a gs://bucket/path URI'
if [[ $TPU_DATA =~ ^[A-Za-z][A-Za-z0-9+.-]+:/ && ! $TPU_DATA =~ ^gs://[a-z0-9][-a-z0-9_.]*[a-z0-9](/.*)?$ ]]; then
  die "--data (TPU_DATA) '$TPU_DATA' is a URL other than gs://bucket/path: give gs://BUCKET/stores (read directly) or a directory on every worker (e.g. a gcsfuse mount)"
fi
if [[ $TPU_CHECKPOINT_DIR != gs://* ]]; then
  warn "--checkpoint-dir '$TPU_CHECKPOINT_DIR' is not gs://...; every worker must see the same directory for multi-host checkpoints"
fi

exports="JAX_PLATFORMS=tpu TPU_STDERR_LOG_LEVEL=0 TPU_MIN_LOG_LEVEL=0 TF_CPP_MIN_LOG_LEVEL=0 PYTHONUNBUFFERED=1"
exports+=" PIPELINE_DATA_DIR=$(shquote "$TPU_DATA")"
need_gcloud
if ((TPU_NUM_SLICES > 1)); then
  # Multislice: what JAX (jax._src.clusters.cloud_tpu_cluster) and libtpu's DCN transport read
  # to join the slices: every process of slice i gets MEGASCALE_SLICE_ID=i; the coordinator is
  # worker 0 of slice 0. JAX numbers the processes slice by slice.
  coordinator=""
  query coordinator gcloud compute tpus tpu-vm describe "$TPU_NAME-0" --zone="$TPU_ZONE" \
    --project="$TPU_PROJECT" '--format=value(networkEndpoints[0].ipAddress)' ||
    ((DRY_RUN)) || die "cannot describe $TPU_NAME-0 for the multislice coordinator's address"
  ((DRY_RUN)) && coordinator=COORDINATOR_IP # the dry run cannot know it
  exports+=" MEGASCALE_COORDINATOR_ADDRESS=$coordinator:8080 MEGASCALE_PORT=8080"
  exports+=" MEGASCALE_NUM_SLICES=$TPU_NUM_SLICES MEGASCALE_SLICE_ID={slice}"
fi
for kv in ${REMOTE_ENV[@]+"${REMOTE_ENV[@]}"}; do
  exports+=" ${kv%%=*}=$(shquote "${kv#*=}")"
done

start=(start --log-dir "$PROJECT_LOG_DIR" --max-log-bytes "$TPU_LOG_MAX_BYTES")
if [[ -n ${TPU_LOG_URI:-} ]]; then
  start+=(--log-uri "$TPU_LOG_URI")
fi
if [[ $TPU_CHECKPOINT_DIR == gs://* ]]; then
  # Each worker's heartbeat beside the checkpoints, for tpu/recover.sh's watchdog.
  start+=(--heartbeat-uri "${TPU_CHECKPOINT_DIR%/}.heartbeat")
fi
if [[ -n ${TPU_LOG_URI:-} || $TPU_CHECKPOINT_DIR == gs://* ]]; then
  start+=(--sync-seconds "$TPU_SYNC_SECONDS")
fi
if ((TPU_FOREGROUND)); then
  start+=(--foreground)
fi
start+=(-- python scripts/train.py --data-config "$TPU_CONFIG" --checkpoint-dir "$TPU_CHECKPOINT_DIR"
  ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})

# In the project directory: the venv and the environment, then the worker's start.
remote="cd $(remote_path "$TPU_REMOTE_DIR") && . .venv/bin/activate && export $exports && exec tpu/worker.sh $(quote_cmd "${start[@]}")"

# Words after -- belong to the trainer, not to gcloud.
EXTRA_ARGS=()
preflight=$(worker_cmd preflight)
if [[ -n ${TPU_GCSFUSE_BUCKET:-} ]]; then
  # A VM restarted in place (maintenance, tpu/recover.sh) has lost its gcsfuse mount.
  preflight="cd $(remote_path "$TPU_REMOTE_DIR") && $(mount_cmd) && tpu/worker.sh preflight"
fi
# --attach (tpu/recover.sh restarted mid-run): no preflight, which refuses a running trainer;
# the start command then waits for the trainer that runs and returns its status.
((TPU_ATTACH)) || tpu_ssh "$preflight" all
tpu_ssh "$remote" all
((DRY_RUN || TPU_FOREGROUND)) || note "logs: $REMOTE_LOG_DIR/train-<worker hostname>.log on each worker (tpu/logs.sh)"
