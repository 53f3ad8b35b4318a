"""Ray Jobs on a real head node started with `ray start --head` on loopback, token auth."""

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlsys.cluster import free_port
from rlsys.config import ConfigError
from rlsys.jobs import token_auth_off_loopback

TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=2",
    "task.num_train=100",
    "task.num_eval=8",
    "task.max_value=9",
    "sft.steps=2",
    "trainer.prompts_per_step=2",
    "trainer.eval_every=0",
    "rollout.max_new_tokens=3",
    "trainer.steps=2",
]


def non_loopback_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


@pytest.mark.parametrize("address", ["http://127.0.0.1:8265", "localhost:8265", "http://[::1]:8265"])
def test_loopback_addresses_are_left_alone(address, monkeypatch, capsys):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    token_auth_off_loopback(address)
    assert os.environ["RAY_AUTH_MODE"] == "disabled" and capsys.readouterr().err == ""


def test_a_non_loopback_address_gets_token_auth_or_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="no Ray auth token was found") as e:
        token_auth_off_loopback("http://10.1.2.3:8265")
    assert "\n" not in str(e.value) and "RAY_AUTH_TOKEN_PATH" in str(e.value)
    (tmp_path / "token").write_text("x" * 64)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "token"))
    token_auth_off_loopback("http://10.1.2.3:8265")
    assert os.environ["RAY_AUTH_MODE"] == "token" and "not a loopback address" in capsys.readouterr().err
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ConfigError, match="RAY_AUTH_MODE=disabled"):
        token_auth_off_loopback("10.1.2.3:8265")


