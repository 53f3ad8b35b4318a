#!/usr/bin/env bash
# Stop what setup_sandbox.sh started: the sandbox containers and podman's service.
# Always exits 0; the root filesystem cache stays for the next run.
set -uo pipefail
STATE=${RLSYS_SANDBOX_STATE:-/tmp/rlsys-sandbox}
[ -d "$STATE" ] || exit 0
if [ -f "$STATE/containers.conf" ] && command -v podman >/dev/null; then
    CONTAINERS_CONF="$STATE/containers.conf" CONTAINERS_STORAGE_CONF="$STATE/storage.conf" \
        podman rm -f --filter label=rlsys-sandbox=1 >/dev/null 2>&1 || true
fi
if [ -f "$STATE/podman.pid" ]; then
    kill "$(cat "$STATE/podman.pid")" 2>/dev/null || true
    rm -f "$STATE/podman.pid"
fi
echo "[teardown_sandbox] stopped podman service in $STATE" >&2
exit 0
