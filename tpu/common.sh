# shellcheck shell=bash
# Shared helpers for the TPU VM launch scripts in tpu/. Sourced, never run directly.
#
# Parameters. Every value flag --foo-bar VALUE (or --foo-bar=VALUE) has an environment
# variable TPU_FOO_BAR, and the same KEY=VALUE can sit in an env file (--env-file FILE, or
# TPU_ENV_FILE=FILE). Precedence: flag > env file > environment. Nothing has a default
# project, zone or name; a missing required parameter is a one-line error, exit status 2.
#
# Commands. Every gcloud (and local) command goes through `run`: with --dry-run it prints
# the command, shell-quoted so it can be pasted, one per line on stdout, and runs nothing;
# otherwise it echoes "+ command" on stderr and runs it. Everything else a script says goes
# to stderr, so the stdout of --dry-run is exactly the list of commands. A read-only query
# whose answer steers the script (`query`, e.g. describe) is printed the same way and answers
# "unknown" in a dry run, so the dry run shows the path a fresh slice takes.
#
# Written for bash >= 3.2 (the macOS /bin/bash): no associative arrays, no mapfile.

set -euo pipefail

# Every key an env file may set (all scripts share one env file, so each accepts all keys).
TPU_KNOWN_KEYS="TPU_NAME TPU_PROJECT TPU_ZONE TPU_ACCELERATOR_TYPE TPU_RUNTIME_VERSION \
TPU_QUEUED TPU_CAPACITY TPU_SOURCE TPU_REPO TPU_REF TPU_REMOTE_DIR TPU_PYTHON TPU_DATA \
TPU_CHECKPOINT_DIR TPU_CONFIG TPU_LOG_DIR TPU_WORKER TPU_WAIT TPU_POLL_SECONDS TPU_JAX_VERSION \
TPU_GCSFUSE_BUCKET TPU_MOUNT_POINT TPU_LOG_URI TPU_SYNC_SECONDS TPU_FOREGROUND TPU_GRACE_SECONDS \
TPU_MAX_RESTARTS TPU_CREATE_FLAGS TPU_SSH_FLAGS TPU_RETRY_SECONDS TPU_MAX_RETRY_SECONDS \
TPU_CREATE_TRIES TPU_MAINTENANCE_SECONDS TPU_AUTOCHECKPOINT TPU_NUM_SLICES TPU_LOCK_URI \
TPU_CODE_URI TPU_NEW_CODE TPU_HANG_TIMEOUT TPU_WATCH_SECONDS TPU_ZONES TPU_ZONE_SECONDS \
TPU_ON_GIVE_UP TPU_LOG_MAX_BYTES TPU_CONNECT_TIMEOUT TPU_GKE_IMAGE TPU_GKE_NAMESPACE \
TPU_GKE_CLUSTER TPU_GKE_TOPOLOGY TPU_GKE_SERVICE_ACCOUNT"

DRY_RUN=0
EXTRA_ARGS=()   # the words after `--`
REMOTE_ENV=()   # run.sh: --env KEY=VALUE, in order
_FLAGS_SET=""

# Filled in by each script before tpu_parse: the value flags and boolean flags it takes.
VALUE_FLAGS="${VALUE_FLAGS:-}"
BOOL_FLAGS="${BOOL_FLAGS:-}"

die() {
  # One line on stderr, exit status 2 (bad usage or bad parameter).
  local msg="$*"
  printf 'error: %s\n' "${msg//$'\n'/ }" >&2
  exit 2
}

warn() { printf 'warning: %s\n' "$*" >&2; }
note() { printf '%s\n' "$*" >&2; }

_in_list() {
  local needle=$1 word
  for word in $2; do
    [[ $word == "$needle" ]] && return 0
  done
  return 1
}

