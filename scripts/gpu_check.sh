#!/usr/bin/env bash
# The GPU check of issue 16, sized for one 10-minute run on a lent GPU machine whose Python has
# torch and triton but no internet and no gguf package.
#
#   here, with the registry reachable, once:   scripts/gpu_check.sh --prepare shared-wheels
#   there (the repository root):               scripts/gpu_check.sh shared-wheels
#
# --prepare downloads the wheels the check needs beyond torch, triton and numpy (gguf and what it
# imports, pytest and what it imports; pyyaml for CPython 3.10-3.13) into the folder, about 5 MB;
# the folder is git-ignored, so name it in the device tool's carry (or pass another path). numpy is
# assumed there (GPU images ship it with torch); GPU_CHECK_NUMPY=3.12 also fetches numpy for that
# CPython (16 MB a version: the device tool carries 64 MiB in all).
# The run installs from that folder only what its Python cannot import (offline, --no-deps), runs the
# Triton tests on the GPU (tests/test_triton_*.py), then scripts/gpu_check.py, which writes
# random-weight GGUF files of the four known models' shapes on the machine itself and prints one
# table: plain decode tok/s, the verify curve (rows 1..16), spec == plain on a scripted acceptance
# pattern, the HBM bandwidth limit and torch's bf16 F.linear on the same shapes.
# GPU_CHECK_ARGS passes extra arguments to gpu_check.py (e.g. "--models qwen2.5-coder-1.5b").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [[ "${1:-}" == "--prepare" ]]; then
  dest=${2:?usage: scripts/gpu_check.sh --prepare DIR}
  mkdir -p "$dest"
  gguf_version=$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')
  pytest_version=$("$PY" -c 'import importlib.metadata as m; print(m.version("pytest"))')
  # pure-Python wheels, any interpreter
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$dest" "gguf==$gguf_version" tqdm \
    "pytest==$pytest_version" pluggy iniconfig packaging pygments
  # compiled ones, for each CPython the GPU machine may have
  for v in 3.10 3.11 3.12 3.13; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --python-version "$v" \
      -d "$dest" pyyaml
  done
  if [[ -n "${GPU_CHECK_NUMPY:-}" ]]; then
    "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --python-version "$GPU_CHECK_NUMPY" \
      -d "$dest" numpy
  fi
  du -sh "$dest"
  exit 0
fi

wheels=${1:-shared-wheels}
started=$(date +%s)
"$PY" -c 'import torch, triton; assert torch.cuda.is_available(), "torch sees no CUDA GPU"; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
# module -> the wheel that brings it; installed only when missing
for pair in numpy:numpy yaml:pyyaml tqdm:tqdm gguf:gguf pygments:pygments packaging:packaging \
            iniconfig:iniconfig pluggy:pluggy pytest:pytest; do
  mod=${pair%%:*}; pkg=${pair#*:}
  if ! "$PY" -c "import $mod" 2>/dev/null; then
    [[ -d "$wheels" ]] || { echo "error: $mod is missing and there is no wheel folder $wheels" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --find-links "$wheels" "$pkg"
  fi
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== Triton tests on the GPU"
"$PY" -m pytest -q -p no:cacheprovider tests/test_triton_gguf.py tests/test_triton_attention.py \
  tests/test_triton_model.py

echo "== measurements (random weights, the known models' shapes)"
# shellcheck disable=SC2086
"$PY" scripts/gpu_check.py --json "${OUT:-.}/gpu_check.json" ${GPU_CHECK_ARGS:-}
echo "== done in $(( $(date +%s) - started ))s"
