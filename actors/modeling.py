"""The actors' model wrappers (policy with or without a value head) and weight movement (numpy
state dicts, tied weights, in-place loads); the shared logprob forward lives in rlsys/logprobs.py."""

from __future__ import annotations

import itertools
import os
import types
import warnings
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from rlsys.batch import collate, response_slices
from rlsys.logprobs import response_logprobs
from rlsys.packing import AUTO_PACK_TOKENS, packed_logprobs, packing_pays, plan_microbatches


def quiet_transformers() -> None:
    """No per-load progress bars or advisory warnings inside actors."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def enable_activation_checkpointing(model: nn.Module) -> int:
    """Checkpoint each decoder layer of `model` (learner.gradient_checkpointing): in a training
    forward with gradients a layer keeps only its inputs and runs again in the backward
    (torch's non-reentrant checkpoint), for the same logprobs and gradients with less activation
    memory. Returns the number of layers (the modules that are transformers'
    `GradientCheckpointingLayer`s); ValueError when the model has none.

    Not transformers' `activation_checkpointing_enable`: that turns `use_cache` off in training,
    and the learner's shared-prompt forward (rlsys/logprobs.py `shared_prompt_passes`) needs the
    prompt pass's cache, whose keys and values carry gradients to the prompt. Here the cache
    stays on: a layer that writes it is recomputed on the cache as it was before the layer's
    forward, and the cache is put back as it was after the recompute (`_replaying`), so the
    backward neither appends to it twice nor reads keys the later pass added. The layers'
    state dict names are unchanged (each layer's `forward` is replaced on the instance)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers to checkpoint (no GradientCheckpointingLayer)")
    for layer in layers:
        layer.forward = types.MethodType(_checkpointed_layer_forward, layer)  # a deepcopy rebinds it to the copy
    return len(layers)


def _checkpointed_layer_forward(self, *args, **kwargs):
    """A decoder layer's forward under torch's non-reentrant checkpoint when it trains with
    gradients (transformers' condition), else as it is."""
    forward = partial(type(self).forward, self)  # transformers' own checkpointing is off: the plain forward
    if not (self.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return checkpoint(_replaying(forward, cache), *args, use_reentrant=False, **kwargs)


def _replaying(forward: Callable, cache) -> Callable:
    """`forward` for a checkpoint when the layer may write a KV cache (DynamicCache: its layers
    rebind their tensors, never write into them). The first call is the forward and notes which
    cache layers it changed and their state before it; each later call (the recompute in the
    backward, after later passes changed the cache) runs on that earlier state and then puts the
    cache back as it found it."""
    if cache is None:
        return forward
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    kinds = {type(cache)} | {type(layer) for layer in cache.layers}
    if not kinds <= {DynamicCache, DynamicLayer, DynamicSlidingWindowLayer}:
        raise TypeError(
            f"activation checkpointing on a {type(cache).__name__} with {sorted(k.__name__ for k in kinds)}: only a "
            "DynamicCache of dynamic (full or sliding) layers can be replayed in the backward"
        )
    layers = list(cache.layers)  # a cache made without a config appends its layers as they first write
    before: list[dict] | None = [dict(layer.__dict__) for layer in layers]
    written: list[tuple[int, dict]] | None = None  # (index, state before the forward) of the layers it changed

    def run(*args, **kwargs):
        nonlocal before, written
        if written is None:  # the forward
            out = forward(*args, **kwargs)
            written = [(i, state) for i, state in enumerate(before) if _changed(layers[i], state)]
            before = None  # keep only the states a recompute needs
            return out
        live_layers = list(cache.layers)
        live = [(i, dict(layers[i].__dict__)) for i, _ in written]
        cache.layers[:] = layers
        for i, state in written:
            _set_state(layers[i], state)
        try:
            return forward(*args, **kwargs)
        finally:  # also when the checkpoint stops the recompute early
            cache.layers[:] = live_layers
            for i, state in live:
                _set_state(layers[i], state)

    return run


def _changed(layer, state: dict) -> bool:
    now = layer.__dict__
    return now.keys() != state.keys() or any(now[k] is not v for k, v in state.items())


def _set_state(layer, state: dict) -> None:
    layer.__dict__.clear()
    layer.__dict__.update(state)


class PolicyWithValueHead(nn.Module):
    """A causal LM with a scalar value head on its last hidden state (PPO's critic).
    V at position t is the value of the state whose next token is input_ids[t+1]."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, temperature: float = 1.0, response_mask=None, packed: bool = False):
        """With `response_mask`, prompts shared by several rows run once (values, like logits,
        then hold only from each row's last prompt position on). `packed`: the rows run as one
        packed sequence (rlsys/packing.py `packed_logprobs`), the outputs in the padded layout."""
        if packed:
            logits, logprobs, hidden = packed_logprobs(self.policy, input_ids, attention_mask, temperature, hidden=True)
        else:
            logits, logprobs, hidden = response_logprobs(
                self.policy, input_ids, attention_mask, response_mask, temperature, hidden=True
            )
        values = self.value_head(hidden[:, :-1].float()).squeeze(-1)
        return logits, logprobs, values


class PolicyOnly(nn.Module):
    """The same call signature as PolicyWithValueHead, without a critic."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids, attention_mask, temperature: float = 1.0, response_mask=None, packed: bool = False):
        """With `response_mask` (the learner's batches), prompts shared by several rows run once;
        `packed`: the rows run as one packed sequence (rlsys/packing.py), each its own prompt."""
        if packed:
            return (*packed_logprobs(self.policy, input_ids, attention_mask, temperature), None)
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
    """`tensors_numpy` of the module's state dict (tied names: one array)."""
    return tensors_numpy(tied_state_dict(module), copy)


def tensors_numpy(tensors: dict[str, torch.Tensor], copy: bool = True) -> dict[str, np.ndarray]:
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
    for k, v in tensors.items():
        if id(v) not in converted:
            converted[id(v)] = to_numpy(v)
        out[k] = converted[id(v)]
    return out


def _matched(
    targets: dict[str, torch.Tensor], weights: dict, partial: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(target, source) per target name, sources as tensors (numpy arrays, possibly read-only
    object-store views, are wrapped, not copied); a missing or misshapen source is named.
    `partial`: `weights` is one bucket of a sync, the targets it lacks are left alone."""
    missing = set(targets) - set(weights)
    if missing and not partial:
        raise KeyError(f"weights lack {len(missing)} tensors, e.g. {sorted(missing)[0]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # non-writable numpy views are only read
        for name, target in targets.items():
            if name not in weights:
                continue
            src = weights[name]
            src = src if isinstance(src, torch.Tensor) else torch.from_numpy(src)
            if src.shape != target.shape:
                raise ValueError(f"weight {name}: shape {tuple(src.shape)} != {tuple(target.shape)}")
            yield target, src


@torch.no_grad()
def size_buckets(sizes: dict[str, int], limit_bytes: float) -> list[list[str]]:
    """Names in order, grouped into runs whose sizes (bytes) sum to at most `limit_bytes`; a
    tensor larger than the limit is a bucket of its own."""
    buckets, total = [[]], 0
    for name, size in sizes.items():
        if buckets[-1] and total + size > limit_bytes:
            buckets.append([])
            total = 0
        buckets[-1].append(name)
        total += size
    return buckets if buckets[0] else []


def unknown_tensors(targets: dict, bucket: dict) -> None:
    """KeyError naming a tensor of a sync's bucket that the model does not have."""
    unknown = [k for k in bucket if k not in targets]
    if unknown:
        raise KeyError(f"a weights bucket holds {len(unknown)} tensors the model lacks, e.g. {unknown[0]}")


def load_numpy_state(module: nn.Module, weights: dict[str, np.ndarray], partial: bool = False) -> None:
    """Copy numpy weights (possibly read-only object-store views) or tensors (a weight
    broadcast) into the module in place (`partial`: some of them, one bucket of a sync)."""
    targets = module.state_dict()
    if partial:
        unknown_tensors(targets, weights)
    for tensor, src in _matched(targets, weights, partial):
        tensor.copy_(src)


@torch.no_grad()
def adopt_numpy_state(module: nn.Module, weights: dict[str, np.ndarray], partial: bool = False) -> None:
    """Point an inference-only module's parameters at the given arrays without copying (the
    object store's read-only buffers, kept alive by the tensors): a weight sync then costs no
    copy into the model. Arrays of another dtype, and buffers, are copied as `load_numpy_state` does.
    `partial`: some of the tensors (one bucket of a sync); the others keep what they hold."""
    params = dict(module.named_parameters(remove_duplicate=False))  # tied weights: each name
    buffers = {name: t for name, t in module.state_dict().items() if name not in params}
    if partial:
        unknown_tensors(params | buffers, weights)
    for tensor, src in _matched(buffers, weights, partial):
        tensor.copy_(src)
    seen = set()
    for param, src in _matched(params, weights, partial):
        if id(param) in seen:  # a tied parameter is set once, under its first name
            continue
        seen.add(id(param))
        param.data = (
            src if (src.dtype, src.device) == (param.dtype, param.device) else src.to(param.device, param.dtype)
        )


def pad_sequences(seqs: list[list[int]], pad_id: int, left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), L), dtype=torch.long)
    for i, s in enumerate(seqs):
        if left:
            ids[i, L - len(s) :] = torch.tensor(s)
            mask[i, L - len(s) :] = 1
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
def per_response_tokens(
    forward, table, batch_size: int = 64, pad_id: int = 0, max_tokens: int | None = None, auto_pack: bool = False
):
    """Run `forward(input_ids, attention_mask, response_span, packed) -> [B, L-1] tensor` over an
    Experience table in chunks and cut each row's response span out of the result.
    `response_span` [B, L-1] is 1 at every response token's target index (environment tokens
    of a multi-turn response included), so a forward may skip what lies before it. Chunks of
    `batch_size` consecutive rows run padded (`packed` False); under `max_tokens` the rows go in
    chunks of at most that many real tokens (`plan_microbatches`: a prompt group kept whole), each
    run as one packed sequence (`packed` True): no padding, whatever the spread of lengths. With
    `auto_pack` (and no `max_tokens`) a padded chunk that packing pays for (`packing_pays`) runs
    so instead, in chunks of AUTO_PACK_TOKENS."""
    prompts = table.column("prompt_ids").to_pylist()
    lengths = [len(p) + len(r) for p, r in zip(prompts, table.column("response_ids").to_pylist())]
    groups = list(itertools.accumulate(int(i > 0 and p != prompts[i - 1]) for i, p in enumerate(prompts)))
    out: list[list[float]] = [[] for _ in prompts]

    def score(rows: list[int], batch=None, packed: bool = False) -> None:
        chunk = table.take(rows)
        batch = collate(chunk, pad_id) if batch is None else batch
        slices = response_slices(chunk)
        span = torch.zeros(batch.input_ids.shape[0], batch.input_ids.shape[1] - 1)
        for i, s in enumerate(slices):
            span[i, s] = 1.0
        values = forward(batch.input_ids, batch.attention_mask, span, packed)
        for i, (row, s) in enumerate(zip(rows, slices)):
            out[row] = values[i, s].tolist()

    def packed_chunks(rows: list[int], budget: int) -> None:
        for part in plan_microbatches([lengths[r] for r in rows], [groups[r] for r in rows], budget):
            score([rows[i] for i in part], packed=True)

    if max_tokens is not None:
        packed_chunks(list(range(len(prompts))), max_tokens)
        return out
    for start, stop in prompt_aligned_chunks(prompts, batch_size):
        rows = list(range(start, stop))
        batch = collate(table.take(rows), pad_id)
        if auto_pack and packing_pays(batch):
            packed_chunks(rows, AUTO_PACK_TOKENS)
        else:
            score(rows, batch)
    return out
