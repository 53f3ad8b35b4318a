"""Attacks on the sandbox, each run against both real backends (bubblewrap and the
Docker-API engine). Every attack asserts the status a user would expect and that the
host is unaffected. Needs `.ci/setup_sandbox.sh`; skips with its reason otherwise."""

import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sandbox import ExecRequest, Limits

pytestmark = pytest.mark.sandbox
NOBODY = 65534


@pytest.fixture
def backend(sandbox_backend):
    """bwrap, then docker (tests/conftest.py); skips with the reason where one is unusable."""
    return sandbox_backend


def run(backend, code: str, **limits):
    return backend.run(ExecRequest(code, limits=Limits(**limits)))


def host_pids_with(marker: str) -> list[int]:
    """Host processes whose command line holds `marker`."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and d.name != str(os.getpid()):
            try:
                if marker.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def nobody_pids() -> list[int]:
    """Host processes running as uid 65534: a job's processes, the only ones that uid runs here."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and d.stat().st_uid == NOBODY and (d / "cmdline").read_bytes():
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


def assert_host_clean(backend):
    """No job process survives, and the sandbox still answers a trivial program quickly."""
    deadline = time.monotonic() + 3
    while nobody_pids() and time.monotonic() < deadline:  # zombies being reaped
        time.sleep(0.05)
    assert nobody_pids() == [], "job processes survived the run"
    res = run(backend, "print('alive')")
    assert (res.status, res.stdout) == ("ok", "alive\n"), res


def report(res) -> dict:
    """The JSON object an attack prints as its last stdout line."""
    assert res.stdout.strip(), res
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_infinite_loop_times_out(backend):
    res = run(backend, "while True:\n    pass\n", wall_time_s=2, cpu_time_s=30)
    assert res.status == "timeout", res
    assert "wall time" in res.error and res.wall_time < 6
    assert_host_clean(backend)


def test_fork_bomb_is_contained(backend):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    t0 = time.monotonic()
    res = run(backend, code, wall_time_s=3, processes=32)
    assert res.status == "timeout", res
    assert time.monotonic() - t0 < 15
    assert_host_clean(backend)


def test_memory_bomb_is_oom(backend):
    code = "chunks = []\nwhile True:\n    chunks.append(b'x' * (16 << 20))\n"
    res = run(backend, code, memory_mb=128, wall_time_s=20)
    assert res.status == "oom", res
    assert "memory" in res.error
    assert_host_clean(backend)


def test_cpu_burn_in_threads_hits_cpu_limits(backend):
    # hashlib releases the GIL: these threads really run in parallel.
    code = (
        "import hashlib, threading\nbuf = b'x' * (1 << 20)\n"
        "def burn():\n    while True:\n        hashlib.sha256(buf).digest()\n"
        "for _ in range(4):\n    threading.Thread(target=burn, daemon=True).start()\n"
        "threading.Event().wait()\n"
    )
    res = run(backend, code, cpu_time_s=2, wall_time_s=20, cpus=1.0)
    assert res.status == "timeout" and "cpu time" in res.error, res
    assert res.wall_time >= 1.5, "the cpu quota (1 cpu) should stretch 2 cpu-s over >= 2 s of wall time"
    # With the quota, four parallel threads get a quarter of one core, not two cores.
    code = (
        "import hashlib, threading, time, os, json\nbuf = b'x' * (1 << 20)\nstop = time.time() + 2\n"
        "def burn():\n    while time.time() < stop:\n        hashlib.sha256(buf).digest()\n"
        "ts = [threading.Thread(target=burn) for _ in range(4)]\n[t.start() for t in ts]\n[t.join() for t in ts]\n"
        "print(json.dumps({'cpu': time.process_time()}))\n"
    )
    res = run(backend, code, cpu_time_s=30, wall_time_s=20, cpus=0.25)
    assert res.status == "ok", res
    assert report(res)["cpu"] < 1.0, "a quarter of a cpu for 2 s of wall time is 0.5 cpu-s"
    assert_host_clean(backend)


def test_writing_outside_the_work_dir_fails(backend):
    marker = "rlsys-attack-" + secrets.token_hex(4)
    targets = [
        "/" + marker,
        "/etc/" + marker,
        "/usr/" + marker,
        "/root/" + marker,
        "/var/" + marker,
        str(Path.cwd() / marker),
        "/work/" + marker,
        "/tmp/" + marker,
    ]
    code = (
        f"import json\nok = []\nfor p in {targets!r}:\n    try:\n        open(p, 'w').write('x')\n"
        "        ok.append(p)\n    except OSError:\n        pass\n"
        "try:\n    open('/etc/passwd', 'a').write('evil::0:0::/:/bin/sh\\n'); ok.append('/etc/passwd')\n"
        "except OSError:\n    pass\nprint(json.dumps(ok))\n"
    )
    res = run(backend, code)
    assert res.status == "ok", res
    assert sorted(report(res)) == sorted(["/work/" + marker, "/tmp/" + marker])
    # None of it reached the host, and the job's own files went with the run.
    assert not any(Path(p).exists() for p in targets + ["/tmp/" + marker]), "a write reached the host"
    assert "evil" not in Path("/etc/passwd").read_text()


