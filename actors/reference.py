"""Reference worker: a frozen copy of the initial policy that scores responses' logprobs."""
from __future__ import annotations

import pyarrow as pa
import torch

from actors.modeling import forward_logprobs, per_response_tokens, quiet_transformers


class ReferenceWorker:
    def __init__(self, model_dir: str, temperature: float = 1.0, threads: int = 1, batch_size: int = 64):
        from rlsys.models import load_model

        torch.set_num_threads(threads)
        quiet_transformers()
        self.model = load_model(model_dir).eval()
        self.temperature = temperature
        self.batch_size = batch_size

    def logprobs(self, table: pa.Table) -> list[list[float]]:
        """log pi_ref of each response token, aligned with `response_ids`."""
        forward = lambda ids, mask: forward_logprobs(self.model, ids, mask, self.temperature)[1]
        return per_response_tokens(forward, table, self.batch_size)
