"""Ray Jobs: submit a run to a cluster, follow it, stop it (Job Submission API).

The job's entrypoint is `python -m rlsys.run.cli run CONFIG ...` with this directory as its
working dir; its run dir is written under this directory's `runs/` (an absolute path,
so on a remote cluster that path must be shared storage, or set run.output_dir). A reward
function file (`reward.function: path/file.py:name`) outside this directory travels as a
single-file module (`reward_file_shipping`): only that file, not the modules beside it.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

EXCLUDES = [".venv", ".git", "runs", "**/__pycache__", "*.egg-info", ".cache", ".pytest_cache"]


def is_loopback(address: str) -> bool:
    host = urlparse(address if "://" in address else f"http://{address}").hostname or ""
    return host in ("127.0.0.1", "localhost", "::1")


def token_auth_off_loopback(address: str) -> None:
    """Loopback addresses are used as they are. Any other address gets a warning and Ray's
    token authentication (RAY_AUTH_MODE=token, set before Ray reads it), with a token from
    RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; without one it stops with a
    one-line error (a ConfigError) instead of talking to the cluster unauthenticated."""
    from rlsys.config import ConfigError  # pydantic: `rlsys job` commands that never validate stay light

    if is_loopback(address):
        return
    print(
        f"rlsys: warning: {address} is not a loopback address: using Ray's token authentication (RAY_AUTH_MODE=token)",
        file=sys.stderr,
    )
    if os.environ.get("RAY_AUTH_MODE", "token").lower() != "token":
        raise ConfigError(
            f"job error: {address} is not a loopback address and RAY_AUTH_MODE="
            f"{os.environ['RAY_AUTH_MODE']}: a cluster reachable from the network needs token authentication "
            f"(unset RAY_AUTH_MODE or set it to token)"
        )
    token_path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not os.environ.get("RAY_AUTH_TOKEN") and not token_path.is_file():
        raise ConfigError(
            f"job error: {address} is not a loopback address and no Ray auth token was found "
            f"(set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH to the cluster's token; looked in {token_path})"
        )
    os.environ["RAY_AUTH_MODE"] = "token"


def client(address: str):
    token_auth_off_loopback(address)  # before Ray reads RAY_AUTH_MODE
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)


def reward_file_shipping(function: str | None, workdir: str | Path = ".") -> tuple[list[str], list[str]]:
    """(py_modules, overrides) that bring a reward function file (`reward.function` as load_config
    located it: /abs/path/file.py:name) to the job. One under `workdir` travels with the working
    dir, named relative to it; one outside travels alone as a single-file py_module, imported on
    the cluster by its file name (so that name must be a free module name)."""
    from rlsys.config import ConfigError  # pydantic: `rlsys job` commands that never validate stay light

    target, _, name = (function or "").rpartition(":")
    if not target.endswith(".py"):
        return [], []
    path, workdir = Path(target).resolve(), Path(workdir).resolve()
    if path.is_relative_to(workdir):
        return [], [f"reward.function={path.relative_to(workdir)}:{name}"]
    if not path.stem.isidentifier() or importlib.util.find_spec(path.stem) is not None:
        raise ConfigError(
            f"config error: reward.function {path} is outside the working directory {workdir}, so it travels as the "
            f"module '{path.stem}', which is {'taken' if path.stem.isidentifier() else 'not a module name'}: rename "
            f"the file or move it under {workdir}"
        )
    return [str(path)], [f"reward.function={path.stem}:{name}"]


def entrypoint(config: str, overrides: list[str]) -> str:
    """The job's shell command: the cluster's `python` is checked first (rlsys/run/preflight.py: one
    line naming it where it lacks rlsys's packages), then runs the job."""
    run = ["python", "-m", "rlsys.run.cli", "run", config, *overrides, "--no-progress"]
    return "python -m rlsys.run.preflight && " + " ".join(shlex.quote(a) for a in run)


def submit(
    address: str,
    config: str,
    overrides: list[str],
    workdir: str = ".",
    metadata: dict | None = None,
    py_modules: list[str] = (),
) -> str:
    workdir = Path(workdir).resolve()
    deadline = time.time() + 120
    while True:
        try:
            return client(address).submit_job(
                entrypoint=entrypoint(config, [f"run.output_dir={workdir / 'runs'}", *overrides]),
                runtime_env={
                    "working_dir": str(workdir),
                    "excludes": EXCLUDES,
                    **({"py_modules": list(py_modules)} if py_modules else {}),
                },
                metadata=metadata,
            )
        except (ConnectionError, RuntimeError) as e:
            # a head node that is still starting refuses connections, then has no job agent for a while
            starting = isinstance(e, ConnectionError) or "No available agent" in str(e)
            if not starting or time.time() > deadline:
                raise
            time.sleep(2)


def status(address: str, job_id: str) -> str:
    return str(client(address).get_job_status(job_id).value)


def wait(address: str, job_id: str, timeout: float = 3600.0, poll: float = 1.0) -> str:
    terminal = {"SUCCEEDED", "FAILED", "STOPPED"}
    deadline = time.time() + timeout
    while (s := status(address, job_id)) not in terminal:
        if time.time() > deadline:
            raise TimeoutError(f"job {job_id} still {s} after {timeout:.0f} s")
        time.sleep(poll)
    return s


def logs(address: str, job_id: str, follow: bool = False) -> None:
    c = client(address)
    if not follow:
        sys.stdout.write(c.get_job_logs(job_id))
        return
    import asyncio

    async def tail():
        async for chunk in c.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    asyncio.run(tail())


def stop(address: str, job_id: str) -> bool:
    return client(address).stop_job(job_id)
