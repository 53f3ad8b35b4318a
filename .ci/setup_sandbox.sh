#!/usr/bin/env bash
# Set up what the sandbox tests need: apt packages, the cached root filesystem, podman's
# Docker-API service on a socket in $RLSYS_SANDBOX_STATE, the image, and a smoke run of
# both backends.
#
#   eval "$(bash .ci/setup_sandbox.sh)"     # from the repo root, after the venv exists
#
# stdout carries only `export ...` lines (also written to $RLSYS_SANDBOX_STATE/env);
# progress goes to stderr. It always exits 0: on failure it prints a loud banner and
# exports RLSYS_SANDBOX_SETUP_ERROR, and the sandbox tests skip with that reason.
# Idempotent: a running service, a cached root filesystem and an imported image are reused.
set -uo pipefail

PY=${PYTHON:-.venv/bin/python}
export RLSYS_SANDBOX_CACHE=${RLSYS_SANDBOX_CACHE:-/var/cache/rlsys-sandbox}
STATE=${RLSYS_SANDBOX_STATE:-/tmp/rlsys-sandbox}
SOCK="unix://$STATE/podman.sock"
T0=$SECONDS

log() { echo "[setup_sandbox +$((SECONDS - T0))s] $*" >&2; }

fail() {
    {
        echo "################################################################"
        echo "## SANDBOX SETUP FAILED: $*"
        echo "## The sandbox tests will be SKIPPED. Log: $STATE/setup.log"
        echo "################################################################"
    } >&2
    echo "export RLSYS_SANDBOX_SETUP_ERROR=$(printf %q "$*")"
    echo "export RLSYS_SANDBOX_SETUP_ERROR=$(printf %q "$*")" > "$STATE/env"
    exit 0
}

mkdir -p "$STATE" || { echo "export RLSYS_SANDBOX_SETUP_ERROR=cannot-create-$STATE"; exit 0; }
exec 3>&2 2> >(tee -a "$STATE/setup.log" >&3)

have_tools() {
    command -v bwrap && command -v podman && command -v runc && command -v debootstrap \
        && command -v setpriv && command -v newuidmap \
        && { command -v catatonit || test -x /usr/libexec/podman/catatonit; }
} >/dev/null 2>&1

if ! have_tools; then
    log "installing bubblewrap podman runc debootstrap catatonit uidmap"
    for attempt in 1 2; do
        apt-get -o DPkg::Lock::Timeout=180 update -q >&2 \
            && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=180 install -y -q \
                bubblewrap podman runc debootstrap catatonit uidmap >&2 && break
        log "apt-get failed (attempt $attempt)"; sleep 5
    done
    have_tools || fail "apt-get could not install bubblewrap/podman/runc/debootstrap/catatonit/uidmap"
fi

log "root filesystem (cache: $RLSYS_SANDBOX_CACHE)"
ROOTFS=$("$PY" -m sandbox.cli image --rootfs-only | sed -n 's/^RLSYS_SANDBOX_ROOTFS=//p')
[ -n "$ROOTFS" ] && [ -x "$ROOTFS/usr/bin/python3" ] || fail "building the root filesystem with debootstrap failed"

cat > "$STATE/containers.conf" <<CONF
[containers]
# The VM refuses a hard RLIMIT_NOFILE above ~20000; podman's default makes runc fail.
default_ulimits = ["nofile=1024:1024", "nproc=4096:4096"]
[engine]
# crun refuses the hybrid cgroup layout of these VMs; runc works.
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
# Without it every exec leaves conmon processes alive for 300 s.
exit_command_delay = 5
tmp_dir = "$STATE/libpod-tmp"
CONF
cat > "$STATE/storage.conf" <<CONF
[storage]
driver = "overlay"
graphroot = "$STATE/storage"
runroot = "$STATE/run"
CONF
export CONTAINERS_CONF="$STATE/containers.conf" CONTAINERS_STORAGE_CONF="$STATE/storage.conf"

ping() { DOCKER_HOST=$SOCK "$PY" -c 'import docker; docker.from_env(timeout=5).ping()' >/dev/null 2>&1; }

if ping; then
    log "podman service already answering on $SOCK"
else
    [ -f "$STATE/podman.pid" ] && kill "$(cat "$STATE/podman.pid")" 2>/dev/null
    rm -f "$STATE/podman.sock"
    log "starting podman system service on $SOCK"
    # In $STATE: conmon inherits the service's working dir and drops an `oom` file there
    # when a container runs out of memory.
    (cd "$STATE" && exec setsid podman system service --time=0 "$SOCK" > "$STATE/podman.log" 2>&1 < /dev/null) &
    echo $! > "$STATE/podman.pid"
    for _ in $(seq 60); do ping && break; sleep 0.5; done
    ping || fail "podman system service did not answer on $SOCK (see $STATE/podman.log)"
fi

log "importing the image"
DOCKER_HOST=$SOCK "$PY" -m sandbox.cli image --docker-host "$SOCK" >/dev/null \
    || fail "importing the root filesystem into podman failed"

log "smoke run on both backends"
echo 'print(6 * 7)' > "$STATE/smoke.py"
for backend in bwrap docker; do
    out=$(DOCKER_HOST=$SOCK RLSYS_SANDBOX_ROOTFS=$ROOTFS "$PY" -m sandbox.cli run "$STATE/smoke.py" --backend $backend --timeout 60)
    echo "$out" | grep -q '"stdout": "42\\n"' || fail "smoke run on the $backend backend failed: $out"
done

{
    echo "export DOCKER_HOST=$SOCK"
    echo "export RLSYS_SANDBOX_ROOTFS=$ROOTFS"
    echo "export RLSYS_SANDBOX_STATE=$STATE"
    echo "export RLSYS_SANDBOX_READY=1"
} | tee "$STATE/env"
log "sandbox ready in $((SECONDS - T0)) s"
