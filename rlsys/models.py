"""Model and tokenizer factory: tiny decoders from a config, a BPE trained locally, and
`from_pretrained` of any local HF directory. Nothing is downloaded.

A model directory rlsys writes holds its tokenizer beside the weights (`tokenizer.json`,
`tokenizer_config.json`, `chat_template.jinja`), so `AutoModelForCausalLM.from_pretrained(dir)`
and `AutoTokenizer.from_pretrained(dir)` both load it. rlsys itself loads the tokenizer with
`PreTrainedTokenizerFast` (tokenizer.json as it is); `tokenizer_config.json` names that class so
AutoTokenizer does the same, except for model types whose tokenizer class transformers imposes
(qwen2: `Qwen2Tokenizer` rebuilds the pipeline from the vocabulary and merges with its own
normalizer and pre-tokenizer, which `train_tokenizer` therefore uses). Directories with the
tokenizer in a `tokenizer/` subfolder still load through `load_tokenizer`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, get_args

import torch

from rlsys.config import Architecture, ConfigError
from rlsys.quantize.slim_format import CONFIG_FILE as QUANTIZED_CONFIG
from rlsys.quantize.slim_format import load_dense

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


# Qwen2's pre-tokenizer: contractions, letters (with one leading non-letter), single digits,
# punctuation runs, newlines, spaces (transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX)
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per message; the generation prompt opens the assistant's turn
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 512, min_frequency: int = 1, split_digits: bool = True):
    """Train a byte-level BPE on `texts` and wrap it as a `PreTrainedTokenizerFast` with a ChatML
    chat template. `split_digits` keeps every digit its own token, so numbers are spelled digit by
    digit; it uses Qwen2's NFC normalizer and pre-tokenizer, so a qwen2 model dir tokenizes the same
    through AutoTokenizer (`split_digits=False`: GPT-2's byte-level pre-tokenizer). The chat tokens
    `<|im_start|>` and `<|im_end|>` are appended after training, so the trained ids do not depend
    on them; the vocabulary, chat tokens included, has at most `vocab_size` entries (unless the
    256-byte alphabet and the special tokens alone exceed it)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if split_digits:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(CHAT_TOKENS),
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        extra_special_tokens=CHAT_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )


def find_tokenizer_dir(path: str | os.PathLike) -> Path | None:
    """Where the tokenizer of model dir `path` is: `path` itself when it holds `tokenizer.json`,
    else a `tokenizer/` subfolder that does (the layout of run dirs written by older rlsys); None
    when neither does."""
    path = Path(path)
    for candidate in (path, path / "tokenizer"):
        if (candidate / "tokenizer.json").is_file():
            return candidate
    return None


def load_tokenizer(path: str | os.PathLike):
    """Load the tokenizer of a model dir (`tokenizer.json` in the dir or in its `tokenizer/`
    subfolder) as a `PreTrainedTokenizerFast`."""
    from transformers import PreTrainedTokenizerFast

    found = find_tokenizer_dir(path)
    if found is None:
        raise FileNotFoundError(f"no tokenizer.json in {path} (nor in {Path(path) / 'tokenizer'})")
    return PreTrainedTokenizerFast.from_pretrained(str(found))


def load_policy_tokenizer(path: str | os.PathLike):
    """The tokenizer of a policy a run starts from (`model.path`): a ConfigError when it has no eos
    token (responses, warm-up targets and turns end with it); one without a pad token (Llama's,
    Mistral's) pads with its eos, as transformers' own generation does."""
    tokenizer = load_tokenizer(path)
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"config error: model.path {path}: its tokenizer has no eos token (set eos_token in its "
            "tokenizer_config.json): responses could not end"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def save_tokenizer(tokenizer, path: str | os.PathLike) -> Path:
    """`save_pretrained` of the tokenizer into model dir `path` (tokenizer.json,
    tokenizer_config.json, chat_template.jinja when it has a template), its class recorded as
    `PreTrainedTokenizerFast` so AutoTokenizer reads tokenizer.json as it is rather than the model
    type's own class (transformers 5 writes the generic backend's name, `TokenizersBackend`,
    which transformers 4 does not know)."""
    path = Path(path)
    tokenizer.save_pretrained(str(path))
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") in (None, "TokenizersBackend", "PreTrainedTokenizerFast"):
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return path


def appended_chat_tokens(tokenizer) -> int:
    """How many tokens `train_tokenizer` appended after training (the chat tokens, last in the
    vocabulary); 0 for a tokenizer without them there."""
    if tokenizer is None:
        return 0
    n, k = len(tokenizer), len(CHAT_TOKENS)
    return k if tokenizer.convert_tokens_to_ids(CHAT_TOKENS) == list(range(n - k, n)) else 0


def init_model(from_config, config, tokenizer=None, seed: int = 0):
    """`from_config(config)` with weights drawn under `seed` as for the vocabulary without the
    tokens appended after training, whose embedding rows are drawn last: every other weight
    is the same with or without them."""
    extra = appended_chat_tokens(tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        config.vocab_size -= extra
        model = from_config(config)
        if extra:
            model.resize_token_embeddings(config.vocab_size + extra, mean_resizing=False)
    return model


def build_tiny_model(spec: TinyModelSpec, tokenizer=None, seed: int = 0):
    """A randomly initialised causal LM of `spec`. With a tokenizer, vocab and special ids follow it."""
    from transformers import AutoModelForCausalLM

    vocab = len(tokenizer) if tokenizer is not None else spec.vocab_size
    return init_model(AutoModelForCausalLM.from_config, spec.config(vocab, tokenizer, use_cache=True), tokenizer, seed)


def save_model_dir(model, tokenizer, path: str | os.PathLike) -> Path:
    """`save_pretrained` (safetensors) of the model and of the tokenizer, both at `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    if tokenizer is not None:
        save_tokenizer(tokenizer, path)
    return path


def load_model(path: str | os.PathLike, dtype=torch.float32):
    """`AutoModelForCausalLM.from_pretrained` of a local directory; never reaches a hub. A
    quantised directory (`rlsys quantize`) loads dequantised, as its own reader loads it."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    if (path / QUANTIZED_CONFIG).exists():
        return load_dense(path, dtype)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
