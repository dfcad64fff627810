#!/usr/bin/env bash
# Install the Debian packages the observability tests drive: prometheus (promtool tests the alert
# rules; the server scrapes a running kvserve end to end) and chromium (opens /dashboard headless).
# Idempotent: installs only what is missing from PATH. The tests start their own Prometheus on
# 127.0.0.1 and a free port, so the packaged service is not started here.
set -euo pipefail

missing=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
if [ ${#missing[@]} -eq 0 ]; then
    echo "present: $(promtool --version 2>&1 | head -1); $(chromium --version 2>/dev/null)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install_observability.sh: ${missing[*]} missing and this user cannot install packages;" \
             "install the Debian packages (apt-get install -y ${missing[*]})" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# policy-rc.d-less containers: the prometheus package's service start may fail; the binaries are what we need
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "installed: $(promtool --version 2>&1 | head -1); $(chromium --version 2>/dev/null)"