# --accelerator-type <-> TPU_ACCELERATOR_TYPE
flag_to_var() { printf 'TPU_%s' "$(printf '%s' "$1" | tr 'abcdefghijklmnopqrstuvwxyz-' 'ABCDEFGHIJKLMNOPQRSTUVWXYZ_')"; }
var_to_flag() { printf -- '--%s' "$(printf '%s' "${1#TPU_}" | tr 'ABCDEFGHIJKLMNOPQRSTUVWXYZ_' 'abcdefghijklmnopqrstuvwxyz-')"; }

_set_flag() {
  local var
  var=$(flag_to_var "$1")
  printf -v "_FLAG_$var" '%s' "$2"
  _FLAGS_SET="$_FLAGS_SET $var"
}

# Parse the command line, then apply env file and flags (in that order, so flags win).
tpu_parse() {
  local arg name value has_value var tmp
  while (($#)); do
    arg=$1
    shift
    case $arg in
      -h | --help)
        usage
        exit 0
        ;;
      --dry-run) DRY_RUN=1 ;;
      --env-file)
        (($#)) || die "--env-file needs a value (a KEY=VALUE file, see tpu/example.env)"
        TPU_ENV_FILE=$1
        shift
        ;;
      --env-file=*) TPU_ENV_FILE=${arg#*=} ;;
      --)
        EXTRA_ARGS=("$@")
        break
        ;;
      --*)
        name=${arg#--}
        value=""
        has_value=0
        if [[ $name == *=* ]]; then
          value=${name#*=}
          name=${name%%=*}
          has_value=1
        fi
        [[ $name == node-count ]] && name=num-slices # gcloud's name for it
        if [[ $name == env ]] && _in_list env "$VALUE_FLAGS"; then
          if ((!has_value)); then
            (($#)) || die "--env needs a value KEY=VALUE"
            value=$1
            shift
          fi
          [[ $value =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env '$value' is not KEY=VALUE"
          REMOTE_ENV+=("$value")
        elif [[ $name =~ ^(spot|reserved|on-demand)$ ]] && _in_list capacity "$VALUE_FLAGS"; then
          ((has_value)) && die "--$name takes no value"
          _set_flag capacity "$name"
        elif _in_list "$name" "$VALUE_FLAGS"; then
          if ((!has_value)); then
            (($#)) || die "--$name needs a value"
            value=$1
            shift
          fi
          _set_flag "$name" "$value"
        elif _in_list "$name" "$BOOL_FLAGS"; then
          ((has_value)) && die "--$name takes no value"
          _set_flag "$name" 1
        else
          die "unknown option '$arg' (see --help)"
        fi
        ;;
      *) die "unexpected argument '$arg' (see --help; arguments for the command go after --)" ;;
    esac
  done
  if [[ -n ${TPU_ENV_FILE:-} ]]; then
    load_env_file "$TPU_ENV_FILE"
  fi
  for var in $_FLAGS_SET; do
    tmp="_FLAG_$var"
    printf -v "$var" '%s' "${!tmp}"
  done
}

# KEY=VALUE lines; blank lines and lines starting with # are ignored; `export ` is allowed;
# one pair of matching quotes around VALUE is removed; nothing is expanded or executed.
load_env_file() {
  local file=$1 line key value n=0
  [[ -f $file && -r $file ]] || die "--env-file '$file': no such readable file"
  while IFS= read -r line || [[ -n $line ]]; do
    n=$((n + 1))
    line=${line%$'\r'}
    line="${line#"${line%%[![:space:]]*}"}"
    line="${line%"${line##*[![:space:]]}"}"
    [[ -z $line || $line == \#* ]] && continue
    line=${line#export }
    [[ $line == *=* ]] || die "$file:$n: expected KEY=VALUE, got '$line'"
    key=${line%%=*}
    value=${line#*=}
    _in_list "$key" "$TPU_KNOWN_KEYS" || die "$file:$n: unknown key '$key' (known keys: $TPU_KNOWN_KEYS)"
    if ((${#value} >= 2)) && [[ ($value == \"*\" || $value == \'*\') && ${value:0:1} == "${value: -1}" ]]; then
      value=${value:1:${#value}-2}
    fi
    printf -v "$key" '%s' "$value"
  done <"$file"
}

# require VAR...: each must be non-empty.
require() {
  local var
  for var in "$@"; do
    [[ -n ${!var:-} ]] || die "missing $(var_to_flag "$var") (or set $var in the environment or in an --env-file)"
  done
}

# check VAR REGEX WHAT: an optional value, if set, must match.
check() {
  local var=$1 re=$2 what=$3 value
  value=${!var:-}
  [[ -z $value || $value =~ $re ]] || die "$(var_to_flag "$var") ($var) '$value' is not $what"
}

# bool VAR: normalize 1/true/yes/on and 0/false/no/off/empty to 1 or 0.
bool() {
  local var=$1 value
  value=$(printf '%s' "${!var:-}" | tr '[:upper:]' '[:lower:]')
  case $value in
    1 | true | yes | on) printf -v "$var" 1 ;;
    "" | 0 | false | no | off) printf -v "$var" 0 ;;
    *) die "$(var_to_flag "$var") ($var) '${!var}' is not a boolean (use 1 or 0)" ;;
  esac
}

# The parameters most scripts share.
check_common() {
  require TPU_NAME TPU_PROJECT TPU_ZONE
  check TPU_NAME '^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$' \
    'a valid TPU name (lowercase letters, digits and hyphens, starting with a letter)'
  check TPU_PROJECT '^[a-z][-a-z0-9.:]{2,}[a-z0-9]$' 'a valid project id (e.g. my-project)'
  # region-zone, e.g. us-central2-b, europe-west4-a, northamerica-northeast1-c, us-south1-ai1b
  check TPU_ZONE '^[a-z]+(-[a-z]+)+[0-9]+-[a-z][a-z0-9]*$' 'a valid zone (e.g. us-west4-a)'
}

# Shell-quote one word so that a POSIX shell reads it back unchanged.
shquote() {
  local s=$1 q="'\\''"
  if [[ -n $s && $s =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/$q}"
  fi
}

# Quote a whole command line.
quote_cmd() {
  local word sep=""
  for word in "$@"; do
    printf '%s' "$sep"
    shquote "$word"
    sep=" "
  done
}

# Quote a path for a remote shell command: a leading ~/ stays expandable as "$HOME"/.
# shellcheck disable=SC2016,SC2088  # "$HOME" and ~ are meant for the remote shell
remote_path() {
  if [[ $1 == '~' ]]; then
    printf '"$HOME"'
  elif [[ $1 == '~/'* ]]; then
    printf '"$HOME"/%s' "$(shquote "${1#\~/}")"
  else
    shquote "$1"
  fi
}

# Exit status 2 of a script means a parameter or set-up error of its own (die): permanent,
# tpu/recover.sh does not retry it. A command's failure says nothing of the kind (uv exits 2
# when the package index is unreachable once, gcloud on a 503), so `run` and `query` report a
# command's 2 as 1: transient.
transient() { if (($1 == 2)); then return 1; else return "$1"; fi; }

run() {
  if ((DRY_RUN)); then
    quote_cmd "$@"
    printf '\n'
    return 0
  fi
  printf '+ %s\n' "$(quote_cmd "$@")" >&2
  "$@" || transient $?
}

# query VAR CMD...: run a read-only command and put its stdout (trimmed) in VAR; its status
# is the command's. In a dry run it is printed like `run` and answers "" with status 1.
# QUIET=1: not echoed (the polls beside a long step would fill the log).
query() {
  local var=$1 out status=0
  shift
  if ((DRY_RUN)); then
    quote_cmd "$@"
    printf '\n'
    printf -v "$var" '%s' ""
    return 1
  fi
  ((${QUIET:-0})) || printf '+ %s\n' "$(quote_cmd "$@")" >&2
  out=$("$@") || transient $? || status=$?
  out="${out#"${out%%[![:space:]]*}"}"
  printf -v "$var" '%s' "${out%"${out##*[![:space:]]}"}"
  return "$status"
}

# States of a TPU VM or queued resource that never become READY / ACTIVE by themselves.
# shellcheck disable=SC2034  # used by the scripts that source this file
DEAD_STATES='^(PREEMPTED|TERMINATED|STOPPED|STOPPING|FAILED|SUSPENDED|SUSPENDING|DELETING)$'

# tpu_state VAR: the state of the queued resource (TPU_QUEUED=1) or of the TPU VM, "" if
# it does not exist (or in a dry run).
tpu_state() {
  local kind=tpu-vm field=state
  if ((${TPU_QUEUED:-0})); then
    kind=queued-resources
    field=state.state
  fi
  query "$1" gcloud compute tpus "$kind" describe "$TPU_NAME" --zone="$TPU_ZONE" \
    --project="$TPU_PROJECT" --format="value($field)" || printf -v "$1" '%s' ""
}

# gcloud copies to several workers at once (scp --worker=all) only with the TPU ssh key in
# ssh-agent: check it before anything is copied, and say the one-line fix.
need_ssh_agent() {
  ((DRY_RUN)) && return 0
  local key="$HOME/.ssh/google_compute_engine" fingerprint fix
  fix="eval \"\$(ssh-agent -s)\" && ssh-add $key"
  [[ -f $key.pub ]] || die "no TPU ssh key $key yet: create it with 'gcloud compute tpus tpu-vm ssh $TPU_NAME --zone=$TPU_ZONE --project=$TPU_PROJECT --worker=0 --command=true', then run: $fix"
  fingerprint=$(ssh-keygen -lf "$key.pub" | awk '{print $2}')
  ssh-add -l 2>/dev/null | grep -qF "$fingerprint" ||
    die "gcloud copies to all workers only with the TPU ssh key in ssh-agent; run: $fix"
}

need_gcloud() {
  ((DRY_RUN)) && return 0
  command -v gcloud >/dev/null 2>&1 ||
    die "gcloud not found on PATH (install the Google Cloud CLI, or use --dry-run to print the commands)"
}

# worker_cmd SUBCOMMAND ARGS...: the remote command that runs tpu/worker.sh (installed with the
# project) in the project directory.
worker_cmd() {
  printf 'cd %s && tpu/worker.sh %s' "$(remote_path "$TPU_REMOTE_DIR")" "$(quote_cmd "$@")"
}

# words VAR: the words of a flags variable (TPU_SSH_FLAGS, TPU_CREATE_FLAGS) in WORDS, split at
# blanks (no quoting: a value with a space cannot be given this way; use the `--` words).
words() {
  WORDS=()
  [[ -n ${!1:-} ]] && read -r -a WORDS <<<"${!1}"
  return 0
}

# ssh keepalive: without it a vanished VM leaves the ssh session (and recover.sh) waiting for
# hours; with it ssh gives up after 4 unanswered probes 30 s apart (exit 255). The connect
# timeout: gcloud reconnects up to 10 times after an exit 255, and each connect to a vanished
# VM would wait out TCP's own timeout (minutes) without it.
# (TPU_CONNECT_TIMEOUT, default 20 s).
KEEPALIVE=(--ssh-flag=-oServerAliveInterval=30 --ssh-flag=-oServerAliveCountMax=4)

# Multislice: --num-slices N (TPU_NUM_SLICES, gcloud's --node-count) > 1 makes the queued
# resource NAME create the nodes NAME-0 ... NAME-(N-1), one slice each.
check_slices() {
  TPU_NUM_SLICES=${TPU_NUM_SLICES:-1}
  check TPU_NUM_SLICES '^[1-9][0-9]*$' 'a number of slices (1 or more)'
}

# The TPU node of each slice, one per line.
nodes() {
  local i
  if ((${TPU_NUM_SLICES:-1} == 1)); then
    printf '%s\n' "$TPU_NAME"
  else
    for ((i = 0; i < TPU_NUM_SLICES; i++)); do printf '%s-%s\n' "$TPU_NAME" "$i"; done
  fi
}

# tpu_ssh CMD [WORKER]: gcloud compute tpus tpu-vm ssh NODE --zone --project --worker KEEPALIVE
# --command=CMD [TPU_SSH_FLAGS] [extra], for the node of every slice; "{slice}" in CMD is the
# slice's index. Several slices run at once (a foreground run holds every ssh until the end);
# the status is the last failure's.
tpu_ssh() {
  local cmd=$1 worker=${2:-all} node slice=0 status=0 pids=() pid
  check TPU_CONNECT_TIMEOUT '^[1-9][0-9]*$' 'a number of seconds'
  words TPU_SSH_FLAGS
  for node in $(nodes); do
    set -- gcloud compute tpus tpu-vm ssh "$node" --zone="$TPU_ZONE" --project="$TPU_PROJECT" \
      --worker="$worker" "${KEEPALIVE[@]}" "--ssh-flag=-oConnectTimeout=${TPU_CONNECT_TIMEOUT:-20}" --command="${cmd//\{slice\}/$slice}" \
      ${WORDS[@]+"${WORDS[@]}"} ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
    if ((${TPU_NUM_SLICES:-1} > 1 && !DRY_RUN)); then
      run "$@" &
      pids+=($!)
    else
      run "$@" || status=$?
    fi
    slice=$((slice + 1))
  done
  for pid in ${pids[@]+"${pids[@]}"}; do
    wait "$pid" || status=$?
  done
  return "$status"
}

# count_workers VAR NODE: the number of workers (hosts) of a node, from describe; status 1
# when describe fails or says no number (and in a dry run, which cannot know).
count_workers() {
  query "$1" gcloud compute tpus tpu-vm describe "$2" --zone="$TPU_ZONE" --project="$TPU_PROJECT" \
    --format='value(networkEndpoints.len())' || return 1
  [[ ${!1} =~ ^[1-9][0-9]*$ ]]
}

# expand_workers LIST: "0-2,5" -> "0 1 2 5" (gcloud's ssh takes ranges, its scp one worker).
expand_workers() {
  local part out=""
  for part in ${1//,/ }; do
    if [[ $part == *-* ]]; then
      out+=" $(seq -s ' ' "${part%-*}" "${part#*-}")"
    else
      out+=" $part"
    fi
  done
  printf '%s' "${out# }"
}

# tpu_scp ARGS...: gcloud compute tpus tpu-vm scp ARGS --zone --project [TPU_SSH_FLAGS] [extra]
tpu_scp() {
  words TPU_SSH_FLAGS
  run gcloud compute tpus tpu-vm scp "$@" --zone="$TPU_ZONE" --project="$TPU_PROJECT" \
    ${WORDS[@]+"${WORDS[@]}"} ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
}

# The gcsfuse mount of --gcsfuse-bucket, as a remote command to append to another with " && "
# (install.sh, and run.sh: a restarted VM has lost its mount); "" without a bucket.
mount_cmd() {
  [[ -n ${TPU_GCSFUSE_BUCKET:-} ]] || return 0
  local bucket=${TPU_GCSFUSE_BUCKET#gs://}
  bucket=${bucket%/}
  printf 'tpu/worker.sh mount %s %s' "$(shquote "$bucket")" "$(shquote "${TPU_MOUNT_POINT:-/mnt/$bucket}")"
}

check_mount() {
  check TPU_GCSFUSE_BUCKET '^(gs://)?[a-z0-9][-a-z0-9_.]{1,220}[a-z0-9]/?$' 'a bucket name (e.g. my-bucket)'
  check TPU_MOUNT_POINT '^/[A-Za-z0-9_./-]+$' 'an absolute path (e.g. /mnt/data)'
}

# Stop the trainers (worker.sh stop GRACE) and free the TPUs, on every worker.
stop_workers() {
  tpu_ssh "$(worker_cmd stop "$1")" all
}

# Delete the slice: the queued resource with its TPU (--force), or the TPU VM.
delete_slice() {
  if ((${TPU_QUEUED:-0})); then
    run gcloud compute tpus queued-resources delete "$TPU_NAME" \
      --zone="$TPU_ZONE" --project="$TPU_PROJECT" --quiet --force ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
  else
    run gcloud compute tpus tpu-vm delete "$TPU_NAME" \
      --zone="$TPU_ZONE" --project="$TPU_PROJECT" --quiet ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
  fi
}

# The stop marker of a tpu/recover.sh loop: an object (or file) beside the checkpoint directory,
# so that tpu/stop.sh and tpu/delete.sh, from any machine, end the loop that runs elsewhere.
stop_marker() { printf '%s.recover-stop' "${TPU_CHECKPOINT_DIR%/}"; }

# storage_ls VAR URI: `gcloud storage ls URI` into VAR (status 1 when nothing matches: that
# error is expected here and not shown; any other is).
storage_ls() {
  query "$1" gcloud storage ls "$2" 2> >(grep -v 'matched no objects' >&2)
}

# Whether the stop marker of this run is there (a file for a local --checkpoint-dir).
marker_present() {
  # shellcheck disable=SC2034  # storage_ls sets it; only its status matters
  local marker found
  marker=$(stop_marker)
  if [[ $marker == gs://* ]]; then
    storage_ls found "$marker"
  else
    [[ -e $marker ]]
  fi
}

# leave_stop_marker WHO: written before the trainers are stopped or the slice deleted.
leave_stop_marker() {
  if [[ -z ${TPU_CHECKPOINT_DIR:-} ]]; then
    warn "no --checkpoint-dir (TPU_CHECKPOINT_DIR): a tpu/recover.sh of this run cannot be told to stop"
    return 0
  fi
  local marker file
  marker=$(stop_marker)
  file="${TMPDIR:-/tmp}/tpu-recover-stop-$TPU_NAME"
  ((DRY_RUN)) || printf '%s by %s on %s\n' "$1" "$(id -un 2>/dev/null || echo someone)" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$file"
  if [[ $marker == gs://* ]]; then
    run gcloud storage cp "$file" "$marker"
  else
    run cp "$file" "$marker"
  fi
  ((DRY_RUN)) || rm -f "$file"
  note "left the stop marker $marker: a tpu/recover.sh of this run ends instead of restarting"
}

# Remote layout shared by install/run/logs: the project directory (relative to the remote
# home unless absolute) and the log directory (relative to the project directory unless absolute).
# REMOTE_LOG_DIR is the log directory as seen from the remote home, PROJECT_LOG_DIR as seen
# from the project directory.
remote_layout() {
  TPU_REMOTE_DIR=${TPU_REMOTE_DIR:-pipeline}
  TPU_LOG_DIR=${TPU_LOG_DIR:-logs}
  check TPU_REMOTE_DIR '^[~A-Za-z0-9_./+@-]+$' 'a plain path (letters, digits, . _ - / +)'
  check TPU_LOG_DIR '^[~A-Za-z0-9_./+@-]+$' 'a plain path (letters, digits, . _ - / +)'
  # shellcheck disable=SC2034  # REMOTE_LOG_DIR and PROJECT_LOG_DIR are used by the scripts that source this file
  if [[ $TPU_LOG_DIR == /* || $TPU_LOG_DIR == '~'* ]]; then
    REMOTE_LOG_DIR=$TPU_LOG_DIR
    PROJECT_LOG_DIR=$TPU_LOG_DIR
  else
    PROJECT_LOG_DIR=$TPU_LOG_DIR
    REMOTE_LOG_DIR=${TPU_REMOTE_DIR%/}/$TPU_LOG_DIR
  fi
}
