#!/usr/bin/env bash
# Train to the end on a spot slice, unattended: create, install, run in the foreground, and after
# each failure re-create the slice (or restart on it) and resume from the last checkpoint.
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
When the run ends with success, so does this script (exit 0). Otherwise:
  1. the stop marker CHECKPOINT_DIR.recover-stop, left by tpu/stop.sh and tpu/delete.sh (from
     any machine), ends the loop: exit 0, nothing restarted;
  2. the checkpoint directory is listed: a run that saved a newer step made progress; only
     failures in a row without progress count, and more than --max-restarts of them end the
     loop with exit 1;
  3. the slice's state and health are read (describe, every node):
       READY and HEALTHY                 tpu/worker.sh stop (frees the TPU), run again in place
                                         (run.sh re-mounts gcsfuse, which a reboot loses)
       under maintenance or repair       (health UNHEALTHY_MAINTENANCE or TIMEOUT, state
                                         REPAIRING, RESTARTING, ...) poll every POLL seconds,
                                         for up to --maintenance-seconds; then as below
       PREEMPTED, SUSPENDED, FAILED, gone, ...
                                         delete it, then create, install and run again
A failed create or install (a stockout, a network error) is retried after --retry-seconds,
doubled after each failure up to --max-retry-seconds, at most --create-tries times in a row;
a slice left dead by a failed create is deleted first. Parameter errors (exit status 2 of a
step) are not retried. A preempted trainer saves at the preemption notice (scripts/train.py),
so a restart loses no step that was saved.

Options: all those of create.sh, install.sh and run.sh (see their --help), and
  --max-restarts N         TPU_MAX_RESTARTS         failures in a row without a new checkpoint
                                                    before giving up (default: 10)
  --retry-seconds N        TPU_RETRY_SECONDS        first wait after a failed create or
                                                    install (default: 60)
  --max-retry-seconds N    TPU_MAX_RETRY_SECONDS    longest such wait (default: 1800)
  --create-tries N         TPU_CREATE_TRIES         failed creates or installs in a row before
                                                    giving up (default: 50)
  --maintenance-seconds N  TPU_MAINTENANCE_SECONDS  how long to wait for a slice under
                                                    maintenance before re-creating it (default: 3600)
  --poll-seconds N         TPU_POLL_SECONDS         between two describes while waiting (default: 30)
  --grace-seconds N        TPU_GRACE_SECONDS        for the stop before a restart in place (default: 300)
  --create-flags 'FLAGS'   TPU_CREATE_FLAGS         extra gcloud create flags (e.g. --network=net)
  --ssh-flags 'FLAGS'      TPU_SSH_FLAGS            extra gcloud ssh/scp flags (e.g. --internal-ip)
  --checkpoint-dir DIR     TPU_CHECKPOINT_DIR       where progress and the stop marker are read [required]
  --env-file FILE          TPU_ENV_FILE             KEY=VALUE file (see tpu/example.env)
  --name, --project, --zone                         as everywhere                        [required]
  --dry-run                print the commands of the first attempt instead of running them
  -h, --help               this help
Words after `--` are passed to scripts/train.py.
EOF_USAGE
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone accelerator-type runtime-version capacity poll-seconds repo ref \
source remote-dir python jax-version gcsfuse-bucket mount-point config data checkpoint-dir \
log-dir log-uri sync-seconds grace-seconds max-restarts retry-seconds max-retry-seconds \
create-tries maintenance-seconds create-flags ssh-flags num-slices lock-uri env"
BOOL_FLAGS="queued autocheckpoint"
tpu_parse "$@"

check_common
require TPU_CHECKPOINT_DIR
remote_layout
bool TPU_QUEUED
check_slices
TPU_MAX_RESTARTS=${TPU_MAX_RESTARTS:-10}
TPU_RETRY_SECONDS=${TPU_RETRY_SECONDS:-60}
TPU_MAX_RETRY_SECONDS=${TPU_MAX_RETRY_SECONDS:-1800}
TPU_CREATE_TRIES=${TPU_CREATE_TRIES:-50}
TPU_MAINTENANCE_SECONDS=${TPU_MAINTENANCE_SECONDS:-3600}
TPU_POLL_SECONDS=${TPU_POLL_SECONDS:-30}
TPU_GRACE_SECONDS=${TPU_GRACE_SECONDS:-300}
check TPU_MAX_RESTARTS '^[0-9]+$' 'a number of restarts'
check TPU_CREATE_TRIES '^[1-9][0-9]*$' 'a number of tries (at least 1)'
for var in TPU_RETRY_SECONDS TPU_MAX_RETRY_SECONDS TPU_MAINTENANCE_SECONDS TPU_GRACE_SECONDS; do
  check "$var" '^[0-9]+$' 'a number of seconds'