def cluster_env(temp: Path) -> dict:
    """The environment of a `ray start` cluster's processes and its clients: token auth with a
    fresh token in `temp`, the venv's bin first on PATH, no inherited RAY_ADDRESS."""
    temp.mkdir(parents=True, exist_ok=True)
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def head_node():
    temp = Path(f"/tmp/rlsys-test-head-{os.getpid()}")
    env = cluster_env(temp)
    dash = free_port()
    ray_bin = str(Path(sys.executable).parent / "ray")
    # The dashboard listens on every interface (token auth on) so a test can reach it off loopback.
    # --block keeps `ray start` in the foreground as the parent of this cluster's processes, so
    # teardown stops exactly this cluster (`ray stop` would kill every Ray cluster on the machine).
    head = subprocess.Popen(
        [
            ray_bin,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={free_port()}",
            "--dashboard-host=0.0.0.0",
            f"--dashboard-port={dash}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            "--num-cpus=4",
            f"--temp-dir={temp}",
            "--include-dashboard=true",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    yield f"http://127.0.0.1:{dash}", env
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=5)  # then SIGKILL: the test cluster's state is thrown away
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()


def cli(env, *args, timeout=300):
    p = subprocess.run(
        [sys.executable, "-m", "rlsys.run.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip()


@pytest.mark.integration
def test_submit_follow_and_stop(head_node, tmp_path):
    """Two jobs side by side: one submitted with Ray's own CLI runs to the end, and rlsys's
    status and logs follow it by its id; one submitted with `rlsys submit` has an evaluator
    attached by job id and is stopped."""
    address, env = head_node
    long = cli(
        env,
        "submit",
        "configs/quickstart.yaml",
        *TINY,
        "run.name=job_b",
        "trainer.steps=1000",
        f"run.output_dir={tmp_path}",
        "--address",
        address,
    ).splitlines()[-1]
    # Ray's own CLI works too: the working dir honours .gitignore (no .venv or runs/ uploaded)
    ray_cli = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "job",
            "submit",
            "--address",
            address,
            "--working-dir",
            ".",
            "--",
            "rlsys",
            "run",
            "configs/quickstart.yaml",
            *TINY,
            "run.name=job_c",
            f"run.output_dir={tmp_path}",
            "--no-progress",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # an evaluator attached by job id (the run dir comes from the job's metadata) reports on the live job
    deadline = time.time() + 300
    while not (tmp_path / "job_b" / "cluster.json").exists():
        assert time.time() < deadline and cli(env, "status", long, "--address", address) in ("PENDING", "RUNNING")
        time.sleep(1)
    assert "attached evaluator by_id" in cli(
        env, "eval", "attach", long, "--address", address, "--name", "by_id", "--limit", "4"
    )
    assert "by_id" in cli(env, "eval", "list", long, "--address", address)
    evals = tmp_path / "job_b" / "evals.jsonl"
    while not (evals.exists() and any(json.loads(l)["evaluator"] == "by_id" for l in evals.read_text().splitlines())):
        assert time.time() < deadline, "no row from the evaluator attached by job id"
        time.sleep(1)
    row = next(json.loads(l) for l in evals.read_text().splitlines() if json.loads(l)["evaluator"] == "by_id")
    assert row["n"] == 4 and row["policy_version"] == row["step"] >= 1
    assert cli(env, "stop", long, "--address", address) == "stopped"

    out, _ = ray_cli.communicate(timeout=600)
    assert "finished 2 steps" in out, out[-3000:]
    job = re.search(r"Job '(\S+)' submitted successfully", out)[1]
    assert cli(env, "status", job, "--address", address) == "SUCCEEDED"
    assert "finished 2 steps" in cli(env, "logs", job, "--address", address)
    assert [json.loads(l)["step"] for l in (tmp_path / "job_c" / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    deadline = time.time() + 600
    while (state := cli(env, "status", long, "--address", address)) not in ("STOPPED", "FAILED", "SUCCEEDED"):
        assert time.time() < deadline
        time.sleep(1)
    assert state == "STOPPED"


@pytest.mark.integration
def test_the_dashboard_off_loopback_needs_the_token(head_node):
    """A cluster reachable from the network: the CLI warns and authenticates with the token;
    without a token it stops in one line; a request without the token is refused."""
    import urllib.error
    import urllib.request

    address, env = head_node
    ip = non_loopback_ip()
    if ip is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    remote = address.replace("127.0.0.1", ip)
    deadline = time.time() + 120
    while True:  # the head node may still be starting its dashboard
        try:
            urllib.request.urlopen(f"{remote}/api/jobs/", timeout=30)
            raise AssertionError("the dashboard answered a request without the token")
        except urllib.error.HTTPError as e:
            assert e.code in (401, 403), e.code
            break
        except urllib.error.URLError:
            assert time.time() < deadline, "the dashboard never came up"
            time.sleep(1)
    p = subprocess.run(
        [sys.executable, "-m", "rlsys.run.cli", "status", "no-such-job", "--address", remote],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "not a loopback address" in p.stderr and "Unauthenticated" not in p.stderr + p.stdout
    assert "no-such-job" in p.stderr + p.stdout  # the cluster answered (the job does not exist), authenticated
    no_token = {**env, "RAY_AUTH_TOKEN_PATH": "/nonexistent/token", "HOME": "/nonexistent"}
    p = subprocess.run(
        [sys.executable, "-m", "rlsys.run.cli", "status", "no-such-job", "--address", remote],
        env=no_token,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "no Ray auth token was found" in p.stderr and "Traceback" not in p.stderr


def test_a_cluster_whose_python_lacks_rlsys_ends_the_job_in_one_line(tmp_path):
    """The job's entrypoint as Ray's job supervisor runs it (a shell with the cluster's PATH),
    for a cluster started from a shell whose `python` is the system one: one line naming it."""
    from rlsys.jobs import entrypoint

    system = Path("/usr/bin/python3")
    if not system.exists() or subprocess.run([system, "-c", "import ray"], capture_output=True).returncode == 0:
        pytest.skip("needs a system python3 without ray")
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python").symlink_to(system)
    command = entrypoint("configs/quickstart.yaml", [f"run.output_dir={tmp_path}", "trainer.steps=1"])
    done = subprocess.run(
        ["bash", "-c", command],
        cwd=Path(__file__).resolve().parents[2],  # the job's working dir: the repository
        env={"PATH": f"{bare}:/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stdout == "", done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"rlsys: the cluster runs this job with {bare / 'python'} (Python 3.")
    assert "cannot import ray, torch, deepspeed" in line and "source .venv/bin/activate && ray start --head" in line
    assert not (tmp_path / "quickstart").exists()  # nothing ran
    ours = subprocess.run([sys.executable, "-m", "rlsys.run.preflight"], capture_output=True, text=True, timeout=60)
    assert ours.returncode == 0 and ours.stderr == ""
