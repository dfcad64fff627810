#!/usr/bin/env bash
# Install redis-server (Debian package) for the Redis KV tier tests. Idempotent: does nothing
# when redis-server is already on PATH. The tests start their own server on 127.0.0.1 on a free
# port (tests/redis_server.py), so the packaged service is not started here.
set -euo pipefail

if command -v redis-server >/dev/null 2>&1; then
    echo "redis-server present: $(redis-server --version)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_redis.sh: redis-server is missing and this user cannot install packages;" \
             "install the Debian package redis-server (apt-get install -y redis-server)" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
echo "installed: $(redis-server --version)"
