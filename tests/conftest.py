"""Shared fixtures. One embedded Ray cluster per test session (ray.init costs 6-9 s)."""

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.chdir(ROOT)  # configs/ paths in tests are relative to the repo root


RAY_TEMP = Path("/tmp") / f"rlsys-test-ray-{os.getpid()}"


def _ray_auth_before_any_import() -> None:
    """Ray reads its auth settings when first imported, and a test module may import it (e.g.
    through rlsys.run.controller) before the first test that starts the cluster: set them now."""
    from rlsys.cluster import ray_env_for_local

    RAY_TEMP.mkdir(parents=True, exist_ok=True)
    for k, v in ray_env_for_local(RAY_TEMP).items():
        os.environ.setdefault(k, v)


_ray_auth_before_any_import()


def pytest_collection_modifyitems(items):
    """A test that uses the Ray cluster is an integration test (`make test-fast` leaves them out)."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _release_finished_actors(request):
    """After a test on the Ray cluster, collect what it left unreachable: a run's actors end when
    their last handle goes, so the next test finds the cluster's CPUs free."""
    yield
    if "ray_cluster" in request.fixturenames:
        import gc

        gc.collect()


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    from rlsys.cluster import init_ray

    init_ray(num_cpus=4, temp_dir=str(RAY_TEMP))
    import ray

    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def in_process_learners():
    """Modules whose tests build DeepSpeed learners in the test process: their process group is
    closed after the module (DeepSpeed's close, which also drops the groups it cached), so a
    later module's learner starts clean."""
    yield
    import deepspeed.comm

    if deepspeed.comm.is_initialized():
        deepspeed.comm.destroy_process_group()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run many small ops: one torch thread is faster and steadier on a shared
    2-core machine (two threads contend). Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def sandbox_skip_reason(name: str) -> str:
    """Why the sandbox tests for backend `name` skip here, or "" when they run."""
    if os.environ.get("RLSYS_SANDBOX_SETUP_ERROR"):
        return "sandbox setup failed: " + os.environ["RLSYS_SANDBOX_SETUP_ERROR"]
    if not os.environ.get("RLSYS_SANDBOX_READY"):
        return "RLSYS_SANDBOX_READY unset: source the output of .ci/setup_sandbox.sh"
    from sandbox.base import unavailable

    return unavailable(name)


@pytest.fixture(scope="module", params=["bwrap", "docker"])
def sandbox_backend(request):
    """A real sandbox backend, each of bwrap and docker in turn (one instance per test
    module: for docker, one warm container reused across runs)."""
    why = sandbox_skip_reason(request.param)
    if why:
        pytest.skip(why)
    from sandbox import make_backend

    backend = make_backend(request.param)
    yield backend
    backend.close()
