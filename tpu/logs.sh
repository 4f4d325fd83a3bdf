#!/usr/bin/env bash
# Follow the trainer's logs on the workers, or copy them back.
# shellcheck source-path=SCRIPTDIR
# shellcheck disable=SC2016  # $(hostname), $$ and $! in single quotes are for the workers' shell
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu/logs.sh [--env-file FILE] [options] [--collect DIR] [--dry-run] [-- EXTRA_GCLOUD_FLAGS...]

Stream (default): follow each worker's log, every line prefixed with the worker's hostname
(Ctrl-C to stop; the trainer keeps running):
  gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --project=PROJECT --worker=all
    --command='tail -n 200 -F LOG_DIR/train-"$(hostname)".log | sed -u ...'
Collect (--collect DIR): copy the log directory of each worker into DIR/ (the file names
carry the worker's hostname, so workers do not overwrite each other). gcloud copies from one
worker at a time, so with --worker all the workers are counted first:
  mkdir -p DIR
  gcloud compute tpus tpu-vm describe NAME --zone=ZONE --project=PROJECT
    --format='value(networkEndpoints.len())'
  gcloud compute tpus tpu-vm scp --recurse --worker=I NAME:LOG_DIR DIR --zone=ZONE --project=PROJECT
    (once per worker I; a dry run, which cannot count, shows worker 0's)
Logs that must outlive the slice: tpu/run.sh --log-uri gs://... copies them as the run goes.

Options (flag / environment or env-file variable):
  --name NAME           TPU_NAME         TPU name                                   [required]
  --project PROJECT     TPU_PROJECT      Google Cloud project id                    [required]
  --zone ZONE           TPU_ZONE         e.g. us-west4-a                            [required]
  --worker W            TPU_WORKER       all (default), a worker index such as 0, a list 0,2,
                                         a range 0-3 or both (0,4-6); of each slice
  --lines N                              lines of history to show first (default: 200)
  --collect DIR                          copy the logs into local DIR instead of streaming
  --remote-dir DIR      TPU_REMOTE_DIR   project dir on the workers (default: pipeline)
  --log-dir DIR         TPU_LOG_DIR      relative to REMOTE_DIR unless absolute (default: logs)
  --ssh-flags 'FLAGS'   TPU_SSH_FLAGS    extra words for every gcloud ssh/scp (e.g. --internal-ip)
  --env-file FILE       TPU_ENV_FILE     KEY=VALUE file (see tpu/example.env)
  --dry-run             print the commands instead of running them
  -h, --help            this help
Words after `--` are appended to the gcloud command (e.g. -- --internal-ip).
EOF
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone worker lines collect remote-dir log-dir ssh-flags num-slices"
BOOL_FLAGS=""
unset TPU_LINES TPU_COLLECT # flags only, never from the environment
tpu_parse "$@"

check_common
remote_layout
TPU_WORKER=${TPU_WORKER:-all}
check TPU_WORKER '^(all|[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*)$' 'all, a worker index or a list of indexes and ranges (e.g. 0, 0,2 or 0-3)'
check_slices
TPU_LINES=${TPU_LINES:-200}
check TPU_LINES '^[0-9]+$' 'a number of lines'

need_gcloud
if [[ -n ${TPU_COLLECT:-} ]]; then
  run mkdir -p "$TPU_COLLECT"
  for node in $(nodes); do
    if [[ $TPU_WORKER == all ]]; then
      workers=0 count=""
      if count_workers count "$node"; then
        workers="0-$((count - 1))"
      elif ((!DRY_RUN)); then
        die "cannot describe $node or count its workers (see the gcloud error above)"
      fi
    else
      workers=$TPU_WORKER
    fi
    for worker in $(expand_workers "$workers"); do
      tpu_scp --recurse --worker="$worker" "$node:$REMOTE_LOG_DIR" "$TPU_COLLECT"
    done
  done
  ((DRY_RUN)) || note "logs copied to $TPU_COLLECT/$(basename "$REMOTE_LOG_DIR")/"
else
  logdir=$(remote_path "$REMOTE_LOG_DIR")
  remote="tail -n $TPU_LINES -F $logdir/train-\"\$(hostname)\".log 2>&1 | sed -u \"s/^/[\$(hostname)] /\""
  tpu_ssh "$remote" "$TPU_WORKER"
fi
