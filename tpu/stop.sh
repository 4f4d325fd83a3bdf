#!/usr/bin/env bash
# Stop the trainer and free the TPU on every worker.
# shellcheck source-path=SCRIPTDIR
# shellcheck disable=SC2016  # $(hostname), $$ and $! in single quotes are for the workers' shell
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu/stop.sh [--env-file FILE] [options] [--dry-run] [-- EXTRA_GCLOUD_FLAGS...]

Stop scripts/train.py and kill any stray process still holding the TPU, on all workers:
  gcloud compute tpus tpu-vm ssh NAME --zone=ZONE --project=PROJECT --worker=all --command=...
which runs on each worker: SIGTERM to scripts/train.py, up to 10 s for it to exit, then
SIGKILL to whatever still has /dev/accel* or /dev/vfio/* open, and removes
/tmp/libtpu_lockfile. Succeeds when nothing is running.
(A TPU can be opened by one process at a time; a leftover process makes the next run fail
with "TPU in use" or hang at start-up.)

Options (flag / environment or env-file variable):
  --name NAME           TPU_NAME        TPU name                    [required]
  --project PROJECT     TPU_PROJECT     Google Cloud project id     [required]
  --zone ZONE           TPU_ZONE        e.g. us-central2-b          [required]
  --env-file FILE       TPU_ENV_FILE    KEY=VALUE file (see tpu/example.env)
  --dry-run             print the gcloud command instead of running it
  -h, --help            this help
Words after `--` are appended to the gcloud command (e.g. -- --internal-ip).
EOF
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone"
BOOL_FLAGS=""
tpu_parse "$@"

check_common

# '[s]cripts/train.py' matches the trainer but not this command line itself.
remote='sudo pkill -f '\''[s]cripts/train.py'\'' || true; '
remote+='for _ in 1 2 3 4 5 6 7 8 9 10; do pgrep -f '\''[s]cripts/train.py'\'' >/dev/null || break; sleep 1; done; '
remote+='sudo lsof -t /dev/accel* /dev/vfio/* 2>/dev/null | xargs -r sudo kill -9 || true; '
remote+='sudo rm -f /tmp/libtpu_lockfile || true; '
remote+='echo "stopped on $(hostname)"'

need_gcloud
tpu_ssh "$remote" all
