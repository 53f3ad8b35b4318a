"""vLLM worker extension (`worker_extension_cls="actors.vllm_worker.RlsysWorkerExtension"`).

vLLM mixes this class into each of its GPU workers (one per tensor-parallel rank), so
`self.model_runner.model` and `self.device` are the worker's; `LLM.collective_rpc(name,
args=...)` calls a method here on every worker. This is vLLM's public route for in-place
weight updates (its RLHF examples, verl, OpenRLHF and TRL use it) and does not depend on
the engine's internal attribute paths. The module imports without vllm.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from actors.shared_weights import BF16, BF16_BITS, bf16_from_bits
from actors.weight_broadcast import BroadcastGroup, TensorSpec


def engine_tensor(array, dtype: torch.dtype, device) -> torch.Tensor:
    """A numpy array (possibly a read-only object-store view) or tensor as a tensor of the
    engine's dtype on its device. numpy has no bfloat16: fp32 arrays are converted here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # non-writable numpy views are only read
        t = torch.from_numpy(np.asarray(array)) if not isinstance(array, torch.Tensor) else array
    return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)


def arrays_from_payload(payload) -> list[tuple[str, np.ndarray | torch.Tensor]]:
    """The inverse of actors.vllm_backend.weight_payload: (name, dtype, shape, bytes) -> (name,
    array), bf16 entries as torch tensors (numpy has no bfloat16)."""
    out = []
    for name, dtype, shape, data in payload:
        if dtype == BF16:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # a read-only buffer, only read
                out.append((name, bf16_from_bits(np.frombuffer(data, dtype=BF16_BITS)).reshape(shape)))
        else:
            out.append((name, np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)))
    return out


class RlsysWorkerExtension:
    def _rlsys_model(self):
        return self.model_runner.model

    def rlsys_load_weights(self, payload) -> int:
        """Load (HF name, dtype, shape, bytes) entries in place; vLLM's loaders stack and shard them."""
        model = self._rlsys_model()
        dtype = next(model.parameters()).dtype
        weights = [(name, engine_tensor(array, dtype, self.device)) for name, array in arrays_from_payload(payload)]
        model.load_weights(weights=weights)
        return len(weights)

    def rlsys_open_broadcast(
        self, master_addr: str, master_port: int, first_rank: int, world_size: int, timeout_s: float
    ) -> int:
        """Join the weight-broadcast group as rank first_rank + this worker's rank in the engine."""
        rank = first_rank + int(self.rank)
        self.rlsys_broadcast = BroadcastGroup(
            master_addr, master_port, rank, world_size, "nccl", timeout_s, device=self.device
        )
        return rank

    def rlsys_receive_broadcast(self, version: int, manifest: Sequence[tuple[str, list[int], str]]) -> int:
        specs = [TensorSpec(name, tuple(shape), dtype) for name, shape, dtype in manifest]
        received = self.rlsys_broadcast.receive(version, specs)
        self._rlsys_model().load_weights(weights=received)
        return version
