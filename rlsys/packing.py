"""Token-budget micro-batches and packed forwards (`learner.max_tokens_per_microbatch`), and the
learner ranks' shards balanced by the tokens they train on (`plan_rank_shards`).

A minibatch (one optimizer step) is cut into micro-batches whose real tokens stay within a
budget, rows that share a prompt kept together (`plan_microbatches`); each micro-batch's rows
then run as ONE sequence of batch size 1 with no padding (`pack_rows`): concatenated, with
`position_ids` restarting at 0 at each row, and `packed_logprobs` scatters the outputs back
(`unpack`) into the padded [b, L-1] layout of rlsys/batch.py, so an algorithm's
`loss(outputs, batch)` reads them as it reads the padded forward's.

Attention stays inside each row. Given restarting positions, no 2D attention mask and no cache,
transformers (5.x: `masking_utils.find_packed_sequence_indices`) reads the packing itself: eager
gets a block-diagonal causal mask, flash attention its varlen kernel. SDPA would get the same
[T, T] mask and compute every one of its T^2 scores; an SDPA model without sliding windows is
switched instead to `PACKED_SDPA` (`use_packed_attention`), which runs SDPA causally on each
row's own span of the packed sequence (no mask built) and is plain SDPA for every other call.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from rlsys.batch import TrainBatch
from rlsys.logprobs import keyed_prompts, prompt_lengths


def row_lengths(attention_mask: torch.Tensor) -> list[int]:
    """The real tokens of each right-padded row (prompt and response)."""
    return attention_mask.sum(1).tolist()


def prompt_groups(input_ids: torch.Tensor, response_mask: torch.Tensor) -> list[int]:
    """A group number per row: consecutive rows with the same prompt (the tokens before the first
    trainable target: a GRPO group's responses, a preference pair) share one."""
    if not len(input_ids):
        return []
    prompts = keyed_prompts(input_ids, prompt_lengths(response_mask))
    return [0, *(prompts[1:] != prompts[:-1]).any(1).long().cumsum(0).tolist()]


# learner.auto_pack: a minibatch runs packed when its padded forward computes more than this many
# times the token positions of its rows, in micro-batches of at most AUTO_PACK_TOKENS real tokens
# (on a 2-core CPU a long tail's 128 rows train 1.4x faster in sequences of ~4k tokens than in one)
PACKING_PAYS_ABOVE = 1.5
AUTO_PACK_TOKENS = 4096


def padded_positions(batch: TrainBatch) -> int:
    """Token positions the learner's padded forward of `batch` computes: each group's prompt once,
    to the longest prompt, then every row to the longest rest (rlsys/logprobs.py
    `shared_prompt_passes`); every row to the longest row when no prompt repeats."""
    rows, width = batch.input_ids.shape
    groups = prompt_groups(batch.input_ids, batch.response_mask)[-1] + 1
    if groups == rows:
        return rows * width
    plen = prompt_lengths(batch.response_mask)
    return groups * int(plen.max()) + rows * int((batch.attention_mask.sum(1) - plen).max())


def packing_pays(batch: TrainBatch) -> bool:
    """Whether `batch` computes fewer positions packed (its real tokens) than padded by more than
    PACKING_PAYS_ABOVE: responses of spread lengths, padded to the longest."""
    return padded_positions(batch) > PACKING_PAYS_ABOVE * int(batch.attention_mask.sum())


def group_runs(groups: Sequence[int]) -> list[list[int]]:
    """Row indices of each run of consecutive rows with one group number."""
    runs: list[list[int]] = []
    for i, g in enumerate(groups):
        if runs and groups[i - 1] == g:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def plan_rank_shards(costs: Sequence[float], groups: Sequence[int], ranks: int) -> list[list[int]]:
    """Row indices of each learner rank's shard, balanced by the rows' `costs`: whole groups (runs
    of one group number, as `plan_microbatches` keeps them), the costliest first to the rank with
    the least cost so far (ties: the one with fewer rows, then the lower rank), each shard's rows
    in batch order. Every rank gets a row: with fewer groups than ranks, nearly equal contiguous
    shards (groups cut), as `TrainBatch.split`."""
    if len(costs) != len(groups):
        raise ValueError(f"{len(costs)} row costs for {len(groups)} group numbers")
    if len(costs) < ranks:
        raise ValueError(f"{len(costs)} row(s) for {ranks} ranks")
    runs = group_runs(groups)
    if len(runs) < ranks:
        bounds = [len(costs) * r // ranks for r in range(ranks + 1)]
        return [list(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:])]
    shards: list[list[int]] = [[] for _ in range(ranks)]
    load = [0.0] * ranks
    for run in sorted(runs, key=lambda run: -sum(costs[i] for i in run)):  # stable: ties keep batch order
        rank = min(range(ranks), key=lambda r: (load[r], len(shards[r]), r))
        shards[rank] += run
        load[rank] += sum(costs[i] for i in run)
    return [sorted(rows) for rows in shards]


def plan_microbatches(lengths: Sequence[int], groups: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices of each micro-batch. A group (a run of consecutive rows with one group number)
    is never cut; groups go first-fit in decreasing size into micro-batches of at most `budget`
    tokens, and a group larger than the budget (a row longer than it, or a group whose rows
    together are) is a micro-batch of its own. Each micro-batch lists its rows in batch order,
    and the micro-batches are ordered by their first row."""
    if budget < 1:
        raise ValueError(f"a micro-batch token budget must be >= 1, not {budget}")
    if len(lengths) != len(groups):
        raise ValueError(f"{len(lengths)} row lengths for {len(groups)} group numbers")
    runs = group_runs(groups)
    tokens = [sum(lengths[i] for i in run) for run in runs]
    bins: list[list[int]] = []  # run indices
    room: list[int] = []
    for r in sorted(range(len(runs)), key=lambda r: -tokens[r]):  # stable: equal sizes keep batch order
        fits = next((b for b in range(len(bins)) if tokens[r] <= room[b]), None)
        if fits is None:
            bins.append([r])
            room.append(budget - tokens[r])
        else:
            bins[fits].append(r)
            room[fits] -= tokens[r]
    plan = [sorted(i for r in b for i in runs[r]) for b in bins]
    return sorted(plan, key=lambda rows: rows[0])


def microbatches(batch: TrainBatch, budget: int) -> list[TrainBatch]:
    """`batch` cut by `plan_microbatches` (its prompt groups kept whole), each micro-batch trimmed
    of the padding columns it does not use."""
    plan = plan_microbatches(
        row_lengths(batch.attention_mask), prompt_groups(batch.input_ids, batch.response_mask), budget
    )
    if len(plan) == 1:
        return [batch]
    return [batch.select(rows).trim() for rows in plan]


@dataclass
class PackedRows:
    """Right-padded rows [B, L] as one sequence [1, T] (T: their real tokens, row after row)."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 at each row's first token
    real: torch.Tensor  # [B, L] bool: where the padded layout holds a real token (row-major = packed order)

    @property
    def num_rows(self) -> int:
        return self.real.shape[0]


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack right-padded rows (each row's real tokens from column 0 on) into one sequence."""
    real = attention_mask.bool()
    if bool((real[:, 1:] & ~real[:, :-1]).any()):
        raise ValueError("pack_rows needs right-padded rows (each row's tokens from column 0, padding after)")
    positions = torch.arange(real.shape[1], device=input_ids.device).expand_as(input_ids)
    return PackedRows(input_ids[real][None], positions[real][None], real)


def unpack(values: torch.Tensor, packed: PackedRows, width: int | None = None) -> torch.Tensor:
    """Per-token outputs of the packed sequence [1, T, ...] back in the padded layout
    [B, width, ...] (width: L unless given, at most L): row b's token t at [b, t], zeros where
    the padded layout has padding. Differentiable (the scatter's backward is a gather)."""
    real = packed.real
    width = real.shape[1] if width is None else width
    inside = real.clone()
    inside[:, width:] = False  # the real tokens within the first `width` columns
    out = values.new_zeros(packed.num_rows, width, *values.shape[2:])
    out[inside[:, :width]] = values[0][inside[real]]  # inside[real]: those tokens in packed order
    return out


PACKED_SDPA = "rlsys_packed_sdpa"  # the attention implementation `use_packed_attention` switches to
_PACKED_CALL: ContextVar[bool] = ContextVar("rlsys_packed_call", default=False)  # inside `packed_logprobs`' forward


def row_spans(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """(start, stop) of each packed row in one sequence's positions [T]: a row starts where the
    position is not the previous one + 1 (transformers' own reading of packed positions)."""
    first = position_ids[:1] - 1
    starts = (torch.diff(position_ids, prepend=first) != 1).nonzero().flatten().tolist()
    starts = [0, *starts] if not starts or starts[0] != 0 else starts
    return list(zip(starts, [*starts[1:], len(position_ids)]))


def packed_sdpa_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention (`sdpa_attention_forward`), except on a packed sequence with
    no mask (one sequence, no cache, restarting `position_ids`: `packed_logprobs` under
    `PACKED_SDPA`, or the recompute of such a forward under activation checkpointing), where
    each row's span attends causally to itself alone: its own SDPA call, no [T, T] mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    packed = (
        attention_mask is None
        and position_ids is not None
        and query.shape[0] == 1
        and query.shape[2] == key.shape[2] > 1
        and kwargs.get("sliding_window") is None
    )
    spans = row_spans(position_ids[0]) if packed else []
    if len(spans) < 2:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    outputs = [
        sdpa_attention_forward(
            module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, is_causal=True, **kwargs
        )[0]
        for a, b in spans
    ]  # each [1, b - a, heads, head_dim]
    return torch.cat(outputs, dim=1), None


def packed_sdpa_mask(*args, **kwargs):
    """transformers' SDPA mask, or none inside `packed_logprobs`' forward (`packed_sdpa_attention`
    keeps each row to itself without one)."""
    from transformers.masking_utils import sdpa_mask

    return None if _PACKED_CALL.get() else sdpa_mask(*args, **kwargs)


def use_packed_attention(model) -> bool:
    """Switch a model on transformers' SDPA attention whose layers all attend fully (no sliding
    window) to `PACKED_SDPA`: the same attention for every call but a packed one. Returns whether
    the model now runs on it (otherwise transformers' own reading of the packing serves)."""
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == PACKED_SDPA:
        return True
    layer_types = getattr(config, "layer_types", None)
    full = (
        all(t == "full_attention" for t in layer_types)
        if layer_types
        else getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True)
    )
    if implementation != "sdpa" or not full or not hasattr(model, "set_attn_implementation"):
        return False
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, packed_sdpa_mask)
    model.set_attn_implementation(PACKED_SDPA)
    return model.config._attn_implementation == PACKED_SDPA


@contextmanager
def _packed_call():
    token = _PACKED_CALL.set(True)
    try:
        yield
    finally:
        _PACKED_CALL.reset(token)


def packed_logprobs(model, input_ids, attention_mask, temperature: float = 1.0, hidden: bool = False):
    """`forward_logprobs`' outputs (rlsys/logprobs.py) from one packed forward of the rows:
    (scaled logits [B, L-1, V], target logprobs [B, L-1][, last hidden state [B, L, H]]) in the
    padded layout, equal to the padded forward's wherever a row has a real token (and a real
    target, for the logprobs); zeros at padding. Rows sharing a prompt each run it (no
    shared-prompt pass). An SDPA model is switched to `PACKED_SDPA` first (`use_packed_attention`)."""
    use_packed_attention(model)
    packed = pack_rows(input_ids, attention_mask)
    with _packed_call():
        out = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=None,  # with no 2D mask and no cache, the positions say where each row starts
            use_cache=False,
            output_hidden_states=hidden,
        )
    logits = out.logits
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    following = torch.roll(packed.input_ids, -1, dims=1)  # a row's last token reads the next row's first: masked below
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, following[..., None]).squeeze(-1)
    width = input_ids.shape[1] - 1
    has_target = attention_mask[:, 1:].bool()
    result = (unpack(logits, packed, width), unpack(logprobs, packed, width).masked_fill(~has_target, 0.0))
    return (*result, unpack(out.hidden_states[-1], packed)) if hidden else result
