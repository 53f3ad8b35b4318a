"""Calibration token ids: random windows of a text corpus (the paper uses 128 WikiText-2
segments) or, when no corpus is given, sequences sampled from the full-precision model
itself (data-free calibration)."""

from __future__ import annotations

import torch


def calibration_from_text(tokenizer, text: str, n: int, seqlen: int, seed: int = 0) -> torch.Tensor:
    """`n` random windows of `seqlen` tokens from the tokenised `text` (`[n, seqlen]`);
    a text shorter than one window gives `n` copies of the whole text."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("calibration text has no tokens")
    if ids.numel() <= seqlen:
        return ids[None].repeat(n, 1)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seqlen + 1, (n,), generator=gen)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])


def calibration_from_model(model, n: int, seqlen: int, seed: int = 0, batch_size: int = 32) -> torch.Tensor:
    """`n` sequences of `seqlen` tokens sampled (temperature 1) from `model`, each starting
    at its BOS token (`[n, seqlen]`); EOS is suppressed so every sequence is full length."""
    bos = model.config.bos_token_id if model.config.bos_token_id is not None else 0
    out = []
    with torch.random.fork_rng(), torch.no_grad():
        torch.manual_seed(seed)
        for start in range(0, n, batch_size):
            b = min(batch_size, n - start)
            prompt = torch.full((b, 1), bos, dtype=torch.long)
            seq = model.generate(
                input_ids=prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=seqlen - 1,
                min_new_tokens=seqlen - 1,
                pad_token_id=model.config.pad_token_id if model.config.pad_token_id is not None else bos,
            )
            out.append(seq[:, :seqlen])
    return torch.cat(out)
