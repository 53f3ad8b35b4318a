"""Connecting to Ray: an embedded local cluster on loopback, or an existing address.

Ray 2.60 turns token authentication on by default and a stale `~/.ray/auth_token` can
break a later cluster, so the auth mode is always set explicitly: an embedded cluster
gets its own temp dir and a fresh token inside it.
"""

from __future__ import annotations

import os
import random
import secrets
import socket
import sys
import tempfile
from pathlib import Path

RENDEZVOUS_PORTS = range(20000, 32768)  # above Ray's worker ports (10002-19999), below the kernel's ephemeral ones


def free_port() -> int:
    """A free TCP port (a rendezvous for torch.distributed groups), drawn from RENDEZVOUS_PORTS:
    a port the kernel hands out for outgoing connections (as bind(0) does) could be taken by any
    process's connection before the group binds it."""
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.choice(RENDEZVOUS_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in {RENDEZVOUS_PORTS.start}-{RENDEZVOUS_PORTS.stop - 1} after 200 tries")


def ray_env_for_local(temp_dir: Path) -> dict[str, str]:
    token_path = temp_dir / "auth_token"
    if not token_path.exists():
        token_path.write_text(secrets.token_hex(32))
        token_path.chmod(0o600)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}


def init_ray(address: str | None = None, num_cpus: int | None = None, temp_dir: str | None = None):
    """Ray reads its auth settings when first imported, so for an embedded cluster the
    environment is set before `import ray` (callers must not have imported it yet)."""
    quiet = dict(log_to_driver=True, logging_level="WARNING")
    address = address or os.environ.get("RAY_ADDRESS")  # set for drivers of submitted jobs
    if address:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, **quiet)
        from rlsys.experience import send_tables_as_ipc  # pyarrow: only once a cluster is up

        send_tables_as_ipc()
        return
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return
    temp = Path(temp_dir or tempfile.mkdtemp(prefix="rlsys-ray-", dir="/tmp"))
    temp.mkdir(parents=True, exist_ok=True)
    for k, v in ray_env_for_local(temp).items():
        os.environ.setdefault(k, v)
    if os.environ["RAY_AUTH_MODE"].lower() != "token":  # Ray 2.60 listens on every interface, loopback or not
        print(
            f"rlsys: warning: RAY_AUTH_MODE={os.environ['RAY_AUTH_MODE']}: the embedded Ray cluster's servers listen "
            f"on all interfaces without authentication",
            file=sys.stderr,
        )
    import ray

    cpus = max(num_cpus or os.cpu_count() or 1, 2)
    ray.init(
        num_cpus=cpus,
        include_dashboard=False,
        _temp_dir=str(temp),
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}},
        **quiet,
    )
    from rlsys.experience import send_tables_as_ipc  # pyarrow: only once a cluster is up

    send_tables_as_ipc()
