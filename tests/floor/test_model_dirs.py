"""Model directories rlsys writes (`policy_init/`, a checkpoint's `hf/` export, `rlsys quantize`
output) load with the standard pair `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained(dir)`
(a quantised dir with `trust_remote_code=True`: it carries its own reader) in a fresh process
that imports nothing of rlsys, and generate the same tokens as rlsys's own loader; the trained
tokenizer carries a ChatML template; a dir with its tokenizer in a `tokenizer/` subfolder (as
older rlsys wrote it) still loads through `load_tokenizer`."""

import json
import os
import subprocess
import sys

import pytest
import torch

from rlsys.models import (
    CHAT_TOKENS,
    SPECIAL_TOKENS,
    TinyModelSpec,
    build_tiny_model,
    load_model,
    load_tokenizer,
    save_model_dir,
    train_tokenizer,
)
from rlsys.quantize.cli import main as quantize_main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CODE = "def add(a, b):\n    return a+b  # sum\n\n\nprint(add(2, 3))  (ok)\n"
TEXTS = [f"{a}+{b}={a + b}" for a in range(30) for b in range(30)] + [CODE] * 5
ENCODED = ["12+34=", "7+8=15", CODE, "<|im_start|>user\n2+3=<|im_end|>\n"]  # compared across loaders
PROMPT = "12+34="
CHAT = [{"role": "user", "content": "2+3="}]
CHATML = "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"
NEW_TOKENS = 6
SPEC = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
QUANTIZE = ["--method", "rtn", "--bits", "3", "--group", "16"]

# what a user runs: transformers only, offline, in a process of its own
FRESH = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(1)
out = {}
for d in json.loads(sys.argv[1]):
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()  # a quantised dir's reader
    chat = tok.apply_chat_template(%(chat)s, add_generation_prompt=True, tokenize=False)
    gen = {}
    for name, text in (("prompt", %(prompt)r), ("chat", chat)):
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            gen[name] = model.generate(
                ids, max_new_tokens=%(new)d, do_sample=False, pad_token_id=tok.pad_token_id
            )[0].tolist()
    out[d] = dict(
        tokenizer_class=type(tok).__name__,
        vocab=tok.get_vocab(),
        special=[tok.pad_token, tok.eos_token, tok.bos_token, tok.unk_token],
        special_ids=[tok.pad_token_id, tok.eos_token_id, tok.bos_token_id],
        model_max_length=tok.model_max_length,
        encoded=[tok(t, add_special_tokens=False)["input_ids"] for t in %(encoded)r],
        chat=chat,
        generated=gen,
        rlsys_imported=any(m == "rlsys" or m.startswith("rlsys.") for m in sys.modules),
    )
print(json.dumps(out))
""" % dict(chat=repr(CHAT), prompt=PROMPT, new=NEW_TOKENS, encoded=ENCODED)


def fresh_load(dirs) -> dict:
    """`FRESH` over `dirs` in a new interpreter (no network, outside the repo): its report per dir."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [sys.executable, "-c", FRESH, json.dumps([str(d) for d in dirs])],
        capture_output=True,
        text=True,
        env=env,
        cwd=os.path.dirname(str(dirs[0])),
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def rlsys_load(path) -> dict:
    """The same report from rlsys's loader (`load_model` / `load_tokenizer`), in this process."""
    tok, model = load_tokenizer(path), load_model(path).eval()
    chat = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    gen = {}
    for name, text in (("prompt", PROMPT), ("chat", chat)):
        ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            gen[name] = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)[
                0
            ].tolist()
    return dict(
        vocab=tok.get_vocab(),
        special=[tok.pad_token, tok.eos_token, tok.bos_token, tok.unk_token],
        special_ids=[tok.pad_token_id, tok.eos_token_id, tok.bos_token_id],
        model_max_length=tok.model_max_length,
        encoded=[tok(t, add_special_tokens=False)["input_ids"] for t in ENCODED],
        chat=chat,
        generated=gen,
    )


def save_old_layout(model, tokenizer, path):
    """A model dir as older rlsys wrote it: the tokenizer in `path/tokenizer`."""
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path / "tokenizer"))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS, vocab_size=300)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer):
    """policy_init-style dirs (qwen2, the default, and llama) and a learner's hf export of a
    policy that started from an old-layout dir, each with the fresh process's report."""
    from actors.learner import Learner
    from algorithms.grpo import GRPO
    from rlsys.cluster import free_port

    root = tmp_path_factory.mktemp("model_dirs")
    made = {
        arch: save_model_dir(
            build_tiny_model(TinyModelSpec(**SPEC, architecture=arch), tokenizer, seed=3), tokenizer, root / arch
        )
        for arch in ("qwen2", "llama")
    }
    old = save_old_layout(build_tiny_model(TinyModelSpec(**SPEC), tokenizer, seed=4), tokenizer, root / "old")
    learner = Learner(str(old), GRPO(GRPO.Config(group_size=4, kl_coef=0.0)), master_port=free_port())
    try:
        with torch.no_grad():  # weights of its own, so the export is not a copy of the dir it started from
            g = torch.Generator().manual_seed(5)
            for p in learner.module.policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        learner.export_hf(str(root / "hf"))
    finally:  # DeepSpeed's close: it also drops the groups it cached, so a later learner in this process starts clean
        import deepspeed.comm

        deepspeed.comm.destroy_process_group()
    made["hf"] = root / "hf"
    made["old"] = old
    made["quantized"] = root / "quantized"  # `rlsys quantize` of the qwen2 dir
    assert quantize_main([str(made["qwen2"]), "--out", str(made["quantized"]), *QUANTIZE]) == 0
    names = ("qwen2", "llama", "hf", "quantized")
    report = fresh_load([made[k] for k in names])
    return made, {k: report[str(made[k])] for k in names}


