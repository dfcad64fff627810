#!/usr/bin/env bash
# Install everything the tests need, then run them. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
exec python -m pytest -p no:cacheprovider "$@"