def test_filling_the_disk_hits_the_file_size_and_tmpfs_limits(backend):
    code = (
        "import json, os\nout = {}\nblock = b'x' * (1 << 20)\n"
        "def fill(path, mb):\n    try:\n        with open(path, 'wb') as f:\n            for _ in range(mb):\n"
        "                f.write(block)\n        return 'ok'\n"
        "    except OSError as e:\n        return os.strerror(e.errno)\n"
        "out['one_big_file'] = fill('/work/big', 64)\n"
        "out['many_files'] = [fill('/tmp/f%d' % i, 12) for i in range(8)]\nprint(json.dumps(out))\n"
    )
    res = run(backend, code, file_size_mb=16, tmpfs_mb=64, wall_time_s=20)
    assert res.status == "ok", res
    got = report(res)
    assert got["one_big_file"] == "File too large", got
    assert "No space left on device" in got["many_files"], got
    assert_host_clean(backend)


def test_reading_shadow_and_host_home_fails(backend, tmp_path):
    secret = secrets.token_hex(16)
    (tmp_path / "secret.txt").write_text(secret)
    home = Path.home()
    host_entries = sorted(p.name for p in home.iterdir())
    code = (
        "import json, os\nout = {}\n"
        f"for p in ['/etc/shadow', {str(tmp_path / 'secret.txt')!r}]:\n"
        "    try:\n        out[p] = open(p).read()\n    except OSError as e:\n        out[p] = type(e).__name__\n"
        f"try:\n    out['home'] = os.listdir({str(home)!r})\nexcept OSError as e:\n    out['home'] = type(e).__name__\n"
        "print(json.dumps(out))\n"
    )
    res = run(backend, code)
    assert res.status == "ok", res
    got = report(res)
    assert got["/etc/shadow"] == "PermissionError", "shadow must not be readable"
    assert secret not in res.stdout
    assert got[str(tmp_path / "secret.txt")] == "FileNotFoundError"
    seen = got["home"] if isinstance(got["home"], list) else []
    assert not set(seen) & set(host_entries) - {".bashrc", ".profile"}, "the host's home is visible"


