#!/usr/bin/env bash
# Train to the end on a slice that may be preempted: create, install, run in the foreground,
# and after a failure re-create (or restart) and resume from the last checkpoint, N times at most.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'EOF_USAGE'
Usage: tpu/recover.sh [--env-file FILE] [options] [--max-restarts N] [--dry-run] [-- TRAINER_ARGS...]

Run the other scripts in a loop, with the same parameters (each accepts every key):
  tpu/create.sh --wait           create the slice unless it exists, wait until READY / ACTIVE
  tpu/install.sh                 put the project on the workers (after each (re-)creation)
  tpu/run.sh --foreground -- --resume TRAINER_ARGS...
                                 train until the trainers exit; --resume starts from the
                                 latest checkpoint in --checkpoint-dir (from step 0 if none)
When the run ends with success, so does this script. Otherwise the slice's state is read:
  PREEMPTED, SUSPENDED, FAILED, gone, ...  tpu/delete.sh, then create, install, run again
  READY / ACTIVE (the trainer failed)      tpu/stop.sh (frees the TPU), then run again
at most --max-restarts times; then it gives up with exit status 1. A preempted trainer saves
at the preemption notice (scripts/train.py), so a restart loses no step that was saved.

Options: all those of create.sh, install.sh and run.sh (see their --help), and
  --max-restarts N      TPU_MAX_RESTARTS    restarts before giving up (default: 3)
  --poll-seconds N      TPU_POLL_SECONDS    between two describes while waiting (default: 30)
  --env-file FILE       TPU_ENV_FILE        KEY=VALUE file (see tpu/example.env)
  --name, --project, --zone                 as everywhere                        [required]
  --dry-run             print the commands of the first attempt instead of running them
  -h, --help            this help
Words after `--` are passed to scripts/train.py.
EOF_USAGE
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone accelerator-type runtime-version capacity poll-seconds repo ref \
source remote-dir python jax-version gcsfuse-bucket mount-point config data checkpoint-dir \
log-dir log-uri sync-seconds grace-seconds max-restarts env"
BOOL_FLAGS="queued"
tpu_parse "$@"

check_common
bool TPU_QUEUED
TPU_MAX_RESTARTS=${TPU_MAX_RESTARTS:-3}
check TPU_MAX_RESTARTS '^[0-9]+$' 'a number of restarts'

# The children read the parameters from the environment; the env file is already applied
# (re-reading it would let it override this script's flags).
for var in $TPU_KNOWN_KEYS; do
  if [[ -n ${!var:-} ]]; then
    export "${var?}"
  fi
done
unset TPU_ENV_FILE
here=$(dirname "${BASH_SOURCE[0]}")
dry=()
((DRY_RUN)) && dry=(--dry-run)
envs=()
for kv in ${REMOTE_ENV[@]+"${REMOTE_ENV[@]}"}; do
  envs+=(--env "$kv")
done
ready=READY
((TPU_QUEUED)) && ready=ACTIVE

restarts=0
fresh=1
while :; do
  if ((fresh)); then
    "$here/create.sh" --wait ${dry[@]+"${dry[@]}"}
    "$here/install.sh" ${dry[@]+"${dry[@]}"}
  fi
  status=0
  "$here/run.sh" --foreground ${envs[@]+"${envs[@]}"} ${dry[@]+"${dry[@]}"} \
    -- --resume ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} || status=$?
  ((DRY_RUN)) && exit 0
  if ((status == 0)); then
    note "training finished on $TPU_NAME after $restarts restart(s)"
    exit 0
  fi
  tpu_state state
  if ((restarts >= TPU_MAX_RESTARTS)); then
    note "error: the run failed (exit status $status, $TPU_NAME ${state:-gone}) and $restarts restart(s) are spent (--max-restarts $TPU_MAX_RESTARTS)"
    exit 1
  fi
  restarts=$((restarts + 1))
  if [[ $state == "$ready" ]]; then
    note "the run failed on a $ready slice (exit status $status): stop, then resume (restart $restarts of $TPU_MAX_RESTARTS)"
    "$here/stop.sh" || true
    fresh=0
  else
    note "$TPU_NAME is ${state:-gone}: re-create it, install, resume (restart $restarts of $TPU_MAX_RESTARTS)"
    if [[ -n $state ]]; then
      "$here/delete.sh"
    fi
    fresh=1
  fi
done