done
check TPU_POLL_SECONDS '^[0-9]+([.][0-9]+)?$' 'a number of seconds'

# The words after -- are the trainer's, never gcloud's.
TRAINER_ARGS=(${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"})
EXTRA_ARGS=()
# Every restart repeats them: a skip must name its step, or each restart skips again.
case " ${TRAINER_ARGS[*]-} " in
  *" --skip-at"[\ =]*) ;;
  *" --skip-data"[\ =]*) die "--skip-data without --skip-at: every restart would skip again; add --skip-at STEP (docs/steering.md)" ;;
esac

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
MARKER=$(stop_marker)

# Each step's own checks, before anything is created: a bad parameter is exit 2 now, not after
# an hour in a queue.
validate() {
  local script errors
  for script in create install run; do
    if ! errors=$("$here/$script.sh" --dry-run 2>&1 >/dev/null); then
      printf '%s\n' "$errors" | grep '^error:' >&2 || printf '%s\n' "$errors" >&2
      exit 2
    fi
  done
}

# storage_ls VAR URI: `gcloud storage ls URI` into VAR (status 1 when nothing matches: that
# error is expected here and not shown; any other is).
storage_ls() {
  query "$1" gcloud storage ls "$2" 2> >(grep -v 'matched no objects' >&2)
}

