"""Model and tokenizer factory: tiny decoders from a config, a BPE trained locally, and
`from_pretrained` of any local HF directory. Nothing is downloaded.

The tokenizer is always saved in its own folder (`<dir>/tokenizer`) and loaded with
`PreTrainedTokenizerFast`: with transformers 5.x, `AutoTokenizer` on a folder whose
config says qwen2 returns Qwen2's tokenizer class with different ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, get_args

import torch

from rlsys.config import Architecture

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]


ARCHITECTURES = get_args(Architecture)


@dataclass
class TinyModelSpec:
    """Sizes of a tiny Llama-family decoder (`architecture`: a transformers model type of
    ARCHITECTURES, Qwen2 by default). Defaults give ~1M parameters with a 512 vocab."""

    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True
    architecture: str = "qwen2"

    def config(self, vocab_size: int, tokenizer=None, **extra):
        """The transformers config of these sizes (head_dim = hidden / heads; no sliding window)."""
        from transformers import AutoConfig

        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r}: the tiny factory builds {', '.join(ARCHITECTURES)}")
        fields = dict(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.hidden_size // self.num_attention_heads,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings,
            sliding_window=None,
            pad_token_id=getattr(tokenizer, "pad_token_id", 0),
            bos_token_id=getattr(tokenizer, "bos_token_id", 1),
            eos_token_id=getattr(tokenizer, "eos_token_id", 2),
        )
        return AutoConfig.for_model(self.architecture, **{**fields, **extra})

    @classmethod
    def from_config(cls, model) -> "TinyModelSpec":
        """The sizes in a job config's `model` section (its `path` aside)."""
        return cls(**model.model_dump(exclude={"path"}))


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512, min_frequency: int = 1, split_digits: bool = True):
    """Train a byte-level BPE on `texts` and wrap it as a `PreTrainedTokenizerFast`.
    `split_digits` keeps every digit its own token, so numbers are spelled digit by digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if split_digits
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )


def load_tokenizer(path: str | os.PathLike):
    """Load a tokenizer saved by `save_model_dir` (its own folder) or any fast tokenizer dir."""
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    if (path / "tokenizer").is_dir():
        path = path / "tokenizer"
    if not (path / "tokenizer.json").exists():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def build_tiny_model(spec: TinyModelSpec, tokenizer=None, seed: int = 0):
    """A randomly initialised causal LM of `spec`. With a tokenizer, vocab and special ids follow it."""
    from transformers import AutoModelForCausalLM

    vocab = len(tokenizer) if tokenizer is not None else spec.vocab_size
    config = spec.config(vocab, tokenizer, use_cache=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model


def save_model_dir(model, tokenizer, path: str | os.PathLike) -> Path:
    """`save_pretrained` (safetensors) of the model at `path`, the tokenizer at `path/tokenizer`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path / "tokenizer"))
    return path


def load_model(path: str | os.PathLike, dtype=torch.float32):
    """`AutoModelForCausalLM.from_pretrained` of a local directory; never reaches a hub."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
