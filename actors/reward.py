"""Reward worker: rule rewards from the task, or a sequence-classification reward model.

Rule path: decode each response and call `task.reward(row, text)` with the row stored in
the experience's `meta`; a task with `shaping` (config `task.shaping`, envs/rewards.py) has
its reward shaped from the response's token ids (cosine length reward, repetition penalty).
With a `scorer` (a `reward.function` or a reward server: envs/reward_runner.py, built where the
actor is asked for) the rows' prompts, responses and rows go to the scorer instead;
`take_metrics` hands on its per-step metrics (reward/errors, the function's own means),
`take_row_metrics` a row's own (for samples.jsonl), `heldout_rewards` scores held-out responses.
Model path: `AutoModelForSequenceClassification` from a local directory scores prompt +
response (the logit of its single label). A reward model dir with its own tokenizer (`rlsys
rm train` saves one) scores the decoded text re-encoded with it; without one, the policy's
token ids are scored as they are.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import pyarrow as pa
import torch

from actors.modeling import pad_sequences, prompt_aligned_chunks, quiet_transformers
from rlsys.logprobs import shared_prompt_passes
from rlsys.models import find_tokenizer_dir, load_tokenizer

ROW_METRICS_KEPT = 4096  # scored rows whose extra metrics wait for the samples log


class RewardWorker:
    def __init__(
        self, tokenizer_dir: str, task=None, reward_model_dir: str | None = None, threads: int = 1, scorer=None
    ):
        torch.set_num_threads(threads)
        quiet_transformers()
        if (task is None) == (reward_model_dir is None):
            raise ValueError("RewardWorker needs exactly one of a task (rule reward) or a reward model dir")
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.task = task
        self.scorer = scorer
        self.row_metrics: OrderedDict[str, dict] = OrderedDict()  # uid -> the reward function's extra metrics
        self.shaped_tokens: OrderedDict[str, list[float]] = OrderedDict()  # uid -> its shaped reward per token
        self.model = None
        if reward_model_dir is not None:
            self.reward_model = RewardModel(reward_model_dir)
            self.model = self.reward_model.model

    def state(self) -> dict:  # rule and reward-model scores are deterministic: nothing to checkpoint
        return {}

    def load_state(self, state: dict) -> None:
        pass

    def decode(self, table: pa.Table) -> list[str]:
        return self.tokenizer.batch_decode(table.column("response_ids").to_pylist(), skip_special_tokens=True)

    def score(self, table: pa.Table) -> list[float]:
        if self.model is not None:
            return self._model_scores(table)
        texts = self.decode(table)
        metas = [json.loads(m) for m in table.column("meta").to_pylist()]
        if self.scorer is not None:
            outcomes = self.scorer.score_rows([self.task.prompt_text(m) for m in metas], texts, metas)
            self.row_metrics.update(zip(table.column("uid").to_pylist(), (o.metrics for o in outcomes)))
            while len(self.row_metrics) > ROW_METRICS_KEPT:
                self.row_metrics.popitem(last=False)
            rewards = [o.reward for o in outcomes]
            correct = [r >= 1.0 for r in rewards]  # a reward function's >= 1 is a correct answer
        else:
            rewards = [float(self.task.reward(meta, text)) for meta, text in zip(metas, texts)]
            correct = [self.task.is_correct(meta, text) for meta, text in zip(metas, texts)]
        if getattr(self.task, "shaping", None):  # task.shaping (envs/rewards.py): token lengths and ids
            return self._shaped(table, rewards, correct)
        return rewards

    def _shaped(self, table: pa.Table, rewards: list[float], correct: list[bool]) -> list[float]:
        """`task.shaping` applied to the rows' rewards; the per-token form kept for `take_token_rewards`."""
        ids = table.column("response_ids").to_pylist()
        shaped = [self.task.shaping.apply(r, ok, i) for r, ok, i in zip(rewards, correct, ids)]
        self.shaped_tokens.update(zip(table.column("uid").to_pylist(), (s.token_rewards for s in shaped)))
        while len(self.shaped_tokens) > ROW_METRICS_KEPT:
            self.shaped_tokens.popitem(last=False)
        return [float(s.reward) for s in shaped]

    def take_metrics(self) -> dict[str, float]:
        """The scorer's metrics since the last call ({} for the task's own reward or a reward model)."""
        return self.scorer.take_metrics() if self.scorer is not None else {}

    def take_row_metrics(self, uids: list[str]) -> dict[str, dict[str, float]]:
        """The extra metrics a reward function returned for each of these rows (uid -> {`reward/<key>`:
        value}; the newest ROW_METRICS_KEPT scored rows are kept), for the samples log."""
        named = lambda metrics: {self.scorer.metric_name(k): v for k, v in metrics.items()}
        return {uid: named(self.row_metrics.pop(uid)) for uid in uids if uid in self.row_metrics}

    def take_token_rewards(self, uids: list[str]) -> list[list[float]] | None:
        """The per-token form of these scored rows' shaped rewards (task.shaping: a dense penalty on
        its tokens, the rest on the last token; each row's sums to its reward), or None when a row
        has none (a task without shaping)."""
        if not all(uid in self.shaped_tokens for uid in uids):
            return None
        return [self.shaped_tokens.pop(uid) for uid in uids]

    def heldout_rewards(self, texts: list[str], metas: list[dict]) -> list[float]:
        """The scorer's rewards of held-out responses, not counted in the step's metrics (a failed
        row: `reward.on_error`). A worker without a scorer scores with the task's rule."""
        if self.scorer is None:
            return [float(self.task.reward(meta, text)) for meta, text in zip(metas, texts)]
        outcomes = self.scorer.run([self.task.prompt_text(m) for m in metas], texts, metas)
        return [self.scorer.scored(o).reward for o in outcomes]

    @torch.no_grad()
    def _model_scores(self, table: pa.Table, batch_size: int = 32) -> list[float]:
        if self.reward_model.tokenizer is not None:
            prompts = self.tokenizer.batch_decode(table.column("prompt_ids").to_pylist(), skip_special_tokens=True)
            return self.reward_model.score_texts(prompts, self.decode(table))
        prompts = table.column("prompt_ids").to_pylist()
        seqs = [p + r for p, r in zip(prompts, table.column("response_ids").to_pylist())]
        scores: list[float] = []
        for start, stop in prompt_aligned_chunks(prompts, batch_size):
            scores += sequence_scores(self.model, seqs[start:stop], [len(p) for p in prompts[start:stop]]).tolist()
        return scores


