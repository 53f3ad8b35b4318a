"""Reference worker: a frozen copy of the initial policy that scores responses' logprobs.
An algorithm whose KL anchor moves (BRiTE's P(.|x, theta_t)) loads the current policy into
it (`load_weights(weights)`); checkpoints then keep that anchor (`save`, and on resume
`load_weights(None, dir)`)."""

from __future__ import annotations

import pyarrow as pa
import torch

from actors.lora import MergedAdapters, is_adapter_state
from actors.modeling import load_numpy_state, per_response_tokens, quiet_transformers
from rlsys.logprobs import response_logprobs
from rlsys.models import load_model


class ReferenceWorker:
    def __init__(self, model_dir: str, temperature: float = 1.0, threads: int = 1, batch_size: int = 64):
        torch.set_num_threads(threads)
        quiet_transformers()
        self.model = load_model(model_dir).eval()
        self.adapters = None  # MergedAdapters once a LoRA policy is loaded (a moved KL anchor under learner.lora)
        self.temperature = temperature
        self.batch_size = batch_size

    def load_weights(self, weights: dict | None, model_dir: str | None = None) -> None:
        """Hold these weights (numpy, by name; LoRA adapters merged into the initial weights) or,
        when None, the model saved in `model_dir`."""
        if weights is None:
            self.model = load_model(model_dir).eval()
            self.adapters = None
        elif is_adapter_state(weights):
            self.adapters = self.adapters or MergedAdapters(self.model)
            self.adapters.load(weights)
        else:
            load_numpy_state(self.model, weights)

    def save(self, path: str) -> None:
        self.model.save_pretrained(path)

    def logprobs(self, table: pa.Table) -> list[list[float]]:
        """log pi_ref of each response token, aligned with `response_ids`."""
        forward = lambda ids, mask, span: response_logprobs(self.model, ids, mask, span, self.temperature)[1]
        return per_response_tokens(forward, table, self.batch_size)

    def top_logprobs(self, table: pa.Table, k: int = 0) -> list[tuple[list[list[int]], list[list[float]]]]:
        """The k most likely next tokens (all of them when k is 0) and their log pi at each
        response position: a distillation teacher's distribution, one (ids, logprobs) per row."""

        def forward(ids, mask, span):
            logp = torch.log_softmax(
                response_logprobs(self.model, ids, mask, span, self.temperature)[0].float(), dim=-1
            )
            top = logp.topk(k or logp.shape[-1], dim=-1)
            return torch.cat([top.indices.float(), top.values], dim=-1)  # ids < 2**24 are exact in float32

        rows = per_response_tokens(forward, table, self.batch_size)
        width = len(rows[0][0]) // 2 if rows and rows[0] else 0
        return [([[int(i) for i in t[:width]] for t in r], [t[width:] for t in r]) for r in rows]
