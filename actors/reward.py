"""Reward worker: rule rewards from the task, or a sequence-classification reward model.

Rule path: decode each response and call `task.reward(row, text)` with the row stored in
the experience's `meta`; a task with `shaping` (config `task.shaping`, envs/rewards.py) has
its reward shaped from the response's token ids (cosine length reward, repetition penalty).
Model path: `AutoModelForSequenceClassification` from a local directory scores prompt +
response (the logit of its single label).
"""
from __future__ import annotations

import json

import pyarrow as pa
import torch

from actors.modeling import pad_sequences, quiet_transformers


class RewardWorker:
    def __init__(self, tokenizer_dir: str, task=None, reward_model_dir: str | None = None, threads: int = 1):
        from rlsys.models import load_tokenizer

        torch.set_num_threads(threads)
        quiet_transformers()
        if (task is None) == (reward_model_dir is None):
            raise ValueError("RewardWorker needs exactly one of a task (rule reward) or a reward model dir")
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.task = task
        self.model = None
        if reward_model_dir is not None:
            from transformers import AutoModelForSequenceClassification

            self.model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, local_files_only=True).eval()

    def decode(self, table: pa.Table) -> list[str]:
        return self.tokenizer.batch_decode(table.column("response_ids").to_pylist(), skip_special_tokens=True)

    def score(self, table: pa.Table) -> list[float]:
        if self.model is not None:
            return self._model_scores(table)
        texts = self.decode(table)
        metas = [json.loads(m) for m in table.column("meta").to_pylist()]
        if getattr(self.task, "shaping", None):  # task.shaping (envs/rewards.py): token lengths and ids
            ids = table.column("response_ids").to_pylist()
            return [float(self.task.shaped_reward(meta, text, r).reward) for meta, text, r in zip(metas, texts, ids)]
        return [float(self.task.reward(meta, text)) for meta, text in zip(metas, texts)]

    @torch.no_grad()
    def _model_scores(self, table: pa.Table, batch_size: int = 32) -> list[float]:
        seqs = [p + r for p, r in zip(table.column("prompt_ids").to_pylist(), table.column("response_ids").to_pylist())]
        pad = self.tokenizer.pad_token_id or 0
        scores: list[float] = []
        for s in range(0, len(seqs), batch_size):
            ids, mask = pad_sequences(seqs[s : s + batch_size], pad, left=False)
            scores += self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float().tolist()
        return scores
