#!/usr/bin/env bash
# What runs ON each TPU VM worker. The tpu/ scripts call it over `gcloud ... ssh --worker=all`,
# from the project directory that tpu/install.sh filled; one subcommand per job:
#
#   setup --python VERSION --jax VERSION   uv, a pinned Python in .venv, the project's [tpu]
#                                          and [train] extras and jax[tpu]==VERSION
#   mount BUCKET MOUNT_POINT               gcsfuse read-only mount with MaxText's cache flags
#   preflight                              refuse while a trainer runs, clear stale TPU holders,
#                                          fail unless this worker sees its TPU chips
#   start --log-dir DIR [--log-uri gs://..] [--sync-seconds N] [--foreground] -- COMMAND...
#                                          run COMMAND with its output in DIR/train-HOST.log,
#                                          copied to the log URI every N s and at exit
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
  local python="" jax=""
  while (($#)); do
    case $1 in
      --python) python=$2 && shift 2 ;;
      --jax) jax=$2 && shift 2 ;;
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
  uv pip install --quiet --python .venv/bin/python -e '.[tpu,train]' "jax[tpu]==$jax"
  # Versions only: touching the devices here would hold the TPU.
  .venv/bin/python -c 'import sys, jax, pipeline
print("installed on", sys.argv[1], "python", sys.version.split()[0], "jax", jax.__version__)' "$host"
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
    echo "$point is already mounted on $host"
    return 0
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
  clear_holders
  count=$(devices | wc -l | tr -d ' ')
  ((count > 0)) || die "no TPU chips visible ($DEVICES)"
  held=$(holders)
  [[ -z $held ]] || die "the TPU is still held by pid $(echo "$held" | tr '\n' ' ')"
  echo "ok: $host sees $count TPU chips, none in use"
}

copy_log() {
  gcloud storage cp "$1" "$2" >/dev/null 2>&1 || echo "warning: could not copy $1 to $2" >&2
}

start() {
  local logdir="" uri="" every=60 foreground=0 log child rc syncer=""
  local args=("$@")
  while (($#)); do
    case $1 in
      --log-dir) logdir=${2/#\~/$HOME} && shift 2 ;;
      --log-uri) uri=${2%/} && shift 2 ;;
      --sync-seconds) every=$2 && shift 2 ;;
      --foreground) foreground=1 && shift ;;
      --) shift && break ;;
      *) die "start: unknown argument '$1'" ;;
    esac
  done
  (($#)) && [[ -n $logdir ]] || die "start needs --log-dir DIR -- COMMAND..."
  mkdir -p "$logdir"
  log=$logdir/train-$host.log
  if ((!foreground)); then
    nohup "$0" start --foreground "${args[@]}" >/dev/null 2>&1 </dev/null &
    echo "started on $host, pid $!"
    return 0
  fi
  # A dropped ssh connection (recover.sh waits on this one) must not end the run.
  trap '' HUP
  "$@" >"$log" 2>&1 </dev/null &
  child=$!
  echo "started on $host, pid $child"
  trap 'kill -TERM "$child" 2>/dev/null || true' TERM INT
  if [[ -n $uri ]]; then
    (
      nap=""
      trap 'kill "$nap" 2>/dev/null; exit 0' TERM
      while :; do
        sleep "$every" &
        nap=$!
        wait "$nap"
        copy_log "$log" "$uri/train-$host.log"
      done
    ) </dev/null >/dev/null 2>&1 &
    syncer=$!
  fi
  rc=0
  while kill -0 "$child" 2>/dev/null; do
    wait "$child" && rc=0 || rc=$?
  done
  if [[ -n $syncer ]]; then
    kill "$syncer" 2>/dev/null || true
    copy_log "$log" "$uri/train-$host.log"
  fi
  echo "scripts/train.py exited with status $rc on $host"
  return "$rc"
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
  stop) stop "$@" ;;
  *) die "usage: tpu/worker.sh setup|mount|preflight|start|stop ... (see the comment at its top)" ;;
esac
