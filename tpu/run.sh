#!/usr/bin/env bash
# Start the reference trainer on every worker of the slice, in the background.
# shellcheck source-path=SCRIPTDIR
# shellcheck disable=SC2016  # $(hostname), $$ and $! in single quotes are for the workers' shell
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu/run.sh [--env-file FILE] [options] [--dry-run] [-- TRAINER_ARGS...]

Start scripts/train.py on all workers at once (one JAX process per worker):
  gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --project=PROJECT --worker=all --command=...
Each worker runs, in REMOTE_DIR with the venv of tpu/install.sh active:
  nohup python scripts/train.py --data-config CONFIG --checkpoint-dir CKPT [TRAINER_ARGS...] \
    > LOG_DIR/train-$(hostname).log 2>&1 &
and refuses to start while a scripts/train.py is already running there (tpu/stop.sh).

Multi-host: jax.distributed.initialize() is called with no arguments. On a TPU VM slice JAX
reads the coordinator address, process count and process index from the TPU metadata, so
no address or rank is passed here; all workers must start (this command starts them together).

Environment on the workers: JAX_PLATFORMS=tpu, TPU_STDERR_LOG_LEVEL=0, TPU_MIN_LOG_LEVEL=0,
TF_CPP_MIN_LOG_LEVEL=0 (libtpu start-up messages go to the log), PYTHONUNBUFFERED=1, and
PIPELINE_DATA_DIR=DATA; then every --env KEY=VALUE in order (they can override the above).

Options (flag / environment or env-file variable):
  --name NAME             TPU_NAME            TPU name                                [required]
  --project PROJECT       TPU_PROJECT         Google Cloud project id                 [required]
  --zone ZONE             TPU_ZONE            e.g. us-central2-b                      [required]
  --config FILE           TPU_CONFIG          data config, relative to REMOTE_DIR or gs:// [required]
  --data LOCATION         TPU_DATA            where the token stores are: gs://bucket/stores or a
                                              path present on every worker; exported as
                                              PIPELINE_DATA_DIR                       [required]
  --checkpoint-dir DIR    TPU_CHECKPOINT_DIR  Orbax checkpoints; gs://... so that all
                                              workers share it                        [required]
  --remote-dir DIR        TPU_REMOTE_DIR      project dir on the workers (default: pipeline)
  --log-dir DIR           TPU_LOG_DIR         log dir, relative to REMOTE_DIR unless absolute
                                              (default: logs)
  --env KEY=VALUE         (repeatable)        extra environment for the trainer
  --env-file FILE         TPU_ENV_FILE        KEY=VALUE file (see tpu/example.env)
  --dry-run               print the gcloud command instead of running it
  -h, --help              this help
Words after `--` are passed to scripts/train.py (e.g. -- --resume --steps 1000).
EOF
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone config data checkpoint-dir remote-dir log-dir env"
BOOL_FLAGS=""
tpu_parse "$@"

check_common
require TPU_CONFIG TPU_DATA TPU_CHECKPOINT_DIR
remote_layout
if [[ $TPU_CHECKPOINT_DIR != gs://* ]]; then
  warn "--checkpoint-dir '$TPU_CHECKPOINT_DIR' is not gs://...; every worker must see the same directory for multi-host checkpoints"
fi

dir=$(remote_path "$TPU_REMOTE_DIR")
logdir=$(remote_path "$PROJECT_LOG_DIR")  # the command runs in the project directory
log="$logdir/train-\"\$(hostname)\".log"

exports="JAX_PLATFORMS=tpu TPU_STDERR_LOG_LEVEL=0 TPU_MIN_LOG_LEVEL=0 TF_CPP_MIN_LOG_LEVEL=0 PYTHONUNBUFFERED=1"
exports+=" PIPELINE_DATA_DIR=$(shquote "$TPU_DATA")"
for kv in ${REMOTE_ENV[@]+"${REMOTE_ENV[@]}"}; do
  exports+=" ${kv%%=*}=$(shquote "${kv#*=}")"
done

train=(python scripts/train.py --data-config "$TPU_CONFIG" --checkpoint-dir "$TPU_CHECKPOINT_DIR"
  ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})

remote='set -e; '
remote+="cd $dir; "
# The pattern matches a running trainer but not this shell ($$), whose command line quotes it.
remote+='if pgrep -f '\''[s]cripts/train.py'\'' | grep -vqx "$$"; then echo "error: scripts/train.py is already running on $(hostname); run tpu/stop.sh first" >&2; exit 1; fi; '
remote+="mkdir -p $logdir; "
remote+='. .venv/bin/activate; '
remote+="export $exports; "
remote+="nohup $(quote_cmd "${train[@]}") > $log 2>&1 < /dev/null & "
remote+='echo "started on $(hostname), pid $!"'

# Words after -- belong to the trainer, not to gcloud.
EXTRA_ARGS=()
need_gcloud
tpu_ssh "$remote" all
((DRY_RUN)) || note "logs: $REMOTE_LOG_DIR/train-<worker hostname>.log on each worker (tpu/logs.sh)"
