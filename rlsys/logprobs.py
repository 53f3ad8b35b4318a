"""Log-probabilities of a causal LM's own tokens: the forward pass every part shares (the
learner's policy, the reference and reward workers, the SFT warm-up). Pure tensor code over any
HF-style model; no actor or algorithm state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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

    prefix: Any  # output over the distinct prompts, [P, p, ...]
    rest: Any  # output over each row's continuation, [B, R, ...]
    row_of: torch.Tensor  # [B] the row's prompt in `prefix`
    plen: torch.Tensor  # [B] length of the row's prompt
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


def prompt_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """Each row's prompt length: the first response token's target index + 1."""
    return response_mask.gt(0).float().argmax(1) + 1


def keyed_prompts(input_ids: torch.Tensor, plen: torch.Tensor) -> torch.Tensor:
    """Each row's prompt (its first `plen[b]` tokens), -1 after its end: [B, max plen], equal
    rows for equal prompts."""
    p = int(plen.max())
    return torch.where(torch.arange(p, device=input_ids.device)[None] < plen[:, None], input_ids[:, :p], -1)


def repeated_prompts(input_ids, attention_mask, plen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the distinct prompts, -1 after each one's end, [P, max plen]; each row's prompt index
    [B]) when some prompt repeats and every row has tokens after its prompt; else None."""
    if bool((plen >= attention_mask.sum(1)).any()) or bool((plen < 1).any()):
        return None
    distinct, row_of = torch.unique(keyed_prompts(input_ids, plen), dim=0, return_inverse=True)
    return None if len(distinct) == len(input_ids) else (distinct, row_of)


def shared_prompt_passes(
    model, input_ids, attention_mask, plen: torch.Tensor, **forward_kwargs
) -> SharedPromptPasses | None:
    """Run each distinct prompt (a row's first `plen[b]` tokens) through `model` once, then every
    row's remaining tokens on its prompt's cache with their true positions. Rows are
    right-padded. None when no prompt repeats or some row has nothing after its prompt (the plain
    forward is then as cheap)."""
    if model.training and torch.is_grad_enabled() and getattr(model, "is_activation_checkpointing", False):
        return None  # transformers' own checkpointing turns the cache off (actors/modeling.py's keeps it)
    repeated = repeated_prompts(input_ids, attention_mask, plen)
    if repeated is None:
        return None
    distinct, row_of = repeated
    lengths = attention_mask.sum(1)
    prompt_mask = distinct.ge(0).long()
    prefix = model(input_ids=distinct.clamp(min=0), attention_mask=prompt_mask, use_cache=True, **forward_kwargs)
    cache = prefix.cache
    cache.batch_select_indices(row_of)  # each row reads its prompt's keys and values
    positions = plen[:, None] + torch.arange(int((lengths - plen).max()), device=input_ids.device)[None]  # [B, R]
    real = positions < lengths[:, None]
    rest_ids = torch.where(real, input_ids.gather(1, positions.clamp(max=input_ids.shape[1] - 1)), 0)
    rest = model(
        input_ids=rest_ids,
        attention_mask=torch.cat([prompt_mask[row_of], real.long()], 1),
        position_ids=positions,
        cache=cache,
        use_cache=True,
        **forward_kwargs,
    )
    return SharedPromptPasses(prefix, rest, row_of, plen, positions)


def shared_prompt_logprobs(
    model, input_ids, attention_mask, response_mask, temperature: float = 1.0, hidden: bool = False
):
    """`forward_logprobs`' (logits, logprobs[, last hidden state]) for rows that share prompts,
    each distinct prompt run once (`shared_prompt_passes`); the prompt ends where
    `response_mask` starts. Positions before a row's last prompt token are not computed (zeros,
    as no loss reads them). None when no prompt repeats."""
    length = input_ids.shape[1]
    plen = prompt_lengths(response_mask)
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


def response_logprobs(
    model, input_ids, attention_mask, response_mask=None, temperature: float = 1.0, hidden: bool = False
):
    """(scaled logits [B,L-1,V], target logprobs [B,L-1][, last hidden state [B,L,H]]), valid at
    least where `response_mask` is set: prompts that several rows share run once
    (`shared_prompt_logprobs`); without a mask, or with no repeated prompt, the plain forward
    (valid everywhere)."""
    shared = (
        None
        if response_mask is None
        else shared_prompt_logprobs(model, input_ids, attention_mask, response_mask, temperature, hidden)
    )
    if shared is not None:
        return shared
    out = forward_logprobs(model, input_ids, attention_mask, temperature)
    return out if hidden else out[:2]


@torch.no_grad()
def mismatch_metrics(learner_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """How far the sampler's logprobs are from the learner's on the same tokens (before the
    update), over the tokens where `mask` is 1: `mismatch/logprob_abs`, the token mean of
    |log pi_behav - log pi_learner|, and `mismatch/kl`, KL(pi_behav || pi_learner) by the k3
    estimator on the sampled tokens (r - 1 - log r with r = pi_learner / pi_behav, >= 0)."""
    log_r = (learner_logprobs - behaviour_logprobs) * mask
    tokens = mask.sum().clamp(min=1.0)
    return {
        "mismatch/logprob_abs": (log_r.abs().sum() / tokens).item(),
        "mismatch/kl": ((torch.exp(log_r) - 1.0 - log_r) * mask).sum().item() / tokens.item(),
    }
