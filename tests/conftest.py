"""Shared fixtures. One embedded Ray cluster per test session (ray.init costs 6-9 s)."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.chdir(ROOT)  # configs/ paths in tests are relative to the repo root


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    from rlsys.cluster import init_ray

    init_ray(num_cpus=4, temp_dir=str(Path("/tmp") / f"rlsys-test-ray-{os.getpid()}"))
    import ray

    yield ray
    ray.shutdown()
