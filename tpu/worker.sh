#!/usr/bin/env bash
# What runs ON each TPU VM worker. The tpu/ scripts call it over `gcloud ... ssh --worker=all`,
# from the project directory that tpu/install.sh filled; one subcommand per job:
#
#   setup --python VERSION --jax VERSION [--lock gs://..]
#                                          uv, a pinned Python in .venv, the project's [tpu]
#                                          and [train] extras and jax[tpu]==VERSION; with
#                                          --lock, exactly the versions recorded there (the
#                                          first install of the run records them)
#   mount BUCKET MOUNT_POINT               gcsfuse read-only mount with MaxText's cache flags
#   preflight                              refuse while a trainer runs, clear stale TPU holders,
#                                          fail unless this worker sees its TPU chips; then arm
#                                          the next start as a new attempt
#   start --log-dir DIR [--log-uri gs://..] [--heartbeat-uri gs://..] [--sync-seconds N]
#         [--max-log-bytes N] [--foreground] -- COMMAND...
#                                          run COMMAND with its output appended to
#                                          DIR/train-HOST.log under an attempt header, the log
#                                          rotated to .1 at N bytes; every N s and at exit the
#                                          lines written since the last copy go to the object
#                                          URI/train-HOST-STAMP.log.NNNNNN (the chunks, in
#                                          order, are the attempt's log), and the trainer's
#                                          heartbeat (PIPELINE_HEARTBEAT) to HEARTBEAT_URI/HOST.
#                                          Idempotent: a start while a
#                                          trainer runs waits for it (returns its status), one
#                                          after the attempt ended returns its status; only a
#                                          preflight in between starts a new trainer
#   status                                 exit 0 when a trainer (or its start wrapper) runs
#                                          here, 3 when none does
#   stop [GRACE_SECONDS]                   SIGTERM to the trainer (it saves at the preemption
#                                          sync point and exits), then SIGKILL after the grace
#
# PIPELINE_TPU_DEVICES (a glob list) overrides where the chips are looked for (tests).
set -euo pipefail

# The trainer's own command line ("python scripts/train.py ..."), never a shell or this
# wrapper whose command line merely mentions it.
TRAINER='^([^ ]*/)?python[0-9.]* scripts/train[.]py'
DEVICES=${PIPELINE_TPU_DEVICES:-'/dev/accel* /dev/vfio/[0-9]*'}  # v2-v4, v5p; v5e, v6e
host=$(hostname)
STATE="$(cd "$(dirname "$0")/.." && pwd)/.trainer"
log=""

die() {
  printf 'error: %s on %s\n' "$*" "$host" >&2
  exit 1
}

devices() {
  local pattern path
  for pattern in $DEVICES; do
    for path in $pattern; do
      [[ -e $path ]] && printf '%s\n' "$path"
    done
  done
  return 0
}

holders() {
  local found
  found=$(devices)
  [[ -z $found ]] && return 0
  # shellcheck disable=SC2086  # one word per device path
  sudo lsof -t $found 2>/dev/null | sort -u || true
}

clear_holders() {
  local pids
  pids=$(holders)
  if [[ -n $pids ]]; then
    echo "killing stale TPU holders on $host: $(echo "$pids" | tr '\n' ' ')"
    echo "$pids" | xargs -r sudo kill -9 || true
  fi
  sudo rm -f /tmp/libtpu_lockfile || true
}

