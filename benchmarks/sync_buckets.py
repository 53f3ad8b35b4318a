"""The object-store weight sync in buckets (`trainer.sync_bucket_mb`) against one object: the
object store's peak bytes above its idle level while the syncs run, and the time per sync, side
by side in one run. One learner actor and one rollout worker on a local Ray cluster, a Qwen2 of
8 x 512 (~100 MB fp32); the worker keeps the previous version's arrays (it serves from them)
until the new ones replace them, as in a run.

    .venv/bin/python benchmarks/sync_buckets.py [--bucket-mb 16] [--syncs 4] [--free-objects-period-ms 10]

Ray frees released objects in batches (every `free_objects_period_milliseconds`, 1 s by default):
within one sync a bucket's previous version is released at once but leaves the store only at the
next pass, so the bound shows where frees are prompt (the second flag).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo's packages before benchmarks/ (its sandbox.py is a script)


def store_bytes_used() -> int:
    """The object store's bytes in use, over every node (what `ray memory --stats-only` reads)."""
    import ray
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    state = get_state_from_address(ray.get_runtime_context().gcs_address)
    return get_memory_info_reply(state).store_stats.object_store_bytes_used


class PeakSampler:
    """The highest `store_bytes_used()` seen while the block runs (sampled every few ms)."""

    def __enter__(self):
        self.peak, self.stop = store_bytes_used(), threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, store_bytes_used())
            time.sleep(0.003)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def policy_dir(out: Path) -> str:
    from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

    tok = train_tokenizer([f"{a}+{b}={a + b}" for a in range(50) for b in range(50)], vocab_size=64)
    spec = TinyModelSpec(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4
    )
    return str(save_model_dir(build_tiny_model(spec, tok), tok, out / "policy_8x512"))


def measure(policy: str, bucket_mb: float, syncs: int) -> dict:
    """Peak store bytes above idle and seconds per sync, for `syncs` syncs at `bucket_mb`."""
    import ray

    from actors.learner import Learner
    from actors.rollout import RolloutWorker
    from algorithms.base import build_algorithm
    from rlsys.cluster import free_port
    from rlsys.config import load_config
    from rlsys.run.context import PolicyActors
    from rlsys.run.weight_sync import ObjectStoreSync

    algorithm = build_algorithm(load_config(str(ROOT / "configs/quickstart.yaml")))
    learner = ray.remote(Learner).options(num_cpus=0.5).remote(policy, algorithm, threads=1, master_port=free_port())
    worker = ray.remote(RolloutWorker).options(num_cpus=0.5).remote(policy, "hf", 64, 1, 0)
    ray.get([learner.ready.remote(), worker.policy_version.remote()])
    p = PolicyActors([worker], [learner])
    sync = ObjectStoreSync({"policy": p}, 120.0, ray.get, bucket_mb)
    sync.send(1)
    sync.settle()  # the worker now serves from store-backed arrays, as after any sync in a run
    idle = store_bytes_used()
    start = time.perf_counter()
    with PeakSampler() as sampler:
        for version in range(2, 2 + syncs):
            sync.send(version)
            sync.settle()
    seconds = (time.perf_counter() - start) / syncs
    weights_mb = sum(a.nbytes for a in ray.get(learner.weights.remote()).values()) / 2**20
    ray.kill(learner), ray.kill(worker)
    return dict(buckets=len(p.buckets), peak_mb=(sampler.peak - idle) / 2**20, idle_mb=idle / 2**20,
                seconds=seconds, weights_mb=weights_mb)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    parser.add_argument("--syncs", type=int, default=4)
    parser.add_argument(
        "--free-objects-period-ms",
        type=int,
        default=None,
        help="the raylet's RAY_free_objects_period_milliseconds for the cluster this starts (Ray's default: "
        "1000; a released object stays in the store until the next free pass)",
    )
    args = parser.parse_args()
    if args.free_objects_period_ms is not None:
        os.environ["RAY_free_objects_period_milliseconds"] = str(args.free_objects_period_ms)
    from rlsys.cluster import init_ray

    init_ray(num_cpus=2)
    policy = policy_dir(Path(tempfile.mkdtemp(prefix="rlsys-sync-buckets-")))
    whole = measure(policy, 1e6, args.syncs)
    buckets = measure(policy, args.bucket_mb, args.syncs)
    period = os.environ.get("RAY_free_objects_period_milliseconds", "1000 (Ray's default)")
    print(f"free_objects_period_milliseconds {period}")
    print(f"policy {whole['weights_mb']:.0f} MB fp32; {args.syncs} syncs each; store in use after the first sync: "
          f"{whole['idle_mb']:.0f} MB (one object) / {buckets['idle_mb']:.0f} MB (buckets)")  # fmt: skip
    print("| sync | buckets | store peak above idle, MB | x the policy | ms per sync |")
    print("|---|---:|---:|---:|---:|")
    for name, m in (("one object", whole), (f"buckets of {args.bucket_mb:g} MB", buckets)):
        print(f"| {name} | {m['buckets']} | {m['peak_mb']:.0f} | {m['peak_mb'] / m['weights_mb']:.2f} | "
              f"{m['seconds'] * 1e3:.0f} |")  # fmt: skip
    print(f"ratio buckets / one object: peak {buckets['peak_mb'] / max(whole['peak_mb'], 1e-9):.2f}x, "
          f"time {buckets['seconds'] / whole['seconds']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
