"""Forward passes shared by the learner and the reference/reward workers."""
from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn


def quiet_transformers() -> None:
    """No per-load progress bars or advisory warnings inside actors."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def target_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[:, t+1] | prefix) from logits[:, t]; shape [B, L-1]."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def forward_logprobs(model, input_ids, attention_mask, temperature: float = 1.0):
    """Run the causal LM and return (scaled logits [B,L-1,V], target logprobs [B,L-1], hidden [B,L,H])."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    logits = out.logits
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    return logits[:, :-1], target_logprobs(logits, input_ids), out.hidden_states[-1]


@dataclass
class SharedPromptPasses:
    """Rows that start with the same prompt (a GRPO group's G responses, a preference pair) run
    it once: `prefix` is the model's output over the distinct prompts, `rest` its output over
    every row's tokens after its prompt, computed on that prompt's keys and values (gradients
    flow back through them)."""

    prefix: Any              # output over the distinct prompts, [P, p, ...]
    rest: Any                # output over each row's continuation, [B, R, ...]
    row_of: torch.Tensor     # [B] the row's prompt in `prefix`
    plen: torch.Tensor       # [B] length of the row's prompt
    positions: torch.Tensor  # [B, R] sequence position of each continuation token

    def assemble(self, first: torch.Tensor, continuation: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width, ...] by sequence position: each row's last prompt position from the prompt
        pass, the rest from the continuation, zeros before (not computed per row)."""
        b = len(self.plen)
        rows = torch.arange(b, device=self.plen.device)
        out = continuation.new_zeros(b, width, *continuation.shape[2:])
        out[rows, self.plen - 1] = first[self.row_of, self.plen - 1]
        inside = self.positions < width
        out[rows[:, None].expand_as(self.positions)[inside], self.positions[inside]] = continuation[inside]
        return out

    def at(self, first: torch.Tensor, continuation: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """[B, ...]: each row's output at sequence position `index[b]`, from the prompt pass when
        that lies inside its prompt."""
        rows = torch.arange(len(self.plen), device=self.plen.device)
        in_prompt = (index < self.plen).view(-1, *[1] * (first.dim() - 2))
        from_prompt = first[self.row_of, index.clamp(max=first.shape[1] - 1)]
        from_rest = continuation[rows, (index - self.plen).clamp(min=0, max=continuation.shape[1] - 1)]
        return torch.where(in_prompt, from_prompt, from_rest)


def shared_prompt_passes(model, input_ids, attention_mask, plen: torch.Tensor, **forward_kwargs) -> SharedPromptPasses | None:
    """Run each distinct prompt (a row's first `plen[b]` tokens) through `model` once, then every
    row's remaining tokens on its prompt's cache with their true positions. Rows are
    right-padded. None when no prompt repeats or some row has nothing after its prompt (the plain
    forward is then as cheap)."""
    b = input_ids.shape[0]
    lengths = attention_mask.sum(1)
    if bool((plen >= lengths).any()) or bool((plen < 1).any()):
        return None
    p = int(plen.max())
    keyed = torch.where(torch.arange(p, device=input_ids.device)[None] < plen[:, None], input_ids[:, :p], -1)
    distinct, row_of = torch.unique(keyed, dim=0, return_inverse=True)
    if len(distinct) == b:
        return None
    prompt_mask = distinct.ge(0).long()
    prefix = model(input_ids=distinct.clamp(min=0), attention_mask=prompt_mask, use_cache=True, **forward_kwargs)
    cache = prefix.cache
    cache.batch_select_indices(row_of)  # each row reads its prompt's keys and values
    positions = plen[:, None] + torch.arange(int((lengths - plen).max()), device=input_ids.device)[None]  # [B, R]
    real = positions < lengths[:, None]
    rest_ids = torch.where(real, input_ids.gather(1, positions.clamp(max=input_ids.shape[1] - 1)), 0)
    rest = model(input_ids=rest_ids, attention_mask=torch.cat([prompt_mask[row_of], real.long()], 1),
                 position_ids=positions, cache=cache, use_cache=True, **forward_kwargs)
    return SharedPromptPasses(prefix, rest, row_of, plen, positions)


def shared_prompt_logprobs(model, input_ids, attention_mask, response_mask, temperature: float = 1.0,
                           hidden: bool = False):
    """`forward_logprobs`' (logits, logprobs[, last hidden state]) for rows that share prompts,
    each distinct prompt run once (`shared_prompt_passes`); the prompt ends where
    `response_mask` starts. Positions before a row's last prompt token are not computed (zeros,
    as no loss reads them). None when no prompt repeats."""
    length = input_ids.shape[1]
    plen = response_mask.gt(0).float().argmax(1) + 1  # the first response token's target index + 1
    passes = shared_prompt_passes(model, input_ids, attention_mask, plen, output_hidden_states=hidden)
    if passes is None:
        return None
    logits = passes.assemble(passes.prefix.logits, passes.rest.logits, length - 1)  # t predicts the token at t + 1
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    if not hidden:
        return logits, logprobs
    return logits, logprobs, passes.assemble(passes.prefix.hidden_states[-1], passes.rest.hidden_states[-1], length)


def response_logprobs(model, input_ids, attention_mask, response_mask=None, temperature: float = 1.0,
                      hidden: bool = False):
    """(scaled logits [B,L-1,V], target logprobs [B,L-1][, last hidden state [B,L,H]]), valid at
    least where `response_mask` is set: prompts that several rows share run once
    (`shared_prompt_logprobs`); without a mask, or with no repeated prompt, the plain forward
    (valid everywhere)."""
    shared = None if response_mask is None else shared_prompt_logprobs(
        model, input_ids, attention_mask, response_mask, temperature, hidden)
    if shared is not None:
        return shared
    out = forward_logprobs(model, input_ids, attention_mask, temperature)
    return out if hidden else out[:2]


class PolicyWithValueHead(nn.Module):
    """A causal LM with a scalar value head on its last hidden state (PPO's critic).
    V at position t is the value of the state whose next token is input_ids[t+1]."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, temperature: float = 1.0, response_mask=None):
        """With `response_mask`, prompts shared by several rows run once (values, like logits,
        then hold only from each row's last prompt position on)."""
        logits, logprobs, hidden = response_logprobs(self.policy, input_ids, attention_mask, response_mask,
                                                     temperature, hidden=True)
        values = self.value_head(hidden[:, :-1].float()).squeeze(-1)
        return logits, logprobs, values


class PolicyOnly(nn.Module):
    """The same call signature as PolicyWithValueHead, without a critic."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids, attention_mask, temperature: float = 1.0, response_mask=None):
        """With `response_mask` (the learner's batches), prompts shared by several rows run once."""
        return (*response_logprobs(self.policy, input_ids, attention_mask, response_mask, temperature), None)


def tied_names(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> the earlier name whose tensor it is (tied weights: a model's lm_head and its
    embedding), judged by storage, offset, shape and strides."""
    first: dict[tuple, str] = {}
    tied = {}
    for name, t in tensors.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


def tied_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module.state_dict()` with tied names (an lm_head that is the embedding) given the same
    tensor object, so that what is built from it (a numpy dict, a shared-memory layout) holds them once."""
    state = module.state_dict()
    tied = tied_names(state)
    return {k: state[tied[k]] if k in tied else v for k, v in state.items()}


def state_dict_numpy(module: nn.Module, copy: bool = True) -> dict[str, np.ndarray]:
    """Weights as numpy arrays: the object store moves these zero-copy (torch tensors are pickled).
    numpy has no bfloat16: bf16 weights (a bf16 CUDA learner) come out as float32. With
    `copy=False`, CPU float32 weights come out as views of the live parameters (valid until
    they change; a Ray actor method's return value is serialized before its next call).
    Tied names (an lm_head that is the embedding) get the same array object, which pickle, and
    so Ray, sends once."""
    def to_numpy(v: torch.Tensor) -> np.ndarray:
        v = v.detach().cpu()
        out = (v.float() if v.dtype == torch.bfloat16 else v).numpy()
        return out.copy() if copy else out

    converted: dict[int, np.ndarray] = {}  # id of a tensor object -> its array (tied names: one)
    out: dict[str, np.ndarray] = {}
    for k, v in tied_state_dict(module).items():
        if id(v) not in converted:
            converted[id(v)] = to_numpy(v)
        out[k] = converted[id(v)]
    return out


def _matched(targets: dict[str, torch.Tensor], weights: dict) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) per target name, sources as tensors (numpy arrays, possibly read-only
    object-store views, are wrapped, not copied); a missing or misshapen source is named."""
    missing = set(targets) - set(weights)
    if missing:
        raise KeyError(f"weights lack {len(missing)} tensors, e.g. {sorted(missing)[0]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # non-writable numpy views are only read
        for name, target in targets.items():
            src = weights[name]
            src = src if isinstance(src, torch.Tensor) else torch.from_numpy(src)
            if src.shape != target.shape:
                raise ValueError(f"weight {name}: shape {tuple(src.shape)} != {tuple(target.shape)}")
            yield target, src


@torch.no_grad()
def load_numpy_state(module: nn.Module, weights: dict[str, np.ndarray]) -> None:
    """Copy numpy weights (possibly read-only object-store views) or tensors (a weight
    broadcast) into the module in place."""
    for tensor, src in _matched(module.state_dict(), weights):
        tensor.copy_(src)


@torch.no_grad()
def adopt_numpy_state(module: nn.Module, weights: dict[str, np.ndarray]) -> None:
    """Point an inference-only module's parameters at the given arrays without copying (the
    object store's read-only buffers, kept alive by the tensors): a weight sync then costs no
    copy into the model. Arrays of another dtype, and buffers, are copied as `load_numpy_state` does."""
    params = dict(module.named_parameters(remove_duplicate=False))  # tied weights: each name
    buffers = {name: t for name, t in module.state_dict().items() if name not in params}
    for tensor, src in _matched(buffers, weights):
        tensor.copy_(src)
    seen = set()
    for param, src in _matched(params, weights):
        if id(param) in seen:  # a tied parameter is set once, under its first name
            continue
        seen.add(id(param))
        param.data = src if (src.dtype, src.device) == (param.dtype, param.device) else src.to(param.device, param.dtype)


def pad_sequences(seqs: list[list[int]], pad_id: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        if left:
            ids[i, L - len(s):] = torch.tensor(s)
            mask[i, L - len(s):] = 1
        else:
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
    return ids, mask


def prompt_aligned_chunks(prompts: list, size: int) -> list[tuple[int, int]]:
    """(start, stop) chunks of at most `size` rows that end where the prompt changes when they can,
    so the rows of a group (consecutive rows with one prompt) meet in one chunk and its prompt
    runs once (a run longer than `size` is cut at `size`)."""
    chunks, start = [], 0
    while start < len(prompts):
        stop = min(start + size, len(prompts))
        if stop < len(prompts) and prompts[stop - 1] == prompts[stop]:
            run_start = stop - 1
            while run_start > start and prompts[run_start - 1] == prompts[stop]:
                run_start -= 1
            stop = run_start if run_start > start else stop
        chunks.append((start, stop))
        start = stop
    return chunks


@torch.no_grad()
def per_response_tokens(forward, table, batch_size: int = 64, pad_id: int = 0) -> list[list[float]]:
    """Run `forward(input_ids, attention_mask, response_span) -> [B, L-1] tensor` over an
    Experience table in chunks and cut each row's response span out of the result.
    `response_span` [B, L-1] is 1 at every response token's target index (environment tokens
    of a multi-turn response included), so a forward may skip what lies before it."""
    from rlsys.batch import collate, response_slices

    out: list[list[float]] = []
    for start, stop in prompt_aligned_chunks(table.column("prompt_ids").to_pylist(), batch_size):
        chunk = table.slice(start, stop - start)
        batch = collate(chunk, pad_id)
        slices = response_slices(chunk)
        span = torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)
        for i, s in enumerate(slices):
            span[i, s] = 1.0
        values = forward(batch.input_ids, batch.attention_mask, span)
        out += [values[i, s].tolist() for i, s in enumerate(slices)]
    return out
