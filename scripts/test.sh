#!/usr/bin/env bash
# Install everything the tests need, then run them. Extra arguments go to the main run's pytest.
# Every skip must be a capability this machine lacks (tests/conftest.py, --check-skips); the CUDA
# tests run in a process of their own (the interpreter tests set TRITON_INTERPRET for theirs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
python -m pytest -p no:cacheprovider -rs --check-skips "$@"
python -m pytest -p no:cacheprovider -rs --check-skips tests/test_cuda.py
