#!/usr/bin/env bash
# Put the project on every worker of the slice and install it into a venv.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tpu/install.sh [--env-file FILE] [options] [--dry-run] [-- EXTRA_GCLOUD_FLAGS...]

Install the project on all workers, in REMOTE_DIR (default: ~/pipeline) with a venv in
REMOTE_DIR/.venv: `pip install -e .` then `pip install 'jax[tpu]'`.

  copy (default): the committed tree of the local checkout (uncommitted changes are NOT sent)
    git -C SOURCE archive --format=tar.gz -o TARBALL HEAD
    gcloud compute tpus tpu-vm scp --recurse --worker=all TARBALL NAME:pipeline-src.tar.gz ...
    gcloud compute tpus tpu-vm ssh NAME ... --worker=all --command='...unpack, venv, pip...'
  clone (--repo URL [--ref REF]): each worker clones or fetches the repository itself
    gcloud compute tpus tpu-vm ssh NAME ... --worker=all --command='git clone ...; venv, pip...'

Options (flag / environment or env-file variable):
  --name NAME           TPU_NAME         TPU name                                  [required]
  --project PROJECT     TPU_PROJECT      Google Cloud project id                   [required]
  --zone ZONE           TPU_ZONE         e.g. us-central2-b                        [required]
  --repo URL            TPU_REPO         clone this git URL on the workers instead of copying
  --ref REF             TPU_REF          branch, tag or commit to check out (default: HEAD)
  --source DIR          TPU_SOURCE       local checkout to copy (default: this repository)
  --remote-dir DIR      TPU_REMOTE_DIR   project dir on the workers, relative to the remote
                                         home unless absolute (default: pipeline)
  --python PYTHON       TPU_PYTHON       interpreter that creates the venv (default: python3)
  --env-file FILE       TPU_ENV_FILE     KEY=VALUE file (see tpu/example.env)
  --dry-run             print the commands instead of running them
  -h, --help            this help
Words after `--` are appended to every gcloud command (e.g. -- --internal-ip).
EOF
}

# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

VALUE_FLAGS="name project zone repo ref source remote-dir python"
BOOL_FLAGS=""
tpu_parse "$@"

check_common
remote_layout
TPU_PYTHON=${TPU_PYTHON:-python3}
check TPU_PYTHON '^[A-Za-z0-9_./+-]+$' 'an interpreter name or path (e.g. python3.11)'
check TPU_REF '^[A-Za-z0-9_./+@-]+$' 'a git branch, tag or commit'
if [[ -n ${TPU_REF:-} && -z ${TPU_REPO:-} ]]; then
  die "--ref needs --repo (or TPU_REPO); without it the committed HEAD of the local checkout is copied"
fi
if [[ -n ${TPU_REPO:-} && -n ${TPU_SOURCE:-} ]]; then
  die "--repo and --source exclude each other: clone on the workers, or copy a local checkout"
fi

dir=$(remote_path "$TPU_REMOTE_DIR")
py=$(shquote "$TPU_PYTHON")
remote_tarball=pipeline-src.tar.gz

remote="set -e; "
if [[ -n ${TPU_REPO:-} ]]; then
  ref=$(shquote "${TPU_REF:-HEAD}")
  remote+="if [ ! -d $dir/.git ]; then git clone --quiet $(shquote "$TPU_REPO") $dir; fi; "
  remote+="git -C $dir fetch --quiet origin $ref; git -C $dir checkout --quiet --detach FETCH_HEAD; "
else
  here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  source_dir=${TPU_SOURCE:-$here}
  if ! git -C "$source_dir" rev-parse --verify --quiet HEAD >/dev/null 2>&1; then
    die "--source '$source_dir' is not a git checkout with a commit (copy mode sends 'git archive HEAD'; commit first, or use --repo URL)"
  fi
  if [[ -n $(git -C "$source_dir" status --porcelain --untracked-files=no 2>/dev/null) ]]; then
    warn "uncommitted changes in $source_dir are not copied (the workers get 'git archive HEAD')"
  fi
  tarball="${TMPDIR:-/tmp}/tpu-install-$TPU_NAME.tar.gz"
  remote+="mkdir -p $dir; tar -xzf $remote_tarball -C $dir; rm -f $remote_tarball; "
fi
remote+="cd $dir; "
remote+="if [ ! -x .venv/bin/pip ]; then $py -m venv .venv || { sudo apt-get update -q && sudo apt-get install -y -q python3-venv && $py -m venv .venv; }; fi; "
remote+=".venv/bin/pip install --quiet --upgrade pip; "
remote+=".venv/bin/pip install --quiet -e .; "
remote+=".venv/bin/pip install --quiet 'jax[tpu]'; "
# Only the version: touching the devices here would grab the TPU on every worker.
remote+=".venv/bin/python -c 'import jax, pipeline; print(\"installed on\", __import__(\"socket\").gethostname(), \"jax\", jax.__version__)'"

need_gcloud
if [[ -z ${TPU_REPO:-} ]]; then
  if ((!DRY_RUN)); then
    trap 'rm -f "$tarball"' EXIT
  fi
  run git -C "$source_dir" archive --format=tar.gz -o "$tarball" HEAD
  run gcloud compute tpus tpu-vm scp --recurse --worker=all "$tarball" "$TPU_NAME:$remote_tarball" \
    --zone="$TPU_ZONE" --project="$TPU_PROJECT" ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"}
fi
tpu_ssh "$remote" all