class RewardModel:
    """A sequence-classification reward model from a local dir, with its own tokenizer when the
    dir has one (`<dir>/tokenizer.json`, or `<dir>/tokenizer/` as older rlsys wrote it), else
    `tokenizer`: r(x, y) = the single logit on the text x + y."""

    def __init__(self, model_dir: str, batch_size: int = 32, tokenizer=None):
        from pathlib import Path

        from transformers import AutoModelForSequenceClassification

        quiet_transformers()
        path = Path(model_dir)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} is not a reward model directory (no config.json)")
        self.model = AutoModelForSequenceClassification.from_pretrained(str(path), local_files_only=True).eval()
        has_tokenizer = find_tokenizer_dir(path) is not None
        self.tokenizer = load_tokenizer(path) if has_tokenizer else tokenizer  # else: the caller's (the policy's)
        self.batch_size = batch_size

    def score_texts(self, prompts: list[str], responses: list[str]) -> list[float]:
        """r(prompt, response) for each pair, on `prompt + response` encoded by the model's tokenizer."""
        if self.tokenizer is None:
            raise ValueError("this reward model dir has no tokenizer; score token ids through RewardWorker instead")
        return reward_scores(self.model, self.tokenizer, prompts, responses, self.batch_size)


def encode_pairs(tokenizer, prompts: list[str], responses: list[str]) -> list[list[int]]:
    """The reward model's input: `prompt + response` as one text, no special tokens (training and scoring alike)."""
    return [tokenizer(p + r, add_special_tokens=False)["input_ids"] for p, r in zip(prompts, responses)]


def prompt_lengths(tokenizer, prompts: list[str], seqs: list[list[int]]) -> list[int]:
    """How many leading tokens of each encoded `prompt + response` (`encode_pairs`) are its
    prompt's own encoding (a token merged across the boundary ends the shared part early)."""
    own = {p: tokenizer(p, add_special_tokens=False)["input_ids"] for p in set(prompts)}
    lengths = []
    for p, seq in zip(prompts, seqs):
        n = 0
        while n < min(len(own[p]), len(seq)) and own[p][n] == seq[n]:
            n += 1
        lengths.append(n)
    return lengths


def pooled_positions(ids: torch.Tensor, mask: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """Where a sequence-classification model reads its score (transformers' rule): the rightmost
    token that is not the pad id, or the last real token when the config has none."""
    if pad_id is None:
        return mask.sum(1) - 1
    return (torch.arange(ids.shape[1]) * ids.ne(pad_id)).argmax(-1)


def sequence_scores(model, seqs: list[list[int]], prompt_lens: list[int] | None = None) -> torch.Tensor:
    """The single logit per sequence (right-padded with the config's pad id; the model pools
    the last non-pad token). With `prompt_lens`, sequences that start with the same prompt (a
    group's responses, a preference pair) run it once and score on its keys and values
    (`shared_prompt_passes`; gradients flow through them)."""
    pad = model.config.pad_token_id
    ids, mask = pad_sequences(seqs, pad if pad is not None else 0, left=False)
    if prompt_lens is not None and isinstance(getattr(model, "score", None), torch.nn.Linear):
        plen = torch.minimum(torch.tensor(prompt_lens), mask.sum(1) - 1)  # the last token runs on the cache
        passes = shared_prompt_passes(getattr(model, model.base_model_prefix), ids, mask, plen)
        if passes is not None:
            last = passes.at(
                passes.prefix.last_hidden_state, passes.rest.last_hidden_state, pooled_positions(ids, mask, pad)
            )
            return model.score(last)[:, 0].float()
    return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()


@torch.no_grad()
def reward_scores(model, tokenizer, prompts: list[str], responses: list[str], batch_size: int = 32) -> list[float]:
    seqs = encode_pairs(tokenizer, prompts, responses)
    lens = prompt_lengths(tokenizer, prompts, seqs)
    scores: list[float] = []
    for start, stop in prompt_aligned_chunks(prompts, batch_size):
        scores += sequence_scores(model, seqs[start:stop], lens[start:stop]).tolist()
    return scores
