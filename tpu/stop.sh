#!/usr/bin/env bash
# Stop the trainer gracefully (a checkpoint first), then free the TPU, on every worker.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'EOF_USAGE'
Usage: tpu/stop.sh [--env-file FILE] [options] [--dry-run] [-- EXTRA_GCLOUD_FLAGS...]

Stop scripts/train.py and free the TPU, on all workers:
  gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --project=PROJECT --worker=all
    --command='cd REMOTE_DIR && tpu/worker.sh stop GRACE'
which, on each worker, first asks: SIGTERM to the trainer, which JAX takes as a preemption
notice, so every process saves a checkpoint at the same step and exits (status 75); then,
after GRACE seconds, SIGKILL to a trainer still running and to whatever else still has
/dev/accel* or /dev/vfio/* open, and removes /tmp/libtpu_lockfile. Succeeds when nothing runs.
(A TPU can be opened by one process at a time; a leftover process makes the next run fail
with "TPU in use" or hang at start-up.)
First, with --checkpoint-dir, it leaves the stop marker CHECKPOINT_DIR.recover-stop, which
ends a tpu/recover.sh loop of this run (wherever it runs) instead of letting it restart:
  gcloud storage cp /tmp/tpu-recover-stop-NAME CHECKPOINT_DIR.recover-stop

Options (flag / environment or env-file variable):
  --name NAME           TPU_NAME            TPU name                    [required]
  --project PROJECT     TPU_PROJECT         Google Cloud project id     [required]
  --zone ZONE           TPU_ZONE            e.g. us-west4-a             [required]
  --grace-seconds N     TPU_GRACE_SECONDS   time to save and exit before SIGKILL (default: 300)
  --remote-dir DIR      TPU_REMOTE_DIR      project dir on the workers (default: pipeline)
  --checkpoint-dir DIR  TPU_CHECKPOINT_DIR  the run's; the stop marker goes beside it
  --ssh-flags 'FLAGS'   TPU_SSH_FLAGS       extra words for gcloud ssh (e.g. --internal-ip)
  --env-file FILE       TPU_ENV_FILE        KEY=VALUE file (see tpu/example.env)
  --dry-run             print the gcloud command instead of running it
  -h, --help            this help
Words after `--` are appended to the gcloud command (e.g. -- --internal-ip).
EOF_USAGE
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone grace-seconds remote-dir checkpoint-dir ssh-flags num-slices"
BOOL_FLAGS=""
tpu_parse "$@"

check_common
remote_layout
check_slices
TPU_GRACE_SECONDS=${TPU_GRACE_SECONDS:-300}
check TPU_GRACE_SECONDS '^[0-9]+$' 'a number of seconds'

need_gcloud
leave_stop_marker "stopped with tpu/stop.sh"
stop_workers "$TPU_GRACE_SECONDS"
