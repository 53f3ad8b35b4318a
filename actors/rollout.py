"""Rollout worker: batched generation from token ids with per-token logprobs.

The backend interface (`RolloutBackend`) is what the transformers backend here and the
vLLM backend (actors/vllm_backend.py, imported lazily) both implement:
`generate(requests) -> generations` and `load_weights(weights)`.
"""
from __future__ import annotations

import time
from typing import Protocol, Sequence

import numpy as np
import torch

from actors.modeling import load_numpy_state, pad_sequences, quiet_transformers
from rlsys.generation import Generation, GenerationRequest, SamplingParams


class RolloutBackend(Protocol):
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]: ...
    def load_weights(self, weights: dict[str, np.ndarray]) -> None: ...


def expand_requests(requests: Sequence[GenerationRequest]) -> list[tuple[int, list[int], SamplingParams]]:
    """One entry per sampled sequence: (request index, prompt ids, params), n per request."""
    return [(i, list(r.prompt_ids), r.params) for i, r in enumerate(requests) for _ in range(r.params.n)]


def length_buckets(items: list, batch_size: int, key) -> list[list[int]]:
    """Indices grouped into batches of similar `key` length (less padding per batch)."""
    order = sorted(range(len(items)), key=lambda i: key(items[i]))
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


def cut_at_stop(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], str]:
    """Response up to and including the first stop token."""
    for j, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: j + 1], "stop"
    return tokens, "length"


class HFBackend:
    """transformers `generate` with KV cache; logprobs from the raw logits / temperature."""

    def __init__(self, model_dir: str, batch_size: int = 64, model=None):
        from rlsys.models import load_model

        quiet_transformers()
        self.model = model if model is not None else load_model(model_dir)
        self.model.eval()
        self.batch_size = batch_size
        cfg = self.model.config
        eos = cfg.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else next(iter(self.eos_ids))

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        load_numpy_state(self.model, weights)

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], list[float], str]]:
        input_ids, attention_mask = pad_sequences(prompts, self.pad_id, left=True)
        stop_ids = self.eos_ids | set(params.stop_token_ids)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            temperature=None if params.greedy else params.temperature,
            top_p=None if params.greedy or params.top_p >= 1.0 else params.top_p,
            top_k=None if params.greedy or params.top_k == 0 else params.top_k,
            eos_token_id=sorted(stop_ids),
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
        )
        new_tokens = out.sequences[:, input_ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float()  # [B, T, V], before any processor
        if not params.greedy and params.temperature != 1.0:
            logits = logits / params.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens[..., None]).squeeze(-1)
        results = []
        for row, lp in zip(new_tokens.tolist(), logprobs.tolist()):
            tokens, reason = cut_at_stop(row, stop_ids)
            results.append((tokens, lp[: len(tokens)], reason))
        return results

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        seqs = expand_requests(requests)
        results: list[Generation | None] = [None] * len(seqs)
        # Batches share sampling params; requests with different params never mix.
        by_params: dict[SamplingParams, list[int]] = {}
        for k, (_, _, params) in enumerate(seqs):
            by_params.setdefault(params, []).append(k)
        for params, members in by_params.items():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for bucket in length_buckets(members, self.batch_size, key=lambda k: len(seqs[k][1])):
                idx = [members[b] for b in bucket]
                outs = self._generate_batch([seqs[k][1] for k in idx], params)
                for k, (tokens, lps, reason) in zip(idx, outs):
                    results[k] = Generation(seqs[k][0], seqs[k][1], tokens, lps, reason)
        return results


def make_backend(name: str, model_dir: str, batch_size: int, **options) -> RolloutBackend:
    if name == "hf":
        return HFBackend(model_dir, batch_size=batch_size)
    if name == "vllm":
        try:
            from actors.vllm_backend import VLLMBackend
        except ImportError as e:
            raise RuntimeError(f"rollout.backend=vllm needs the vllm extra ({e})") from None
        return VLLMBackend(model_dir, **options)
    raise ValueError(f"unknown rollout backend '{name}' (hf, vllm)")


class RolloutWorker:
    """One rollout role: a backend plus the policy version it currently holds."""

    def __init__(self, model_dir: str, backend: str = "hf", batch_size: int = 64, threads: int = 1, index: int = 0):
        torch.set_num_threads(threads)
        self.index = index
        self.backend = make_backend(backend, model_dir, batch_size)
        self.version = 0
        self.tokens_generated = 0
        self.generate_seconds = 0.0

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        start = time.perf_counter()
        gens = self.backend.generate(requests)
        self.generate_seconds += time.perf_counter() - start
        for g in gens:
            g.policy_version = self.version
            self.tokens_generated += len(g.response_ids)
        return gens

    def load_weights(self, version: int, weights: dict[str, np.ndarray]) -> int:
        self.backend.load_weights(weights)
        self.version = version
        return version

    def policy_version(self) -> int:
        return self.version

    def stats(self) -> dict:
        return {"index": self.index, "version": self.version, "tokens": self.tokens_generated, "seconds": self.generate_seconds}