def test_trained_tokenizer_has_chatml_template_and_appended_chat_tokens(tokenizer):
    ids = tokenizer.convert_tokens_to_ids(CHAT_TOKENS)
    assert ids == [len(tokenizer) - 2, len(tokenizer) - 1]  # after the trained vocabulary
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2, 3]
    assert set(CHAT_TOKENS) <= set(tokenizer.all_special_tokens)
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == CHATML
    two_turns = [*CHAT, {"role": "assistant", "content": "5"}]
    assert tokenizer.apply_chat_template(two_turns, tokenize=False) == (
        "<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    )
    chat_ids = tokenizer(CHATML, add_special_tokens=False)["input_ids"]
    assert chat_ids[0] == ids[0] and chat_ids.count(ids[0]) == 2 and chat_ids.count(ids[1]) == 1
    assert tokenizer.decode(chat_ids, skip_special_tokens=True) == "user\n2+3=\nassistant\n"
    assert len(tokenizer("123", add_special_tokens=False)["input_ids"]) == 3  # digits stay single tokens
    assert tokenizer("12+34=", add_special_tokens=False)["input_ids"] == tokenizer.convert_tokens_to_ids(list("12+34="))
    # the model covers the chat tokens
    assert build_tiny_model(TinyModelSpec(**SPEC), tokenizer).config.vocab_size == len(tokenizer)


def test_chat_tokens_leave_the_other_initial_weights_as_they_were(tokenizer):
    """The rows of the appended chat tokens are drawn after every other weight: a model of the
    same seed without them has the same weights (the figures of a seed do not move)."""
    from transformers import AutoModelForCausalLM

    spec = TinyModelSpec(**SPEC)
    with_chat = build_tiny_model(spec, tokenizer, seed=3).state_dict()
    with torch.random.fork_rng():
        torch.manual_seed(3)
        without = AutoModelForCausalLM.from_config(spec.config(len(tokenizer) - 2, tokenizer)).state_dict()
    assert with_chat["model.embed_tokens.weight"].shape[0] == len(tokenizer)
    for name, w in without.items():
        assert torch.equal(with_chat[name][: w.shape[0]], w), name


def test_vocab_size_bounds_the_whole_vocabulary():
    tok = train_tokenizer([CODE * 3, "hello world, hello there"] * 20, vocab_size=280)
    assert len(tok) == 280 and tok.convert_tokens_to_ids(CHAT_TOKENS) == [278, 279]


@pytest.mark.parametrize("name", ["qwen2", "llama", "hf", "quantized"])
def test_standard_pair_in_a_fresh_process_generates_what_rlsys_does(dirs, name):
    made, fresh = dirs
    path, theirs = made[name], fresh[name]
    assert (path / "tokenizer.json").is_file() and (path / "chat_template.jinja").is_file()
    assert not (path / "tokenizer").exists()
    assert json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert not theirs["rlsys_imported"]
    ours = rlsys_load(path)
    assert theirs["vocab"] == ours["vocab"] and len(ours["vocab"]) > 260  # not an empty Qwen2Tokenizer
    for key in ("special", "special_ids", "model_max_length", "encoded", "chat", "generated"):
        assert theirs[key] == ours[key], key
    assert ours["chat"] == CHATML
    assert ours["special"] == ["<pad>", "<eos>", "<bos>", "<unk>"] and ours["special_ids"] == [0, 2, 1]
    assert len(ours["generated"]["prompt"]) > len(ours["encoded"][0])  # it generated
    if name == "llama":  # qwen2's class is imposed by transformers; others read tokenizer.json as it is
        assert theirs["tokenizer_class"] in ("PreTrainedTokenizerFast", "TokenizersBackend")


def test_quantized_dir_holds_packed_weights_and_its_reader(dirs):
    """The quantised dir has no dense weights: the fresh process read the packed ones through the
    reader the dir carries (its greedy tokens equal rlsys's above), and they are not the
    full-precision model's."""
    made, _ = dirs
    quantized = made["quantized"]
    assert not list(quantized.glob("model*.safetensors")) and (quantized / "rlsys_slim_llm.py").is_file()
    config = json.loads((quantized / "config.json").read_text())
    assert config["auto_map"] == {"AutoModelForCausalLM": "rlsys_slim_llm.SlimQwen2ForCausalLM"}
    dense, full = load_model(quantized), load_model(made["qwen2"])
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dense.state_dict()[q_proj], full.state_dict()[q_proj])
    assert len(torch.unique(dense.state_dict()[q_proj][0, :16])) <= 2**3  # one 3-bit group of a row


def test_export_holds_the_learner_weights(dirs):
    made, _ = dirs
    exported, started = load_model(made["hf"]), load_model(made["old"])
    assert not torch.equal(exported.model.embed_tokens.weight, started.model.embed_tokens.weight)


def test_old_layout_still_loads(dirs, tokenizer):
    made, _ = dirs
    old = made["old"]
    assert not (old / "tokenizer.json").exists() and (old / "tokenizer" / "tokenizer.json").is_file()
    tok = load_tokenizer(old)
    assert tok.get_vocab() == tokenizer.get_vocab()
    assert tok(CODE, add_special_tokens=False)["input_ids"] == tokenizer(CODE, add_special_tokens=False)["input_ids"]
    assert tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False) == CHATML
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 2, 1)


def test_no_tokenizer_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        load_tokenizer(tmp_path)
