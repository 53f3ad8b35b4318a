"""Every backend by name: an explicit table. It imports the backends; they and base.py (what
they share) import none of it, so there is no import cycle and no registration on import."""

from __future__ import annotations

from typing import Callable

from .base import Backend
from .bwrap import BwrapBackend
from .docker_backend import DockerBackend
from .unsafe import UnsafeSubprocessBackend

BACKENDS: dict[str, Callable[..., Backend]] = {
    "bwrap": BwrapBackend,
    "docker": DockerBackend,
    "subprocess-unsafe": UnsafeSubprocessBackend,  # no isolation at all: the benchmark floor
}


def make_backend(name: str, **config) -> Backend:
    """A backend by name: "bwrap", "docker", or "subprocess-unsafe" (no isolation at
    all; the benchmark floor)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {name!r}; choose from {backend_names()}")
    return BACKENDS[name](**config)


def backend_names() -> list[str]:
    return sorted(BACKENDS)
