"""Weight sync by broadcast: learner rank 0 -> rollout workers over a dedicated process group.

The group is not the learner's DeepSpeed world: it is its own rendezvous (a TCPStore on
learner rank 0's host) joined by learner rank 0 as rank 0 and by every rollout receiver
(an HF rollout worker, or each tensor-parallel worker inside a vLLM engine) as ranks
1..world-1. It is NCCL when the tensors live on CUDA and gloo on CPU; the code is the same.

One sync is: a header tensor [version, number of tensors] broadcast first, then the
weights packed into flat same-dtype buckets (`bucket_plan`), each one broadcast, then the
tensors' checksums (rlsys/weight_digest.py). A receiver checks the version it was told
against the header, so a receiver that is one sync behind fails loudly instead of serving
mixed weights, and what it received against the checksums (WeightsCorrupt naming the tensor). The controller bounds the
whole exchange by `trainer.sync_timeout_s` (WeightSyncTimeout), as for the object store.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Iterable, Sequence

import torch

from rlsys.errors import WeightsCorrupt
from rlsys.weight_digest import as_int64, first_mismatch, from_int64, tensor_hash

DEFAULT_BUCKET_BYTES = 256 << 20


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.torch_dtype).element_size()


def weight_manifest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """Names, shapes and dtypes, in send order: what a receiver allocates before a sync."""
    return [TensorSpec(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in named_tensors]


def bucket_plan(manifest: Sequence[TensorSpec], max_bytes: int = DEFAULT_BUCKET_BYTES) -> list[list[int]]:
    """Indices of the manifest grouped into buckets: one dtype per bucket, consecutive
    tensors, at most `max_bytes` unless a single tensor is larger (it then goes alone).
    Sender and receivers compute the same plan from the same manifest."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, spec in enumerate(manifest):
        if not buckets or spec.dtype != dtype or size + spec.nbytes > max_bytes:
            buckets.append([])
            size, dtype = 0, spec.dtype
        buckets[-1].append(i)
        size += spec.nbytes
    return buckets


class BroadcastGroup:
    """One member of the weight-broadcast process group (rank 0 sends, the others receive)."""

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        timeout_s: float,
        device: torch.device | str = "cpu",
        local_addr: str | None = None,
    ):
        """`local_addr`: this member's own address for gloo's transport (its Ray node IP);
        by default the master's when that is loopback, else gloo's default interface."""
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight broadcast backend {backend!r} (allowed: gloo, nccl)")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore("rlsys-weight-broadcast", store)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            host = local_addr or (master_addr if master_addr in ("127.0.0.1", "localhost") else None)
            options._devices = [
                dist.ProcessGroupGloo.create_device(hostname=host)
                if host
                else dist.ProcessGroupGloo.create_default_device()
            ]
            self.group = dist.ProcessGroupGloo(store, rank, world_size, options)
        else:
            torch.cuda.set_device(self.device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, options)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self.group.broadcast(tensor, 0).wait()

    def send(self, version: int, tensors: Sequence[torch.Tensor], max_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
        """Rank 0: broadcast `version` and the tensors (in manifest order). Returns the bytes sent."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 of the weight-broadcast group sends")
        self._broadcast(torch.tensor([version, len(tensors)], dtype=torch.int64, device=self.device))
        manifest = weight_manifest((str(i), t) for i, t in enumerate(tensors))
        sent = 0
        with torch.no_grad():
            for bucket in bucket_plan(manifest, max_bytes):
                flat = torch.cat([tensors[i].detach().reshape(-1).to(self.device) for i in bucket])
                self._broadcast(flat)
                sent += flat.numel() * flat.element_size()
        self._broadcast(as_int64(tensor_hash(t) for t in tensors).to(self.device))  # the checksums, last
        return sent

    def receive(
        self, version: int, manifest: Sequence[TensorSpec], max_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> list[tuple[str, torch.Tensor]]:
        """Ranks > 0: the tensors of one sync as (name, tensor) on this member's device, in
        manifest order. Raises if the sender's version or tensor count is not the expected one
        (a wrong version is still received in full, so the other members are not held up)."""
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._broadcast(header)
        got_version, count = (int(x) for x in header.tolist())
        mismatch = (
            f"weight broadcast: expected version {version} with {len(manifest)} tensors, "
            f"the learner sent version {got_version} with {count}"
        )
        if count != len(manifest):  # another manifest: the group cannot stay in step
            raise RuntimeError(mismatch)
        out: list[tuple[str, torch.Tensor]] = []
        for bucket in bucket_plan(manifest, max_bytes):
            specs = [manifest[i] for i in bucket]
            flat = torch.empty(sum(s.numel for s in specs), dtype=specs[0].torch_dtype, device=self.device)
            self._broadcast(flat)
            offset = 0
            for s in specs:
                out.append((s.name, flat[offset : offset + s.numel].view(s.shape)))
                offset += s.numel
        hashes = torch.zeros(count, dtype=torch.int64, device=self.device)
        self._broadcast(hashes)
        if got_version != version:  # received in full (the group stays in step), then refused
            raise RuntimeError(mismatch)
        bad = first_mismatch(dict(zip((s.name for s in manifest), from_int64(hashes))), dict(out))
        if bad is not None:
            raise WeightsCorrupt(f"weights of version {version} arrived corrupt: tensor {bad} fails its checksum")
        return out
