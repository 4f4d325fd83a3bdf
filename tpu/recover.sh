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
Each step runs in the background; beside it, every --watch-seconds: the stop marker (a
stop.sh while the queued resource still waits is honoured), and during the run the slice's
describe (a vanished VM is noticed in about a minute) and the trainers' heartbeat
(CHECKPOINT_DIR.heartbeat/HOST, scripts/heartbeat.py): when no host's step moves for
--hang-timeout, the job is stopped and restarted in place, logged with the host that stopped
progressing first. Started while trainers run on a ready slice (this machine rebooted), it
attaches to them: no install under a live trainer, no restart of a healthy job.
When the run ends with success, so does this script (exit 0). Otherwise:
  1. the stop marker CHECKPOINT_DIR.recover-stop, left by tpu/stop.sh and tpu/delete.sh (from
     any machine), ends the loop: exit 0, nothing restarted; a new loop (a systemd restart)
     finds it and ends too, until started with --clear-stop;
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
doubled after each failure up to --max-retry-seconds, without limit (unless --create-tries);
a slice left dead by a failed create is deleted first. With --zones, a zone that has not
given a slice for --zone-seconds is left for the next (same region first; the checkpoints
stay where they are). Only the scripts' own parameter and set-up errors (exit status 2) are
not retried; a command's failure is (uv and gcloud exit 2 on a network error too). When the
loop gives up, --on-give-up runs (TPU_GIVE_UP_REASON and TPU_GIVE_UP_STATUS set). A
preempted trainer saves at the preemption notice (scripts/train.py), so a restart loses no
step that was saved.

Options: all those of create.sh, install.sh and run.sh (see their --help), and
  --max-restarts N         TPU_MAX_RESTARTS         failures in a row without a new checkpoint
                                                    before giving up (default: 10)
  --retry-seconds N        TPU_RETRY_SECONDS        first wait after a failed create or
                                                    install (default: 60)
  --max-retry-seconds N    TPU_MAX_RETRY_SECONDS    longest such wait (default: 1800)
  --create-tries N         TPU_CREATE_TRIES         failed creates or installs in a row before
                                                    giving up (default: 0, no limit)
  --watch-seconds N        TPU_WATCH_SECONDS        between two checks beside a step (default: 60)
  --hang-timeout N|auto    TPU_HANG_TIMEOUT         no step progress for this long: a hang
                                                    (default auto: twice the measured time
                                                    between checkpoints, at least 600; 3600
                                                    before the first heartbeat)
  --zones a,b,c            TPU_ZONES                zones to fail over to (the first is --zone
                                                    unless given)
  --zone-seconds N         TPU_ZONE_SECONDS         how long one zone may fail to give a slice
                                                    before the next is tried (default: 3600)
  --on-give-up 'COMMAND'   TPU_ON_GIVE_UP           run by bash when the loop gives up (e.g. a
                                                    notification)
  --clear-stop                                      remove a stop marker and start (flag only)
  --new-code                                        ship HEAD and pin it (tpu/install.sh)
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
create-tries maintenance-seconds create-flags ssh-flags num-slices lock-uri env code-uri \
hang-timeout watch-seconds zones zone-seconds on-give-up log-max-bytes connect-timeout"
BOOL_FLAGS="queued autocheckpoint new-code clear-stop"
unset TPU_CLEAR_STOP # a flag only: an env file that always clears the stop marker would defeat it
tpu_parse "$@"

# --zones a,b,c: the first is the zone unless --zone says another.
check TPU_ZONES '^[a-z0-9-]+(,[a-z0-9-]+)*$' 'a comma-separated list of zones'
[[ -z ${TPU_ZONE:-} && -n ${TPU_ZONES:-} ]] && TPU_ZONE=${TPU_ZONES%%,*}
check_common
require TPU_CHECKPOINT_DIR
remote_layout
bool TPU_QUEUED
bool TPU_CLEAR_STOP
check_slices
TPU_MAX_RESTARTS=${TPU_MAX_RESTARTS:-10}
TPU_RETRY_SECONDS=${TPU_RETRY_SECONDS:-60}
TPU_MAX_RETRY_SECONDS=${TPU_MAX_RETRY_SECONDS:-1800}
TPU_CREATE_TRIES=${TPU_CREATE_TRIES:-0}
TPU_MAINTENANCE_SECONDS=${TPU_MAINTENANCE_SECONDS:-3600}
TPU_POLL_SECONDS=${TPU_POLL_SECONDS:-30}
TPU_GRACE_SECONDS=${TPU_GRACE_SECONDS:-300}
TPU_WATCH_SECONDS=${TPU_WATCH_SECONDS:-60}
TPU_HANG_TIMEOUT=${TPU_HANG_TIMEOUT:-auto}
TPU_ZONE_SECONDS=${TPU_ZONE_SECONDS:-3600}
check TPU_MAX_RESTARTS '^[0-9]+$' 'a number of restarts'
check TPU_CREATE_TRIES '^[0-9]+$' 'a number of tries (0: no limit)'
for var in TPU_RETRY_SECONDS TPU_MAX_RETRY_SECONDS TPU_MAINTENANCE_SECONDS TPU_GRACE_SECONDS \
  TPU_WATCH_SECONDS TPU_ZONE_SECONDS; do
  check "$var" '^[0-9]+$' 'a number of seconds'
