# Runs INSIDE the sandbox as the unprivileged user, started as `python3 -c <this> PAYLOAD...`.
# Standard library only: the sandbox root filesystem has nothing else. It wipes the work
# dir and every other writable dir (a warm container is reused), writes the job's files, runs the job under
# rlimits, then kills every process the job left behind and wipes again.
import base64
import json
import os
import resource
import signal
import sys


def wipe(path):
    try:
        names = os.listdir(path)
    except OSError:
        return
    for name in names:
        p = os.path.join(path, name)
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)  # the job may have made it unreadable
                wipe(p)
                os.rmdir(p)
            else:
                os.unlink(p)
        except Exception:
            pass


def limit(res, soft, hard=None):
    hard = soft if hard is None else hard
    ceiling = resource.getrlimit(res)[1]
    if ceiling != resource.RLIM_INFINITY:
        soft, hard = min(soft, ceiling), min(hard, ceiling)
    resource.setrlimit(res, (soft, hard))


def oom_kills():
    """How many times the kernel's OOM killer fired in this cgroup (v1 or v2), or None."""
    for path in ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
    return None


def fail(msg):
    sys.stderr.write("rlsys-bootstrap: " + msg + "\n")
    sys.exit(125)


def hide_payload():
    """A job with secret files (the test runner's nonce): this process's memory and fds become
    root's (PR_SET_DUMPABLE 0) and its argv, which /proc/<pid>/cmdline shows to every process
    of the user, is zeroed, so the job cannot read the payload out of its parent."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    with open("/proc/self/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    arg_start, arg_end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5)
    ctypes.memset(arg_start, 0, arg_end - arg_start)


try:
    job = json.loads(base64.b64decode("".join(sys.argv[1:])))
    if job.get("secret_files"):
        hide_payload()
    WORK, TMP = job["work"], job["tmp"]
    for d in job["wipe"]:
        wipe(d)
    for name, data in job["files"].items():
        path = os.path.join(WORK, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
    with open(os.path.join(TMP, ".rlsys-stdin"), "wb") as f:
        f.write(base64.b64decode(job["stdin"]))
except Exception as e:  # noqa: BLE001 - any failure here is the sandbox's, not the job's
    fail("setup failed: %r" % (e,))

lim = job["limits"]
ooms = oom_kills() if job.get("report_oom") else None
pid = os.fork()
if pid == 0:
    try:
        stdin = os.open(os.path.join(TMP, ".rlsys-stdin"), os.O_RDONLY)
        os.unlink(os.path.join(TMP, ".rlsys-stdin"))
        os.dup2(stdin, 0)
        os.close(stdin)
        limit(resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1)  # SIGXCPU, then SIGKILL
        limit(resource.RLIMIT_FSIZE, lim["fsize"])
        limit(resource.RLIMIT_NOFILE, lim["nofile"])
        limit(resource.RLIMIT_CORE, 0)
        argv = job["argv"]
        # `python3 -E -s SCRIPT` (this interpreter's own flags) runs here, in the forked child,
        # as a fresh interpreter would run it: a second interpreter start costs ~15 ms a job.
        # Not for a job with secret files: a fork of this process holds the whole payload.
        in_process = (
            argv[0] == sys.executable and argv[1:3] == ["-E", "-s"] and len(argv) == 4 and not job.get("secret_files")
        )
        if not in_process:
            os.execv(argv[0], argv)
        with open(argv[3], "rb") as f:
            source = f.read()
    except BaseException as e:  # noqa: BLE001
        os.write(2, ("rlsys-bootstrap: exec failed: %r\n" % (e,)).encode())
        os._exit(125)
    sys.argv = argv[3:]
    main = type(sys)("__main__")
    main.__file__, main.__builtins__ = argv[3], __builtins__
    sys.modules["__main__"] = main
    del job, lim, argv, f, data
    try:
        exec(compile(source, main.__file__, "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - python3's report, without this file's frame
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)
    sys.exit(0)
_, status = os.waitpid(pid, 0)
if job["kill_leftovers"]:
    try:
        os.kill(-1, signal.SIGKILL)  # every other process of this user: the job's leftovers
    except OSError:
        pass
for d in job["wipe"]:
    wipe(d)
if ooms is not None and oom_kills() is not None:  # the host strips this line from stderr
    os.write(2, ("\nrlsys-bootstrap: oom_kill=%d\n" % (oom_kills() - ooms)).encode())
sys.exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
