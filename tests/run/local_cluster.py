"""A multi-node Ray cluster on one machine for the tests: a head and worker nodes each started
with `ray start --block` in its own process group (loopback, token auth, ports of its own), so a
test can add a node mid-run and kill one as a lost machine would go (its raylet, object store
and workers at once)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_jobs import cluster_env

from rlsys.cluster import free_port

RAY = str(Path(sys.executable).parent / "ray")


class LocalCluster:
    """`LocalCluster(temp, head_cpus=1)`, then `add_node(name, cpus, resources)`; `kill(name)`
    and `shutdown()`. `address` is the GCS address a run's `ray.address` takes; `env` the
    environment (token) its processes need; `dashboard` the head's Ray Jobs address (with
    `jobs=True`). `system_config`: RAY_* settings every node gets."""

    def __init__(
        self, temp: Path, head_cpus: int = 1, head_resources: dict | None = None, jobs: bool = False, **system_config
    ):
        self.temp = temp
        self.env = cluster_env(temp) | {f"RAY_{k}": str(v) for k, v in system_config.items()}
        self.address = f"127.0.0.1:{free_port()}"
        self.nodes: dict[str, subprocess.Popen] = {}
        head = ["--head", f"--port={self.address.split(':')[1]}", f"--temp-dir={temp}"]
        if jobs:
            port = free_port()
            self.dashboard = f"http://127.0.0.1:{port}"
            head += ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={port}"]
        else:
            head += ["--include-dashboard=false"]
        self._start("head", head_cpus, head_resources or {}, head)

    def add_node(self, name: str, cpus: int, resources: dict) -> None:
        """A worker node offering `cpus` logical CPUs and the custom `resources`, once the cluster
        counts it alive (nodes joining at the same moment can be left out: one at a time)."""
        # a temp dir of its own: nodes sharing one would garbage-collect each other's job working dirs
        self._start(name, cpus, resources, [f"--address={self.address}", f"--temp-dir={self.temp / name}"])
        self.wait_alive(len(self.nodes))

    def _start(self, name: str, cpus: int, resources: dict, role: list[str]) -> None:
        ports = ["node-manager", "object-manager", "dashboard-agent-listen", "dashboard-agent-grpc"]
        ports += ["runtime-env-agent", "metrics-export"]  # every node on one machine needs its own
        command = [RAY, "start", *role, f"--num-cpus={cpus}", f"--resources={json.dumps(resources)}"]
        command += ["--block", "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
        command += [f"--{p}-port={free_port()}" for p in ports]
        self.nodes[name] = subprocess.Popen(
            command, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        if name == "head":
            time.sleep(3)

    def alive(self) -> int:
        """How many nodes the cluster counts alive (asked from a fresh driver)."""
        ask = "import ray; ray.init(address=%r); print(sum(n['Alive'] for n in ray.nodes()))" % self.address
        out = subprocess.run([sys.executable, "-c", ask], env=self.env, capture_output=True, text=True)
        return int(out.stdout.strip() or 0)

    def wait_alive(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.alive() != count:
            assert time.monotonic() < deadline, f"the cluster did not reach {count} alive nodes"
            time.sleep(1)

    def kill(self, name: str) -> None:
        """SIGKILL the node's process group: its raylet, object store and workers die at once."""
        node = self.nodes.pop(name)
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()

    def shutdown(self) -> None:
        """SIGTERM every node, then SIGKILL what is left after a few seconds: a test cluster's state is
        thrown away, and Ray's orderly stop takes ~30 s on 2 cores."""
        for name in reversed(list(self.nodes)):  # worker nodes first, the head last
            os.killpg(self.nodes[name].pid, signal.SIGTERM)
        for node in self.nodes.values():
            try:
                node.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
        self.nodes.clear()