marker_present() {
  # shellcheck disable=SC2034  # storage_ls sets it; only its status matters
  local found
  if [[ $MARKER == gs://* ]]; then
    storage_ls found "$MARKER"
  else
    [[ -e $MARKER ]]
  fi
}

finish_if_stopped() {
  if marker_present; then
    note "the stop marker $MARKER is there (tpu/stop.sh or tpu/delete.sh): ending, nothing restarted"
    exit 0
  fi
}

# STEP: the highest step directory in the checkpoint directory, -1 if none.
latest_step() {
  local listing="" line name
  STEP=-1
  if [[ $TPU_CHECKPOINT_DIR == gs://* ]]; then
    storage_ls listing "${TPU_CHECKPOINT_DIR%/}/" || true
  else
    listing=$(ls -1 "$TPU_CHECKPOINT_DIR" 2>/dev/null || true)
  fi
  while IFS= read -r line; do
    name=${line%/}
    name=${name##*/}
    if [[ $name =~ ^[0-9]+$ ]] && ((10#$name > STEP)); then
      STEP=$((10#$name))
    fi
  done <<<"$listing"
}

step_name() { if (($1 < 0)); then printf 'none'; else printf 'step %s' "$1"; fi; }

# CONDITION (ready, wait or dead) and SEEN (what describe said) of the slice: of its worst
# node when there are several slices.
slice_condition() {
  local qr described state health node condition
  if ((TPU_QUEUED)); then
    tpu_state qr
    if [[ $qr != ACTIVE ]]; then
      CONDITION=dead SEEN="queued resource ${qr:-gone}"
      return 0
    fi
  fi
  CONDITION=ready SEEN=""
  for node in $(nodes); do
    query described gcloud compute tpus tpu-vm describe "$node" --zone="$TPU_ZONE" \
      --project="$TPU_PROJECT" '--format=value(state,health)' || described=""
    state="" health=""
    read -r state health <<<"$described" || true
    case $state in
      READY)
        case ${health:-HEALTHY} in
          HEALTHY | HEALTH_UNSPECIFIED) condition=ready ;;
          *) condition="wait" ;; # UNHEALTHY_MAINTENANCE, TIMEOUT, ...
        esac
        ;;
      CREATING | STARTING | RESTARTING | REIMAGING | REPAIRING | UNHIDING) condition="wait" ;;
      *) condition=dead ;;
    esac
    if [[ $condition == dead || ($condition == wait && $CONDITION == ready) || -z $SEEN ]]; then
      SEEN="${state:-gone}${health:+ ($health)}"
      ((TPU_NUM_SLICES > 1)) && SEEN="$SEEN ($node)"
    fi
    [[ $condition == dead || ($condition == wait && $CONDITION == ready) ]] && CONDITION=$condition
    [[ $CONDITION == dead ]] && return 0
  done
  return 0
}

# slice_condition, polled while the slice is under maintenance (at most --maintenance-seconds).
await_slice() {
  local waited=0
  while :; do
    slice_condition
    [[ $CONDITION == wait ]] || return 0
    finish_if_stopped
    if ((waited >= TPU_MAINTENANCE_SECONDS)); then
      note "$TPU_NAME is still $SEEN after ${waited}s (--maintenance-seconds): re-create it"
      CONDITION=dead
      return 0
    fi
    note "$TPU_NAME is $SEEN: maintenance or repair, waiting (next check in ${TPU_POLL_SECONDS}s)"
    sleep "$TPU_POLL_SECONDS"
    waited=$((waited + ${TPU_POLL_SECONDS%.*} + 1))
  done
}

# Create (unless it exists) and install, retried with backoff; exit when the tries are spent.
bring_up() {
  local tries=0 pause=$TPU_RETRY_SECONDS status state
  while :; do
    # A slice left dead (a preempted one, a queued resource that FAILED) is deleted first.
    tpu_state state
    if [[ -n $state && $state =~ $DEAD_STATES ]]; then
      note "$TPU_NAME is $state: deleting it before creating it again"
      delete_slice || true
    fi
    status=0
    { "$here/create.sh" --wait ${dry[@]+"${dry[@]}"} && "$here/install.sh" ${dry[@]+"${dry[@]}"}; } ||
      status=$?
    ((status == 0)) && return 0
    if ((status == 2)); then
      note "error: creating or installing $TPU_NAME failed with a parameter or set-up error (above); not retrying"
      exit 2
    fi
    tries=$((tries + 1))
    if ((tries >= TPU_CREATE_TRIES)); then
      note "error: creating or installing $TPU_NAME failed $tries times in a row (--create-tries $TPU_CREATE_TRIES)"
      exit 1
    fi
    note "creating or installing $TPU_NAME failed (exit status $status; try $tries of $TPU_CREATE_TRIES): next try in ${pause}s"
    sleep "$pause"
    pause=$((pause * 2 > TPU_MAX_RETRY_SECONDS ? TPU_MAX_RETRY_SECONDS : pause * 2))
    finish_if_stopped
  done
}

((DRY_RUN)) || validate
if marker_present; then
  note "removing the stop marker $MARKER of an earlier tpu/stop.sh or tpu/delete.sh"
  if [[ $MARKER == gs://* ]]; then
    run gcloud storage rm "$MARKER"
  else
    run rm -f "$MARKER"
  fi
fi
latest_step
best=$STEP
((DRY_RUN)) || note "latest checkpoint in $TPU_CHECKPOINT_DIR: $(step_name "$best")"

restarts=0 in_a_row=0 fresh=1
while :; do
  ((fresh)) && bring_up
  status=0
  "$here/run.sh" --foreground ${envs[@]+"${envs[@]}"} ${dry[@]+"${dry[@]}"} \
    -- --resume ${TRAINER_ARGS[@]+"${TRAINER_ARGS[@]}"} || status=$?
  ((DRY_RUN)) && exit 0
  if ((status == 0)); then
    note "training finished on $TPU_NAME after $restarts restart(s)"
    exit 0
  fi
  finish_if_stopped
  latest_step
  if ((STEP > best)); then
    progress="progress: checkpoint $(step_name "$best") -> step $STEP"
    best=$STEP in_a_row=0
  else
    in_a_row=$((in_a_row + 1))
    progress="no new checkpoint ($(step_name "$best")): $in_a_row failure(s) in a row without progress, of --max-restarts $TPU_MAX_RESTARTS"
  fi
  if ((in_a_row > TPU_MAX_RESTARTS)); then
    note "error: the run failed (exit status $status) $in_a_row times in a row without a new checkpoint (--max-restarts $TPU_MAX_RESTARTS); giving up after $restarts restart(s)"
    exit 1
  fi
  restarts=$((restarts + 1))
  await_slice
  if [[ $CONDITION == ready ]]; then
    note "the run failed on a ready slice (exit status $status; $progress): stop, then resume in place (restart $restarts)"
    stop_workers "$TPU_GRACE_SECONDS" || true
    fresh=0
  else
    note "$TPU_NAME is $SEEN (the run's exit status $status; $progress): re-create it, install, resume (restart $restarts)"
    [[ $SEEN == gone || $SEEN == "queued resource gone" ]] || delete_slice || true
    fresh=1
  fi
done
