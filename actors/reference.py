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
from rlsys.packing import packed_logprobs


class ReferenceWorker:
    def __init__(
        self,
        model_dir: str,
        temperature: float = 1.0,
        threads: int = 1,
        batch_size: int = 64,
        max_tokens_per_batch: int | None = None,
        auto_pack: bool = False,
    ):
        """`batch_size` rows per padded forward, or under `max_tokens_per_batch` (the run's
        learner.max_tokens_per_microbatch) packed forwards of at most that many real tokens;
        `auto_pack` (learner.auto_pack): a padded batch that packing pays for runs packed."""
        torch.set_num_threads(threads)
        quiet_transformers()
        self.model = load_model(model_dir).eval()
        self.adapters = None  # MergedAdapters once a LoRA policy is loaded (a moved KL anchor under learner.lora)
        self.temperature = temperature
        self.batch_size = batch_size
        self.max_tokens_per_batch = max_tokens_per_batch
        self.auto_pack = auto_pack

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
        return self._per_response(lambda ids, mask, span, packed: self._forward(ids, mask, span, packed)[1], table)

    def top_logprobs(self, table: pa.Table, k: int = 0) -> list[tuple[list[list[int]], list[list[float]]]]:
        """The k most likely next tokens (all of them when k is 0) and their log pi at each
        response position: a distillation teacher's distribution, one (ids, logprobs) per row."""

        def forward(ids, mask, span, packed):
            logp = torch.log_softmax(self._forward(ids, mask, span, packed)[0].float(), dim=-1)
            top = logp.topk(k or logp.shape[-1], dim=-1)
            return torch.cat([top.indices.float(), top.values], dim=-1)  # ids < 2**24 are exact in float32

        rows = self._per_response(forward, table)
        width = len(rows[0][0]) // 2 if rows and rows[0] else 0
        return [([[int(i) for i in t[:width]] for t in r], [t[width:] for t in r]) for r in rows]

    def _forward(self, ids, mask, span, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(scaled logits [B, L-1, V], target logprobs [B, L-1]): the rows as one packed sequence, or
        padded with each prompt shared by several rows run once."""
        if packed:
            return packed_logprobs(self.model, ids, mask, self.temperature)
        return response_logprobs(self.model, ids, mask, span, self.temperature)

    def _per_response(self, forward, table: pa.Table) -> list:
        return per_response_tokens(
            forward, table, self.batch_size, max_tokens=self.max_tokens_per_batch, auto_pack=self.auto_pack
        )
