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
Checkpoints and data in Cloud Storage are not touched.

Options (flag / environment or env-file variable):
  --name NAME           TPU_NAME        TPU (or queued resource) name   [required]
  --project PROJECT     TPU_PROJECT     Google Cloud project id          [required]
  --zone ZONE           TPU_ZONE        e.g. us-central2-b               [required]
  --queued              TPU_QUEUED=1    delete the queued resource (created with create.sh --queued)
  --env-file FILE       TPU_ENV_FILE    KEY=VALUE file (see tpu/example.env)
  --dry-run             print the gcloud command instead of running it
  -h, --help            this help
Words after `--` are appended to the gcloud command (e.g. -- --async).
EOF
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone"
BOOL_FLAGS="queued"
tpu_parse "$@"

check_common
bool TPU_QUEUED

need_gcloud
if ((TPU_QUEUED)); then
  run gcloud compute tpus queued-resources delete "$TPU_NAME" \
    --zone="$TPU_ZONE" --project="$TPU_PROJECT" --quiet --force ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
else
  run gcloud compute tpus tpu-vm delete "$TPU_NAME" \
    --zone="$TPU_ZONE" --project="$TPU_PROJECT" --quiet ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
fi