done
check TPU_POLL_SECONDS '^[0-9]+([.][0-9]+)?$' 'a number of seconds'
check TPU_HANG_TIMEOUT '^(auto|[0-9]+)$' 'a number of seconds or auto'

# Zone failover: the zones of --zones, those of the zone's region first (the data and the
# checkpoints stay in the same bucket; the same region keeps them close).
ZONE_ORDER=$TPU_ZONE
if [[ -n ${TPU_ZONES:-} ]]; then
  region=${TPU_ZONE%-*}
  for zone in ${TPU_ZONES//,/ }; do
    [[ $zone =~ ^[a-z]+(-[a-z]+)+[0-9]+-[a-z][a-z0-9]*$ ]] || die "--zones (TPU_ZONES): '$zone' is not a valid zone (e.g. us-west4-a)"
    [[ $zone == "$TPU_ZONE" || ${zone%-*} != "$region" ]] || ZONE_ORDER+=" $zone"
  done
  for zone in ${TPU_ZONES//,/ }; do
    [[ $zone == "$TPU_ZONE" || ${zone%-*} == "$region" ]] || ZONE_ORDER+=" $zone"
  done
fi

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

# give_up STATUS MESSAGE: the end of the loop without success: one line, then --on-give-up.
give_up() {
  note "error: $2"
  if [[ -n ${TPU_ON_GIVE_UP:-} ]]; then
    note "running --on-give-up (TPU_ON_GIVE_UP)"
    TPU_GIVE_UP_REASON=$2 TPU_GIVE_UP_STATUS=$1 bash -c "$TPU_ON_GIVE_UP" ||
      warn "--on-give-up failed (exit status $?)"
  fi
  exit "$1"
}

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

# --- steps in the background, watched ------------------------------------------------------
#
# A long step (create --wait, install, the foreground run) runs in the background, in a process
# group of its own so that ending it ends the gcloud and ssh it started; beside it, every
# --watch-seconds: the stop marker, and for the run the slice's state (a vanished VM is seen
# in about a minute, not when ssh gives up) and the trainers' heartbeat.
STEP_PID=""
start_step() {
  set -m # the step's own process group (job control on for this fork only)
  "$@" </dev/null &
  STEP_PID=$!
  set +m
}

# nap: a tenth of a second; bash 4 waits on a pipe nobody writes to (no process per nap).
if ((BASH_VERSINFO[0] >= 4)); then
  exec 7<> <(:)
  nap() { read -r -t 0.1 -u 7 _ || true; }
else
  nap() { sleep 0.1; }
fi
end_step() {
  kill -TERM -- "-$STEP_PID" 2>/dev/null || true
  wait "$STEP_PID" 2>/dev/null || true
  STEP_PID=""
}
trap '[[ -z $STEP_PID ]] || end_step' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# The watchdog's memory, per attempt: "HOST STEP SEEN" lines, SEEN being when (this script's
# clock, $SECONDS, so the workers' clocks do not matter) the host's heartbeat first showed that step.
BEATS="" ATTEMPT_START=0 HANG_NOTE=""

# hung: no host's step moved for the hang timeout (--hang-timeout; auto: twice the measured
# time between two checkpoints, at least 10 minutes, and an hour before the first heartbeat).
hung() {
  local now listing line word host step save seen prev beats="" latest=$ATTEMPT_START
  local save_max=0 timeout first="" first_seen="" first_step="" straggler=""
  [[ $TPU_CHECKPOINT_DIR == gs://* ]] || return 1
  now=$SECONDS
  QUIET=1 query listing gcloud storage cat "${TPU_CHECKPOINT_DIR%/}.heartbeat/*" 2>/dev/null ||
    listing=""
  while IFS= read -r line; do
    host="" step="" save=0
    for word in $line; do
      case $word in
        host=*) host=${word#host=} ;;
        step=*) step=${word#step=} ;;
        save_seconds=*) save=${word#save_seconds=} ;;
        slowest_process=*) straggler=${word#slowest_process=} ;;
      esac
    done
    [[ -n $host && $step =~ ^[0-9]+$ && $save =~ ^[0-9]+$ ]] || continue
    prev=$(printf '%s' "$BEATS" | while read -r h s t; do [[ $h != "$host" ]] || echo "$s $t"; done)
    seen=$now
    [[ $prev == "$step "* ]] && seen=${prev#* }
    beats+="$host $step $seen"$'\n'
    ((seen > latest)) && latest=$seen
    ((save > save_max)) && save_max=$save
    if [[ -z $first ]] || ((seen < first_seen || (seen == first_seen && step < first_step))); then
      first=$host first_seen=$seen first_step=$step
    fi
  done <<<"$listing"
  BEATS=$beats
  if [[ $TPU_HANG_TIMEOUT != auto ]]; then
    timeout=$TPU_HANG_TIMEOUT
  elif ((save_max > 0)); then
    timeout=$((2 * save_max > 600 ? 2 * save_max : 600))
  else
    timeout=3600
  fi
  ((now - latest >= timeout)) || return 1
  if [[ -n $first ]]; then
    HANG_NOTE="no step progress for $((now - latest))s (--hang-timeout $timeout): $first stopped progressing first, at step $first_step"
    [[ $straggler =~ ^[0-9]+$ ]] && HANG_NOTE+=" (the feed's straggler: process $straggler)"
  else
    HANG_NOTE="no heartbeat for $((now - latest))s (--hang-timeout $timeout)"
  fi
  return 0
}

# watch_step KIND: wait for the step started by start_step, watching beside it. STATUS: its
# exit status; WHY: what ended it early (stop, zone, slice, hang), "" when it ended by itself.
watch_step() {
  local kind=$1 now next
  WHY="" STATUS=0
  next=$((SECONDS + TPU_WATCH_SECONDS))
  ATTEMPT_START=$SECONDS BEATS=""
  while kill -0 "$STEP_PID" 2>/dev/null; do
    nap
    now=$SECONDS
    ((now >= next)) || continue
    next=$((now + TPU_WATCH_SECONDS))
    if QUIET=1 marker_present; then
      WHY=stop
    elif [[ $kind == bring-up ]] && [[ $ZONE_ORDER == *" "* ]] && ((now - ZONE_SINCE >= TPU_ZONE_SECONDS)); then
      WHY=zone
    elif [[ $kind == run ]]; then
      QUIET=1 slice_condition
      if [[ $CONDITION == dead ]]; then
        WHY=slice
      elif hung; then
        WHY=hang
      fi
    fi
    [[ -z $WHY ]] || break
  done
  if [[ -n $WHY ]]; then
    end_step
    STATUS=1
  else
    wait "$STEP_PID" || STATUS=$?
    STEP_PID=""
  fi
}

# --- zones ----------------------------------------------------------------------------------

ZONE_SINCE=$SECONDS

# A stockout longer than --zone-seconds: give up the zone's request and move to the next zone.
next_zone() {
  local zone pick="" seen=0
  for zone in $ZONE_ORDER $ZONE_ORDER; do
    ((seen)) && { pick=$zone; break; }
    [[ $zone == "$TPU_ZONE" ]] && seen=1
  done
  note "no $TPU_NAME in $TPU_ZONE for $((SECONDS - ZONE_SINCE))s (--zone-seconds $TPU_ZONE_SECONDS): moving to $pick; the checkpoints stay in $TPU_CHECKPOINT_DIR"
  delete_slice || true # the request still queued in the old zone
  TPU_ZONE=$pick
  export TPU_ZONE
  ZONE_SINCE=$SECONDS
}

# --- bring-up -------------------------------------------------------------------------------

create_and_install() {
  "$here/create.sh" --wait ${dry[@]+"${dry[@]}"} && "$here/install.sh" ${dry[@]+"${dry[@]}"}
}

# Create (unless it exists) and install, retried with backoff (without limit unless
# --create-tries); a parameter or set-up error (exit status 2) ends the loop.
KNOWN_STATE="" HAVE_STATE=0
bring_up() {
  local tries=0 pause=$TPU_RETRY_SECONDS state limit=""
  ((TPU_CREATE_TRIES > 0)) && limit=" of $TPU_CREATE_TRIES"
  while :; do
    # A slice left dead (a preempted one, a queued resource that FAILED) is deleted first.
    if ((HAVE_STATE)); then
      state=$KNOWN_STATE HAVE_STATE=0
    else
      tpu_state state
    fi
    if [[ -n $state && $state =~ $DEAD_STATES ]]; then
      note "$TPU_NAME is $state: deleting it before creating it again"
      delete_slice || true
    fi
    if ((DRY_RUN)); then
      create_and_install
      return 0
    fi
    start_step create_and_install
    watch_step bring-up
    [[ $WHY == stop ]] && finish_if_stopped
    if [[ $WHY == zone ]]; then
      next_zone
      pause=$TPU_RETRY_SECONDS
      continue
    fi
    ((STATUS == 0)) && return 0
    ((STATUS == 2)) && give_up 2 "creating or installing $TPU_NAME failed with a parameter or set-up error (above); not retrying"
    finish_if_stopped
    tries=$((tries + 1))
    if ((TPU_CREATE_TRIES > 0 && tries >= TPU_CREATE_TRIES)); then
      give_up 1 "creating or installing $TPU_NAME failed $tries times in a row (--create-tries $TPU_CREATE_TRIES)"
    fi
    if [[ $ZONE_ORDER == *" "* ]] && ((SECONDS - ZONE_SINCE >= TPU_ZONE_SECONDS)); then
      next_zone
      pause=$TPU_RETRY_SECONDS
      continue
    fi
    note "creating or installing $TPU_NAME failed (exit status $STATUS; try $tries$limit): next try in ${pause}s"
    sleep "$pause"
    pause=$((pause * 2 > TPU_MAX_RETRY_SECONDS ? TPU_MAX_RETRY_SECONDS : pause * 2))
    finish_if_stopped
  done
}

# --- the loop -------------------------------------------------------------------------------

((DRY_RUN)) || validate
if marker_present; then
  if ((!TPU_CLEAR_STOP)); then
    # A systemd restart after tpu/delete.sh must not re-create the slice.
    note "the stop marker $MARKER is there ($(QUIET=1 query m gcloud storage cat "$MARKER" 2>/dev/null; printf '%s' "${m:-tpu/stop.sh or tpu/delete.sh}")): ending, nothing started; --clear-stop starts the run again"
    exit 0
  fi
  note "--clear-stop: removing the stop marker $MARKER"
  if [[ $MARKER == gs://* ]]; then
    run gcloud storage rm "$MARKER"
  else
    run rm -f "$MARKER"
  fi
fi
latest_step
best=$STEP
((DRY_RUN)) || note "latest checkpoint in $TPU_CHECKPOINT_DIR: $(step_name "$best")"

# Restarted mid-run (the machine running this loop rebooted): trainers that run on a ready
# slice are attached to, not installed under nor restarted.
restarts=0 in_a_row=0 hangs=0 fresh=1 attach=()
tpu_state KNOWN_STATE
HAVE_STATE=1
if [[ $KNOWN_STATE == READY || $KNOWN_STATE == ACTIVE ]] && ((!DRY_RUN)); then
  slice_condition
  if [[ $CONDITION == ready ]] && tpu_ssh "$(worker_cmd status)" all; then
    note "trainers run on every worker of $TPU_NAME: attaching to them (no install, no restart)"
    fresh=0 attach=(--attach)
  fi
fi
while :; do
  ((fresh)) && bring_up
  run_cmd=("$here/run.sh" --foreground ${attach[@]+"${attach[@]}"} ${envs[@]+"${envs[@]}"}
    ${dry[@]+"${dry[@]}"} -- --resume ${TRAINER_ARGS[@]+"${TRAINER_ARGS[@]}"})
  attach=()
  if ((DRY_RUN)); then
    "${run_cmd[@]}"
    exit 0
  fi
  start_step "${run_cmd[@]}"
  watch_step run
  status=$STATUS
  if [[ $WHY == stop ]]; then
    note "the stop marker $MARKER is there: stopping the trainers, ending"
    stop_workers "$TPU_GRACE_SECONDS" || true
    exit 0
  fi
  if ((status == 0)); then
    note "training finished on $TPU_NAME after $restarts restart(s)"
    exit 0
  fi
  case $WHY in
    slice) note "$TPU_NAME is $SEEN while the run's ssh still waits: ending the ssh" ;;
    hang)
      hangs=$((hangs + 1))
      note "hung (hang $hangs): $HANG_NOTE: stopping the job"
      ;;
  esac
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
    give_up 1 "the run failed (exit status $status) $in_a_row times in a row without a new checkpoint (--max-restarts $TPU_MAX_RESTARTS); giving up after $restarts restart(s)"
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