setup() {
  local python="" jax="" lock="" locked
  while (($#)); do
    case $1 in
      --python) python=$2 && shift 2 ;;
      --jax) jax=$2 && shift 2 ;;
      --lock) lock=$2 && shift 2 ;;
      *) die "setup: unknown argument '$1'" ;;
    esac
  done
  [[ -n $python && -n $jax ]] || die "setup needs --python VERSION and --jax VERSION"
  export PATH="$HOME/.local/bin:$PATH"
  if ! command -v uv >/dev/null; then
    python3 -m pip --version >/dev/null 2>&1 ||
      { sudo apt-get update -q && sudo apt-get install -y -q python3-pip; }
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --user --quiet --upgrade uv
  fi
  uv venv --quiet --allow-existing --python "$python" .venv
  if [[ -z $lock ]]; then
    uv pip install --quiet --python .venv/bin/python -e '.[tpu,train]' "jax[tpu]==$jax"
  else
    # The run's lock: exact versions of every dependency, resolved by the first install of the
    # run and recorded at LOCK; every later install (a re-created slice) installs exactly that.
    mkdir -p "$STATE"
    locked=$STATE/requirements.txt
    if ! gcloud storage ls "$lock" >/dev/null 2>&1; then
      uv pip install --quiet --python .venv/bin/python -e '.[tpu,train]' "jax[tpu]==$jax"
      uv pip freeze --python .venv/bin/python --exclude-editable >"$locked"
      # The first worker to record it wins; the others install what it recorded.
      if gcloud storage cp --if-generation-match=0 "$locked" "$lock" >/dev/null 2>&1; then
        echo "recorded this run's environment in $lock on $host"
      fi
    fi
    gcloud storage cp "$lock" "$locked" >/dev/null || die "cannot read the run's lock $lock"
    grep -qx "jax==$jax" "$locked" ||
      echo "warning: the run's lock $lock has $(grep '^jax==' "$locked" || echo 'no jax'), not jax==$jax: installing the lock (delete it to resolve again)" >&2
    uv pip sync --quiet --python .venv/bin/python "$locked"
    uv pip install --quiet --python .venv/bin/python --no-deps -e .
    echo "installed the run's locked environment ($(grep -c '==' "$locked") packages from $lock) on $host"
  fi
  # Versions only: touching the devices here would hold the TPU.
  .venv/bin/python -c 'import sys, jax, pipeline
print("installed on", sys.argv[1], "python", sys.version.split()[0], "jax", jax.__version__)' "$host"
}

# One line when the venv differs from the run's lock (recorded by setup --lock): a slice that
# trains with other libraries than the checkpoint's run is named, not silent.
check_environment() {
  [[ -f $STATE/requirements.txt ]] || return 0
  python - "$STATE/requirements.txt" <<'PY'
import importlib.metadata as metadata
import re
import sys

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

want = {}
for line in open(sys.argv[1]):
    name, sep, version = line.strip().partition("==")
    if sep and not name.startswith("#"):
        want[norm(name)] = version.split(";")[0].strip()
have = {norm(d.metadata["Name"]): d.version for d in metadata.distributions()}
diff = [f"{n}=={v} (installed: {have.get(n, 'none')})" for n, v in sorted(want.items())
        if have.get(n) != v]
if diff:
    print(f"warning: the environment differs from the run's lock {sys.argv[1]}: " + ", ".join(diff))
PY
}

