"""Code execution in a sandbox: `make_backend(name).run(ExecRequest) -> ExecResult`.

Backends: "bwrap" (bubblewrap on the sandbox root filesystem), "docker" (the Docker
Engine API: Docker or podman), and "subprocess-unsafe" (no isolation; benchmark floor
only). `SandboxPool` (sandbox.pool) runs many requests on Ray workers. This package
imports nothing else of rlsys."""

from .backends import backend_names, make_backend
from .base import Backend, unavailable
from .types import STATUSES, ExecRequest, ExecResult, Limits, TestCase, TestResult

__all__ = [
    "Backend",
    "ExecRequest",
    "ExecResult",
    "Limits",
    "STATUSES",
    "TestCase",
    "TestResult",
    "backend_names",
    "make_backend",
    "unavailable",
]
