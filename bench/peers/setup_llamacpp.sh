#!/usr/bin/env bash
# llama.cpp's OpenAI-compatible server (llama-cpp-python[server]) in its own venv, for
# bench/compare.py.      bash bench/peers/setup_llamacpp.sh     # -> bench/.venvs/llamacpp
# Built from source with AMX off: on these VMs the CPU reports AMX through cpuid but the kernel
# does not enable the tile state, so ggml's AMX kernels die with SIGILL. GGML_NATIVE is off for
# the same reason (-march=native would switch AMX back on); AVX-512 (+VNNI/BF16/VBMI) is named
# explicitly instead. Niced; BUILD_JOBS compile jobs (default: all CPUs; ~7 min on 2 idle cores,
# never finished at one job under a load average of 8-16).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${LLAMACPP_VENV:-$ROOT/bench/.venvs/llamacpp}"
PY="${PYTHON:-python3.11}"
[ -x "$VENV/bin/python" ] || $PY -m venv "$VENV"
JOBS="${BUILD_JOBS:-$(nproc)}"
export CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" MAX_JOBS="$JOBS"
export CMAKE_ARGS="-DGGML_AMX=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
 -DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF \
 -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
 -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_OPENMP=ON \
 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
nice -n 19 "$VENV/bin/pip" install --upgrade pip >/dev/null
nice -n 19 "$VENV/bin/pip" install --no-binary llama-cpp-python --no-cache-dir -v "llama-cpp-python[server]==${LLAMACPP_VERSION:-0.3.36}"
"$VENV/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
echo "llama.cpp venv ready: $VENV"