@pytest.fixture
def listener():
    """A real TCP listener on the host's 127.0.0.1; yields (port, list of accepted peers)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.2)
    accepted, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, peer = srv.accept()
                accepted.append(peer)
                conn.close()
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], accepted
    stop.set()
    t.join()
    srv.close()


def test_network_is_off(backend, listener):
    port, accepted = listener
    probe = socket.create_connection(("127.0.0.1", port), timeout=2)  # the listener works from the host
    probe.close()
    time.sleep(0.3)
    assert len(accepted) == 1
    code = (
        "import json, socket\nout = {}\n"
        f"for name, addr in [('loopback', ('127.0.0.1', {port})), ('outside', ('1.1.1.1', 53)), "
        "('outside80', ('93.184.215.14', 80))]:\n"
        "    try:\n        socket.create_connection(addr, timeout=2).close(); out[name] = 'connected'\n"
        "    except OSError as e:\n        out[name] = type(e).__name__\n"
        "try:\n    socket.getaddrinfo('deb.debian.org', 80); out['dns'] = 'resolved'\n"
        "except OSError as e:\n    out['dns'] = type(e).__name__\n"
        "out['ifaces'] = sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:])\n"
        "print(json.dumps(out))\n"
    )
    res = run(backend, code, wall_time_s=20)
    assert res.status == "ok", res
    got = report(res)
    assert "connected" not in got.values() and got["dns"] != "resolved", got
    assert got["ifaces"] == ["lo"], got
    time.sleep(0.3)
    assert len(accepted) == 1, "the sandbox reached the host's 127.0.0.1 listener"


def test_100mb_of_output_is_truncated(backend):
    code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))\n"
    res = run(backend, code, output_bytes=1 << 20, wall_time_s=30)
    assert res.status == "killed" and "output limit" in res.error, res
    assert res.stdout_truncated and len(res.stdout) == 1 << 20
    assert res.wall_time < 10
    assert_host_clean(backend)


@pytest.mark.parametrize("how", ["setsid", "ignore_sigterm"])
def test_child_outliving_its_parent_dies_with_the_run(backend, how):
    marker = "rlsys-orphan-" + secrets.token_hex(4)
    prelude = (
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGHUP, signal.SIG_IGN)"
        if how == "ignore_sigterm"
        else "os.setsid()"
    )
    code = (
        "import os, signal, sys\n"
        "if os.fork() == 0:\n"
        f"    {prelude}\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(120)', {marker!r}])\n"
        "    os._exit(0)\n"
        "os.wait()\nprint('parent done')\n"
    )
    res = run(backend, code)
    assert res.status == "ok" and res.stdout == "parent done\n", res
    time.sleep(0.5)
    assert host_pids_with(marker) == [], "the orphan survived the run"
    assert_host_clean(backend)


def test_no_state_survives_to_the_next_run(backend):
    token = secrets.token_hex(8)
    places = ["/work/state", "/tmp/state", "/var/tmp/state", "/dev/shm/state", "/run/lock/state", "/work/sub/dir/state"]
    write = (
        f"import os\nfor p in {places!r}:\n    try:\n        os.makedirs(os.path.dirname(p), exist_ok=True)\n"
        f"        open(p, 'w').write({token!r})\n    except OSError:\n        pass\n"
        "os.makedirs('/work/locked', exist_ok=True); "
        "open('/work/locked/f', 'w').write('x'); os.chmod('/work/locked', 0)\n"
    )
    assert run(backend, write).status == "ok"
    read = (
        "import os, json\nseen = []\nfor top in ['/work', '/tmp', '/var/tmp', '/dev/shm', '/run/lock']:\n"
        "    for root, dirs, files in os.walk(top):\n        seen += [os.path.join(root, f) for f in files + dirs]\n"
        "print(json.dumps(sorted(s for s in seen if not s.endswith('main.py'))))\n"
    )
    res = run(backend, read)
    assert res.status == "ok", res
    assert report(res) == [], "files from the previous run are visible"


def test_host_processes_are_invisible(backend):
    code = (
        "import json, os\ncmds = []\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n"
        "        try:\n"
        "            cmds.append(open('/proc/%s/cmdline' % p, 'rb').read().replace(b'\\0', b' ').decode())\n"
        "        except OSError:\n            pass\nprint(json.dumps(cmds))\n"
    )
    res = run(backend, code)
    assert res.status == "ok", res
    cmds = report(res)
    assert len(cmds) <= 6, cmds  # bwrap/init, the bootstrap, the job (docker: + sleep)
    assert not any(w in c for c in cmds for w in ("pytest", "conmon", "podman system", "raylet")), cmds


def test_clock_and_hostname_cannot_change(backend):
    code = (
        "import json, socket, time\nout = {'hostname': socket.gethostname()}\n"
        "for name, act in [('clock', lambda: time.clock_settime(time.CLOCK_REALTIME, 0.0)),\n"
        "                  ('hostname_set', lambda: socket.sethostname('pwned'))]:\n"
        "    try:\n        act(); out[name] = 'changed'\n"
        "    except OSError as e:\n        out[name] = type(e).__name__\n"
        "print(json.dumps(out))\n"
    )
    host_name, wall0, mono0 = socket.gethostname(), time.time(), time.monotonic()
    res = run(backend, code)
    assert res.status == "ok", res
    got = report(res)
    assert got == {"hostname": "sandbox", "clock": "PermissionError", "hostname_set": "PermissionError"}, got
    assert socket.gethostname() == host_name
    assert abs((time.time() - wall0) - (time.monotonic() - mono0)) < 1, "the host clock jumped"


def module_syscalls_code() -> str:
    """A program that tries finit_module and delete_module through raw syscalls (there is
    no modprobe in the image) and prints each one's error, and its capabilities."""
    return (
        "import ctypes, json, os, platform\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "nr = {'x86_64': (313, 176), 'aarch64': (273, 106)}[platform.machine()]\n"
        "fd = os.open('/dev/null', os.O_RDONLY)\nout = {}\n"
        "for name, args in [('finit_module', (nr[0], fd, b'', 0)), "
        "('delete_module', (nr[1], b'rlsys_nonexistent', 0))]:\n"
        "    rc = libc.syscall(*args)\n    out[name] = os.strerror(ctypes.get_errno()) if rc else 'done'\n"
        "out['caps'] = {l.split(':')[0]: int(l.split()[1], 16) "
        "for l in open('/proc/self/status') if l.startswith('Cap')}\n"
        "print(json.dumps(out))\n"
    )


def test_kernel_module_cannot_load(backend):
    res = run(backend, module_syscalls_code())
    assert res.status == "ok", res
    got = report(res)
    # A kernel built without module support answers ENOSYS to everyone, root on the host
    # included; then the capability check below is what matters.
    host = json.loads(
        subprocess.run(
            [sys.executable, "-c", module_syscalls_code()], capture_output=True, text=True, check=True
        ).stdout
    )
    allowed = {"Operation not permitted"}
    if host["delete_module"] == "Function not implemented":
        allowed.add("Function not implemented")
    assert got["finit_module"] in allowed and got["delete_module"] in allowed, got
    assert got["caps"]["CapEff"] == got["caps"]["CapPrm"] == 0, got["caps"]
