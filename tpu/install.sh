#!/usr/bin/env bash
# Put the project on every worker of the slice, with a pinned Python and JAX in a venv.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

# The Python and JAX the workers get unless told otherwise (the versions the tests run with).
DEFAULT_PYTHON=3.12
DEFAULT_JAX=0.10.2

usage() {
  cat <<'EOF_USAGE'
Usage: tpu/install.sh [--env-file FILE] [options] [--dry-run] [-- EXTRA_GCLOUD_FLAGS...]

Install the project on all workers, in REMOTE_DIR (default: ~/pipeline), then run there
`tpu/worker.sh setup`: uv (pip --user), a venv REMOTE_DIR/.venv with a pinned Python (uv
downloads it when the image lacks it), the project with its [tpu] extra (gcsfs, so that
Orbax and the trainer reach gs://) and [train] extra (the trainer's optax) and
jax[tpu]==JAX_VERSION. With --gcsfuse-bucket it also
mounts the bucket read-only (`tpu/worker.sh mount`, MaxText's gcsfuse cache flags).

  copy (default): the committed tree of the local checkout (uncommitted changes are NOT sent),
    unpacked as a clean tree that replaces REMOTE_DIR (its .venv, .trainer and a log directory
    inside it are kept); re-running the command (gcloud does after a dropped ssh) is harmless
    git -C SOURCE archive --format=tar.gz -o TARBALL COMMIT        (HEAD, or the run's pin)
    gcloud compute tpus tpu-vm scp --worker=all TARBALL NAME:pipeline-src-COMMIT.tar.gz ...
    gcloud compute tpus tpu-vm ssh NAME ... --worker=all --command='...unpack; worker.sh setup'
    (gcloud copies to several workers only with its ssh key in ssh-agent: unless describe
    counts one worker, the key is checked first)
  clone (--repo URL [--ref REF]): each worker clones or fetches the repository itself
    gcloud compute tpus tpu-vm ssh NAME ... --worker=all --command='git clone ...; worker.sh setup'

Options (flag / environment or env-file variable):
  --name NAME             TPU_NAME           TPU name                                [required]
  --project PROJECT       TPU_PROJECT        Google Cloud project id                 [required]
  --zone ZONE             TPU_ZONE           e.g. us-west4-a                         [required]
  --repo URL              TPU_REPO           clone this git URL on the workers instead of copying
  --ref REF               TPU_REF            branch, tag or commit to check out (default: HEAD)
  --source DIR            TPU_SOURCE         local checkout to copy (default: this repository)
  --remote-dir DIR        TPU_REMOTE_DIR     project dir on the workers, relative to the remote
                                             home unless absolute (default: pipeline)
  --python VERSION        TPU_PYTHON         Python version of the venv (default: 3.12)
  --jax-version VERSION   TPU_JAX_VERSION    jax[tpu] version (default: 0.10.2)
  --gcsfuse-bucket BUCKET TPU_GCSFUSE_BUCKET mount gs://BUCKET read-only on every worker
  --mount-point DIR       TPU_MOUNT_POINT    where (default: /mnt/BUCKET)
  --lock-uri URI          TPU_LOCK_URI       the run's lock of exact dependency versions
                                             (default: CHECKPOINT_DIR.requirements.txt for a
                                             gs:// --checkpoint-dir; none: no lock). The first
                                             install resolves and records it, every later one
                                             (a re-created slice) installs exactly it
  --code-uri URI          TPU_CODE_URI       the run's commit (default: CHECKPOINT_DIR.commit for a
                                             gs:// --checkpoint-dir; none: not pinned). The
                                             first install records the commit it ships, every
                                             later one ships that commit, whatever HEAD is then
  --new-code              TPU_NEW_CODE=1     ship HEAD (or --ref) and pin the run to it
  --checkpoint-dir DIR    TPU_CHECKPOINT_DIR the run's checkpoints (for the defaults above)
  --ssh-flags 'FLAGS'     TPU_SSH_FLAGS      extra words for every gcloud ssh and scp, split at
                                             blanks (e.g. '--internal-ip')
  --env-file FILE         TPU_ENV_FILE       KEY=VALUE file (see tpu/example.env)
  --dry-run               print the commands instead of running them
  -h, --help              this help
Words after `--` are appended to every gcloud command (e.g. -- --internal-ip).
EOF_USAGE
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone repo ref source remote-dir python jax-version gcsfuse-bucket mount-point ssh-flags num-slices \
checkpoint-dir lock-uri code-uri"
BOOL_FLAGS="new-code"
tpu_parse "$@"

check_common
remote_layout
check_slices
TPU_PYTHON=${TPU_PYTHON:-$DEFAULT_PYTHON}
TPU_JAX_VERSION=${TPU_JAX_VERSION:-$DEFAULT_JAX}
check TPU_PYTHON '^3[.][0-9]+([.][0-9]+)?$' 'a Python version (e.g. 3.12)'
check TPU_JAX_VERSION '^[0-9]+[.][0-9]+[.][0-9]+$' 'a jax version (e.g. 0.10.2)'
check TPU_REF '^[A-Za-z0-9_./+@-]+$' 'a git branch, tag or commit'
check_mount
if [[ -n ${TPU_REF:-} && -z ${TPU_REPO:-} ]]; then
  die "--ref needs --repo (or TPU_REPO); without it the committed HEAD of the local checkout is copied"
fi
if [[ -n ${TPU_REPO:-} && -n ${TPU_SOURCE:-} ]]; then
  die "--repo and --source exclude each other: clone on the workers, or copy a local checkout"
fi

dir=$(remote_path "$TPU_REMOTE_DIR")
bool TPU_NEW_CODE
# One code version per run: the commit of the first install, recorded beside the run's lock.
if [[ -z ${TPU_CODE_URI:-} && ${TPU_CHECKPOINT_DIR:-} == gs://* ]]; then
  TPU_CODE_URI="${TPU_CHECKPOINT_DIR%/}.commit"
fi
check TPU_CODE_URI '^(none|gs://[a-z0-9][-a-z0-9_.]*[a-z0-9]/.+)$' 'a gs://bucket/object URI or none'
[[ ${TPU_CODE_URI:-none} == none ]] && TPU_CODE_URI=""
record=""

remote="set -e; "
if [[ -n ${TPU_REPO:-} ]]; then
  ref=$(shquote "${TPU_REF:-HEAD}")
  remote+="if [ ! -d $dir/.git ]; then git clone --quiet $(shquote "$TPU_REPO") $dir; fi; "
  if [[ -n $TPU_CODE_URI ]]; then
    # The workers read the run's commit; the first install of the run records it.
    uri=$(shquote "$TPU_CODE_URI")
    # Only "no such object" means a first install; any other error is one to retry.
    pin="pin=\$(gcloud storage cat $uri 2>&1) || case \$pin in *'matched no objects'*) pin= ;; "
    pin+="*) echo \"error: cannot read $TPU_CODE_URI on \$(hostname): \$pin\" >&2; exit 1 ;; esac; "
    match="--if-generation-match=0 "
    ((TPU_NEW_CODE)) && pin="pin=; " match=""
    remote+="$pin"
    remote+="if [ -n \"\$pin\" ]; then echo \"the run's commit \$pin ($TPU_CODE_URI) on \$(hostname)\"; "
    remote+="git -C $dir fetch --quiet origin \"\$pin\"; else git -C $dir fetch --quiet origin $ref; fi; "
    remote+="git -C $dir checkout --quiet --detach FETCH_HEAD; "
    remote+="if [ -z \"\$pin\" ]; then git -C $dir rev-parse HEAD >$dir.commit; "
    remote+="gcloud storage cp $match$dir.commit $uri >/dev/null 2>&1 || true; rm -f $dir.commit; fi; "
  else
    remote+="git -C $dir fetch --quiet origin $ref; git -C $dir checkout --quiet --detach FETCH_HEAD; "
  fi
else
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  source_dir=${TPU_SOURCE:-$here}
  if ! head=$(git -C "$source_dir" rev-parse --verify --quiet HEAD 2>/dev/null); then
    die "--source '$source_dir' is not a git checkout with a commit (copy mode sends 'git archive HEAD'; commit first, or use --repo URL)"
  fi
  commit=$head
  if [[ -n $TPU_CODE_URI ]]; then
    pinned="" error=""
    if ! query pinned gcloud storage cat "$TPU_CODE_URI" 2>"${TMPDIR:-/tmp}/tpu-pin-$TPU_NAME"; then
      error=$(grep -v '^+ ' "${TMPDIR:-/tmp}/tpu-pin-$TPU_NAME" || true)
      pinned=""
    fi
    rm -f "${TMPDIR:-/tmp}/tpu-pin-$TPU_NAME"
    if [[ -n $error && $error != *"matched no objects"* ]]; then
      # Not a first install: a transient error must not re-pin the run (exit 1: try again).
      note "error: cannot read the run's commit $TPU_CODE_URI: ${error//$'\n'/ }"
      exit 1
    elif [[ -z $pinned ]]; then
      record=$head
    elif [[ $pinned != "$head" ]] && ((TPU_NEW_CODE)); then
      note "--new-code: the run moves from commit $pinned to HEAD $head ($TPU_CODE_URI)"
      record=$head
    elif [[ $pinned != "$head" ]]; then
      git -C "$source_dir" cat-file -e "$pinned^{commit}" 2>/dev/null ||
        die "the run is pinned to commit $pinned ($TPU_CODE_URI), which '$source_dir' lacks: fetch it, or ship HEAD $head with --new-code (TPU_NEW_CODE=1)"
      note "the run is pinned to commit $pinned ($TPU_CODE_URI): shipping it, not HEAD $head (--new-code ships HEAD and pins it)"
      commit=$pinned
    fi
  fi
  if [[ $commit == "$head" && -n $(git -C "$source_dir" status --porcelain --untracked-files=no 2>/dev/null) ]]; then
    warn "uncommitted changes in $source_dir are not copied (the workers get 'git archive HEAD')"
  fi
  tarball="${TMPDIR:-/tmp}/tpu-install-$TPU_NAME.tar.gz"
  # A clean tree: the copy replaces the old one (files deleted since are gone); the venv, the
  # trainer's state and a log directory inside the project are moved over.
  if [[ ${TPU_REMOTE_DIR%/} =~ ^(~|[.]|/|)$ ]]; then
    die "--remote-dir '$TPU_REMOTE_DIR' must be a directory of its own: each copy replaces it"
  fi
  kept=".venv .trainer"
  logs_top=${TPU_LOG_DIR%%/*}
  if [[ $TPU_LOG_DIR != /* && $logs_top =~ ^[A-Za-z0-9_][A-Za-z0-9_.+@-]*$ ]]; then
    kept+=" $logs_top"
  fi
  # gcloud runs the whole command again after a dropped connection: each step can be redone.
  # The tarball is removed last; a tree that already holds this commit is kept as it is.
  new="$dir.new"
  remote_tarball=pipeline-src-${commit:0:12}.tar.gz
  remote+="if [ -d $new ] && [ ! -d $dir ]; then mv $new $dir; fi; "
  remote+="if [ -f $remote_tarball ]; then "
  remote+="rm -rf $new; mkdir -p $dir $new; tar -xzf $remote_tarball -C $new; "
  remote+="for kept in $kept; do if [ -e $dir/\$kept ]; then mv $dir/\$kept $new/; fi; done; "
  remote+="rm -rf $dir; mv $new $dir; echo $commit >$dir/.commit; rm -f $remote_tarball; "
  remote+="elif [ \"\$(cat $dir/.commit 2>/dev/null)\" = $commit ]; then "
  remote+="echo \"commit $commit is unpacked already on \$(hostname)\"; "
  remote+="else echo \"error: $remote_tarball is missing on \$(hostname)\" >&2; exit 1; fi; "
fi
setup=(setup --python "$TPU_PYTHON" --jax "$TPU_JAX_VERSION")
# The run's lock of exact dependency versions, beside its gs:// checkpoints unless told.
if [[ -z ${TPU_LOCK_URI:-} && ${TPU_CHECKPOINT_DIR:-} == gs://* ]]; then
  TPU_LOCK_URI="${TPU_CHECKPOINT_DIR%/}.requirements.txt"
fi
check TPU_LOCK_URI '^(none|gs://[a-z0-9][-a-z0-9_.]*[a-z0-9]/.+)$' 'a gs://bucket/object URI or none'
if [[ -n ${TPU_LOCK_URI:-} && $TPU_LOCK_URI != none ]]; then
  setup+=(--lock "$TPU_LOCK_URI")
fi
remote+="$(worker_cmd "${setup[@]}")"
if [[ -n ${TPU_GCSFUSE_BUCKET:-} ]]; then
  remote+=" && $(mount_cmd)"
fi

need_gcloud
if [[ -z ${TPU_REPO:-} ]]; then
  # Copy mode copies to all workers at once, which needs the key in ssh-agent unless the slice
  # has one host.
  hosts=""
  count_workers hosts "$(nodes | head -n 1)" || true
  [[ $hosts == 1 ]] || need_ssh_agent
  if ((!DRY_RUN)); then
    trap 'rm -f "$tarball"' EXIT
  fi
  run git -C "$source_dir" archive --format=tar.gz -o "$tarball" "$commit"
  for node in $(nodes); do
    tpu_scp --worker=all "$tarball" "$node:$remote_tarball"
  done
fi
tpu_ssh "$remote" all
if [[ -n $record ]]; then
  # After the install: a run whose first install failed is not pinned to code it never ran.
  file="${TMPDIR:-/tmp}/tpu-commit-$TPU_NAME"
  ((DRY_RUN)) || printf '%s\n' "$record" >"$file"
  run gcloud storage cp "$file" "$TPU_CODE_URI"
  ((DRY_RUN)) || rm -f "$file"
  note "pinned this run to commit $record ($TPU_CODE_URI): every later install ships it"
fi
