#!/usr/bin/env bash
# Installs everything pipedream_ext needs on a fresh Debian machine and builds
# the extension. Idempotent: a second run only rebuilds what changed.
#   - GoogleTest + cmake (apt; needs root or sudo)
#   - torch==2.13.0 (the CPU wheel; never unpinned: that pulls CUDA packages)
#   - Python tools (ninja, pytest, tqdm, ...) and transformers==5.23.0 (the [hf] extra)
#   - pipedream_ext._C (pip install --no-build-isolation -e .)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-2}

log() { echo "[bootstrap] $*"; }

if [ ! -f /usr/include/gtest/gtest.h ] || ! command -v cmake >/dev/null; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
  log "installing libgtest-dev and cmake with apt-get"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q libgtest-dev cmake g++ make
fi

if ! $PY -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  log "installing torch==2.13.0 (CPU)"
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q ninja pytest pytest-timeout tqdm numpy matplotlib scikit-learn 2>&1 | grep -v "Running pip as the 'root' user" || true
# The [hf] extra, for tests/test_hf.py and examples/train_hf_gpt2.py: transformers has
# no torch requirement, so the pinned CPU torch stays (checked with pip --dry-run).
if ! $PY -c "import transformers, sys; sys.exit(transformers.__version__ != '5.23.0')" 2>/dev/null; then
  log "installing transformers==5.23.0"
  $PY -m pip install -q transformers==5.23.0 2>&1 | grep -v "Running pip as the 'root' user" || true
fi

# Build (or rebuild) the extension when it is missing or older than csrc/.
so=$(ls pipedream_ext/_C*.so 2>/dev/null | head -n1 || true)
if [ -z "$so" ] || [ -n "$(find csrc setup.py -newer "$so" -type f 2>/dev/null | head -n1)" ] \
   || ! (cd / && $PY -c "import pipedream_ext, sys; sys.exit(pipedream_ext.__file__ != '$PWD/pipedream_ext/__init__.py')") 2>/dev/null; then
  # (imported from / so that an editable install of another checkout is caught)
  log "building pipedream_ext._C (pip install --no-build-isolation -e .)"
  $PY -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "Running pip as the 'root' user" || true
  $PY -c "import pipedream_ext" || { echo "[bootstrap] build failed" >&2; exit 1; }
fi
log "ready"
