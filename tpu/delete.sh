#!/usr/bin/env bash
# Delete a TPU VM slice, or a queued resource together with its TPU.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu/delete.sh [--env-file FILE] [options] [--dry-run] [-- EXTRA_GCLOUD_FLAGS...]

Delete the slice (no confirmation prompt):
  direct:   gcloud compute tpus tpu-vm delete NAME --zone=ZONE --project=PROJECT --quiet
  --queued: gcloud compute tpus queued-resources delete NAME --zone=ZONE --project=PROJECT
              --quiet --force      (--force also deletes the TPU the queued resource created)
Checkpoints and data in Cloud Storage are not touched. First, with --checkpoint-dir, it leaves
the stop marker CHECKPOINT_DIR.recover-stop, which ends a tpu/recover.sh loop of this run
(wherever it runs) instead of letting it re-create the slice.

Options (flag / environment or env-file variable):
  --name NAME           TPU_NAME        TPU (or queued resource) name   [required]
  --project PROJECT     TPU_PROJECT     Google Cloud project id          [required]
  --zone ZONE           TPU_ZONE        e.g. us-central2-b               [required]
  --queued              TPU_QUEUED=1    delete the queued resource (created with create.sh --queued)
  --checkpoint-dir DIR  TPU_CHECKPOINT_DIR  the run's; the stop marker goes beside it
  --env-file FILE       TPU_ENV_FILE    KEY=VALUE file (see tpu/example.env)
  --dry-run             print the gcloud command instead of running it
  -h, --help            this help
Words after `--` are appended to the gcloud command (e.g. -- --async).
EOF
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone checkpoint-dir"
BOOL_FLAGS="queued"
tpu_parse "$@"

check_common
bool TPU_QUEUED

need_gcloud
leave_stop_marker "deleted with tpu/delete.sh"
delete_slice