mount_bucket() {
  (($# == 2)) || die "mount needs BUCKET MOUNT_POINT"
  local bucket=${1#gs://} point=$2 codename
  if ! command -v gcsfuse >/dev/null; then
    codename=$(lsb_release -c -s)
    curl -fsSL https://packages.cloud.google.com/apt/doc/apt-key.gpg |
      sudo tee /usr/share/keyrings/cloud.google.asc >/dev/null
    echo "deb [signed-by=/usr/share/keyrings/cloud.google.asc] https://packages.cloud.google.com/apt gcsfuse-$codename main" |
      sudo tee /etc/apt/sources.list.d/gcsfuse.list >/dev/null
    sudo apt-get update -q && sudo apt-get install -y -q gcsfuse
  fi
  sudo mkdir -p "$point"
  sudo chown "$(id -u):$(id -g)" "$point"
  if mountpoint -q "$point"; then
    if ls "$point" >/dev/null 2>&1; then
      echo "$point is already mounted on $host"
      return 0
    fi
    # gcsfuse died under the mount ("Transport endpoint is not connected"): mount it again.
    echo "$point is mounted but unreadable on $host: unmounting it to mount it again"
    fusermount -u -z "$point" 2>/dev/null || sudo umount -l "$point"
  fi
  # Read-only, with the type, stat, list and metadata caches unbounded and never expiring:
  # the flags MaxText mounts its datasets with (the stores do not change during a run).
  gcsfuse -o ro --implicit-dirs --type-cache-max-size-mb=-1 --stat-cache-max-size-mb=-1 \
    --kernel-list-cache-ttl-secs=-1 --metadata-cache-ttl-secs=-1 \
    --log-file="$HOME/gcsfuse.json" "$bucket" "$point"
  echo "mounted gs://$bucket read-only at $point on $host"
}

preflight() {
  local count held
  if pgrep -f "$TRAINER" >/dev/null; then
    die "scripts/train.py is already running; run tpu/stop.sh first"
  fi
  mkdir -p "$STATE"
  flock -n "$STATE/lock" true ||
    die "a tpu/worker.sh start still runs (trainer $(recorded_trainer)); run tpu/stop.sh first"
  clear_holders
  count=$(devices | wc -l | tr -d ' ')
  ((count > 0)) || die "no TPU chips visible ($DEVICES)"
  held=$(holders)
  [[ -z $held ]] || die "the TPU is still held by pid $(echo "$held" | tr '\n' ' ')"
  touch "$STATE/armed"
  echo "ok: $host sees $count TPU chips, none in use"
}

# The trainer's state on this host, beside the venv (install.sh's untar leaves it alone):
#   lock    flock'ed by the `start` wrapper while it runs its trainer
#   pid     "PID START_TICKS" of the trainer: the start time (/proc/PID/stat) tells a reused
#           pid from the trainer's
#   status  the last attempt's exit status; "running" while it runs (and forever if its
#           wrapper was killed)
#   armed   written by a successful preflight: the next `start` begins a new attempt
start_ticks() {
  local stat
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
  # shellcheck disable=SC2086  # fields after the command name, which may contain spaces
  set -- ${stat##*) }
  printf '%s' "${20}"
}

# The trainer recorded in the pid file, if it still runs: "pid N", else "pid N, gone".
recorded_trainer() {
  local pid ticks
  read -r pid ticks <"$STATE/pid" 2>/dev/null || { printf 'pid unknown'; return 0; }
  if [[ $(start_ticks "$pid" || true) == "$ticks" ]]; then
    printf 'pid %s' "$pid"
  else
    printf 'pid %s, gone' "$pid"
  fi
}

# The attempt that gcloud's retry of the same start command belongs to has ended: no
# preflight armed a new one since.
attempt_ended() { [[ ! -e $STATE/armed && -e $STATE/status ]]; }

# Report the last attempt's exit status (from the status file) and return it.
last_status() {
  local rc
  rc=$(cat "$STATE/status" 2>/dev/null || true)
  if [[ ! $rc =~ ^[0-9]+$ ]]; then
    echo "error: the exit status of the last scripts/train.py on $host is unknown: its start wrapper was killed (trainer $(recorded_trainer)); run tpu/stop.sh" >&2
    return 1
  fi
  echo "scripts/train.py exited with status $rc on $host"
  return "$rc"
}

# write_log: the trainer's output (stdin), line by line, appended to $log and rotated to
# $log.1 when it reaches $max_bytes; with a log URI each line also goes to $STATE/unsent,
# which the next sync sends. A write that fails (a full disk) loses that line, never the run.
write_log() {
  local line size=0 warned=0
  [[ -f $log ]] && size=$(wc -c <"$log" 2>/dev/null | tr -d ' ')
  while IFS= read -r line || [[ -n $line ]]; do
    if printf '%s\n' "$line" >>"$log" 2>/dev/null; then
      warned=0
    elif ((!warned)); then
      echo "warning: cannot write to $log on $host (disk full?): the trainer runs on; its output is lost until there is room" >&2
      warned=1
    fi
    if [[ -n $uri ]]; then
      { printf '%s\n' "$line" >>"$STATE/unsent"; } 2>/dev/null || true
    fi
    size=$((size + ${#line} + 1))
    if ((max_bytes > 0 && size >= max_bytes)); then
      mv -f "$log" "$log.1" 2>/dev/null || rm -f "$log"
      size=0
    fi
  done
}

# sync_out: the lines written since the last sync become the next chunk object (incremental: each
# byte is sent once), and the heartbeat is copied. A failed copy is one warning line naming
# the object and gcloud's last error line; its chunk is sent with the next sync.
sync_out() {
  local count chunk out
  if [[ -n $uri && -s $STATE/unsent ]]; then
    count=$(($(cat "$STATE/chunks" 2>/dev/null || echo 0) + 1))
    echo "$count" >"$STATE/chunks"
    mv "$STATE/unsent" "$STATE/chunk.$(printf '%06d' "$count")"
  fi
  for chunk in "$STATE"/chunk.*; do
    [[ -e $chunk ]] || continue
    if out=$(gcloud storage cp "$chunk" "$object.${chunk##*.}" 2>&1); then
      rm -f "$chunk"
    else
      printf 'warning: could not copy the log to %s on %s: %s\n' "$object.${chunk##*.}" "$host" \
        "$(printf '%s\n' "$out" | grep -v '^[[:space:]]*$' | tail -n 1)" >&2
    fi
  done
  if [[ -n $beat_uri && -f $STATE/heartbeat ]]; then
    gcloud storage cp "$STATE/heartbeat" "$beat_uri/$host" >/dev/null 2>&1 ||
      echo "warning: could not copy the heartbeat to $beat_uri/$host on $host" >&2
  fi
}

start() {
  local logdir="" uri="" beat_uri="" every=60 max_bytes=$((100 * 1024 * 1024)) foreground=0
  local child rc syncer="" writer stamp object fifo
  local args=("$@")
  while (($#)); do
    case $1 in
      --log-dir) logdir=${2/#\~/$HOME} && shift 2 ;;
      --log-uri) uri=${2%/} && shift 2 ;;
      --heartbeat-uri) beat_uri=${2%/} && shift 2 ;;
      --sync-seconds) every=$2 && shift 2 ;;
      --max-log-bytes) max_bytes=$2 && shift 2 ;;
      --foreground) foreground=1 && shift ;;
      --) shift && break ;;
      *) die "start: unknown argument '$1'" ;;
    esac
  done
  (($#)) && [[ -n $logdir ]] || die "start needs --log-dir DIR -- COMMAND..."
  mkdir -p "$logdir" "$STATE"
  log=$logdir/train-$host.log
  if ((!foreground)); then
    if ! flock -n "$STATE/lock" true; then
      echo "scripts/train.py is already running on $host ($(recorded_trainer)); not starting another"
      return 0
    fi
    attempt_ended && { echo "this attempt has ended on $host; not starting it again"; last_status; return; }
    nohup "$0" start --foreground "${args[@]}" >/dev/null 2>&1 </dev/null &
    echo "started on $host, pid $!"
    return 0
  fi
  # gcloud re-runs this whole command after a dropped connection (ssh exit 255): a second
  # start waits for the trainer that runs, or reports the attempt that ended; never a second
  # trainer. Only preflight (a separate ssh command) arms a new attempt.
  exec 9>>"$STATE/lock"
  if ! flock -n 9; then
    echo "scripts/train.py is already running on $host ($(recorded_trainer)): waiting for it, not starting another"
    flock 9
    last_status
    return
  fi
  if attempt_ended; then
    echo "this attempt has ended on $host; not starting it again (tpu/worker.sh preflight, which tpu/run.sh runs first, arms a new one)"
    last_status
    return
  fi
  rm -f "$STATE/armed" "$STATE/heartbeat" "$STATE/unsent" "$STATE"/chunk.* "$STATE/chunks"
  echo running >"$STATE/status"
  # A dropped ssh connection (recover.sh waits on this one) must not end the run.
  trap '' HUP
  stamp=$(date -u +%Y%m%dT%H%M%SZ)
  object="$uri/train-$host-$stamp.log"
  # Everything written to the fifo (the header, the trainer, the syncer's warnings) reaches the
  # log through one writer, which rotates it.
  fifo=$STATE/output
  rm -f "$fifo"
  mkfifo "$fifo"
  write_log <"$fifo" 9>&- &
  writer=$!
  exec 8>"$fifo"
  {
    printf '==== %s attempt started on %s: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$host" "$*"
    [[ -n $uri ]] && printf '==== this attempt is copied to %s.NNNNNN\n' "$object"
  } >&8
  check_environment | tee /dev/fd/8 || true
  export PIPELINE_HEARTBEAT=$STATE/heartbeat
  "$@" >&8 2>&1 </dev/null 9>&- 8>&- &
  child=$!
  printf '%s %s\n' "$child" "$(start_ticks "$child" || true)" >"$STATE/pid"
  echo "started on $host, pid $child"
  trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT
  if [[ -n $uri || -n $beat_uri ]]; then
    (
      exec 9>&- 8>&-
      nap=""
      trap 'kill "$nap" 2>/dev/null; exit 0' TERM
      while :; do
        sleep "$every" &
        nap=$!
        wait "$nap"
        sync_out
      done
    ) </dev/null >&8 2>&1 &
    syncer=$!
  fi
  exec 8>&-
  rc=0
  while kill -0 "$child" 2>/dev/null; do
    wait "$child" && rc=0 || rc=$?
  done
  if [[ -n $syncer ]]; then
    kill "$syncer" 2>/dev/null || true
    wait "$syncer" 2>/dev/null || true
  fi
  # The fifo's last writer is gone with the trainer, so the writer ends; a process the trainer
  # left behind that still holds the fifo gets 10 s, then its output is no longer logged.
  for _ in {1..100}; do
    kill -0 "$writer" 2>/dev/null || break
    sleep 0.1
  done
  kill "$writer" 2>/dev/null || true
  wait "$writer" 2>/dev/null || true
  rm -f "$fifo"
  printf '==== %s attempt ended on %s: exit status %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$host" "$rc" |
    write_log
  if [[ -n $uri || -n $beat_uri ]]; then
    sync_out 9>&-
  fi
  echo "$rc" >"$STATE/status"
  echo "scripts/train.py exited with status $rc on $host"
  return "$rc"
}

# Whether a trainer runs here (tpu/recover.sh, restarted mid-run, attaches to it instead of
# installing under it).
status() {
  if { [[ -e $STATE/lock ]] && ! flock -n "$STATE/lock" true; } || pgrep -f "$TRAINER" >/dev/null; then
    echo "a trainer runs on $host ($(recorded_trainer))"
    return 0
  fi
  echo "no trainer runs on $host"
  return 3
}

stop() {
  local grace=${1:-120} pids waited=0
  pids=$(pgrep -f "$TRAINER" || true)
  if [[ -n $pids ]]; then
    echo "SIGTERM to the trainer on $host: it saves a checkpoint and exits"
    echo "$pids" | xargs -r kill -TERM 2>/dev/null || true
    while pgrep -f "$TRAINER" >/dev/null && ((waited < grace)); do
      sleep 1
      waited=$((waited + 1))
    done
    if pgrep -f "$TRAINER" >/dev/null; then
      echo "still running after ${grace}s on $host: SIGKILL"
      pgrep -f "$TRAINER" | xargs -r sudo kill -9 || true
    fi
  fi
  clear_holders
  echo "stopped on $host"
}

command=${1:-}
(($#)) && shift
case $command in
  setup) setup "$@" ;;
  mount) mount_bucket "$@" ;;
  preflight) preflight ;;
  start) start "$@" ;;
  status) status ;;
  stop) stop "$@" ;;
  *) die "usage: tpu/worker.sh setup|mount|preflight|start|status|stop ... (see the comment at its top)" ;;
esac
