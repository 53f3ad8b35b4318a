"""Typed job configuration: YAML in configs/, dotted overrides from the command line.

A bad config fails before any actor starts with one line naming the key, the bad value
and what is allowed (`ConfigError`; the CLI prints it and exits 2).

The `algorithm` section is validated in two passes: here only its `name`; the chosen
algorithm's own `Config` model then validates the rest (`validate_section`), so a new
algorithm brings its own keys without touching this file. A rule of one section is a
validator of that section; the rules that involve several sections, or a section and the
algorithm, are `check_job`, which `build_algorithm` calls. Every key has a description:
`config_reference` renders them as docs/configuration.md (`rlsys config doc`).
"""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import types
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union, get_args, get_origin
from urllib.parse import urlparse

import annotated_types
import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """One-line, user-facing configuration error."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = Field(
        "quickstart",
        description="the run's name: its directory is run.output_dir/run.name, and "
        "attached evaluators find the live run by it (one live run per name on a cluster)",
    )
    seed: int = Field(
        0,
        description="seeds everything random: generated task data, the tiny model's init, warm-up "
        "order, sampling, the buffer and the learner",
    )
    output_dir: str = Field(
        "runs", description="directory that holds the run directories (relative paths: to the working directory)"
    )
    loggers: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        ["jsonl", "tensorboard"],
        description="where metrics, evaluations and rollout samples go: `jsonl` (metrics.jsonl, evals.jsonl, "
        "samples.jsonl in the run dir; always on: resume reads them), `tensorboard` (run dir/tensorboard), "
        "`wandb` (the `wandb` extra; mode run.wandb_mode, files in run dir/wandb) and `mlflow` (the `mlflow` "
        "extra; MLFLOW_TRACKING_URI, else a file store in run.output_dir/mlruns)",
    )
    project: str = Field(
        "rlsys", min_length=1, description="the wandb project and the mlflow experiment the run is logged under"
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="`offline` writes the wandb run to disk and needs no network (`wandb sync <run dir>/wandb/"
        "offline-run-*` uploads it later); `online` streams it (needs WANDB_API_KEY)",
    )

    @field_validator("loggers")
    @classmethod
    def _jsonl_first(cls, v: list[str]) -> list[str]:
        if "jsonl" not in v:
            raise ValueError("must include jsonl: resume and the evaluators read metrics.jsonl and evals.jsonl")
        if len(set(v)) != len(v):
            raise ValueError(f"names a logger twice: {v}")
        return v


# the Llama-family decoders the tiny factory builds
Architecture = Literal["qwen2", "qwen3", "llama", "mistral", "phi3", "gemma"]


class ModelConfig(Section):
    path: Optional[str] = Field(
        None,
        description="local HF model dir to start from (its tokenizer too: it must have an eos token, and one "
        "without a pad token pads with eos); null builds a tiny model from the sizes below with a BPE tokenizer "
        "trained on the task's text",
    )
    architecture: Architecture = Field(
        "qwen2", description="the tiny model's transformers model type (with `path`: the directory's own)"
    )
    vocab_size: int = Field(
        512,
        ge=32,
        le=65536,
        description="tiny model: vocabulary size of the BPE tokenizer "
        "trained on the task's text (digits are single tokens)",
    )
    hidden_size: int = Field(128, ge=8, description="tiny model: width of the residual stream")
    intermediate_size: int = Field(384, ge=8, description="tiny model: width of the MLP's hidden layer")
    num_hidden_layers: int = Field(4, ge=1, le=64, description="tiny model: decoder layers")
    num_attention_heads: int = Field(4, ge=1, description="tiny model: attention heads (hidden_size a multiple of it)")
    num_key_value_heads: int = Field(
        2,
        ge=1,
        description="tiny model: key/value heads of grouped-query attention (num_attention_heads a multiple of it)",
    )
    max_position_embeddings: int = Field(
        256, ge=16, description="tiny model: longest sequence (prompt + response), in tokens"
    )


class TaskConfig(Section):
    name: str = Field(
        "arithmetic",
        description="the task (envs/registry.py): arithmetic (exact-answer arithmetic "
        "problems), code or humaneval (multi-turn code in the sandbox; RLEF), dataset (a user's "
        "rows: task.train_path, prompts through the chat template, any reward; envs/dataset_task.py)",
    )
    train_path: Optional[str] = Field(
        None,
        validate_default=True,
        description="training rows ({prompt, answer}; code: {prompt, public_tests, private_tests}): "
        "jsonl/parquet, and for task.name=dataset also .json or a Dataset.save_to_disk directory "
        "(relative paths: to the working directory); null: arithmetic generates problems, code takes "
        "HumanEval (required for dataset)",
    )
    eval_path: Optional[str] = Field(
        None,
        description="held-out rows, in a format train_path takes; null: the train_path rows "
        "(with train_path), else the generated or HumanEval held-out split",
    )
    prompt_key: str = Field(
        "prompt",
        min_length=1,
        description="dataset: the column of the prompt, a string or chat messages "
        '([{"role": ..., "content": ...}, ...], the conversational format of HF datasets)',
    )
    answer_key: str = Field(
        "answer",
        min_length=1,
        description="dataset: the column of the reference answer (a string or a number); the whole row, "
        "every column, reaches the reward function",
    )
    demonstration_key: Optional[str] = Field(
        None,
        min_length=1,
        description="dataset: the column the supervised warm-up teaches as the response (a worked solution); "
        "null: the answer column",
    )
    flawed_demonstration_key: Optional[str] = Field(
        None,
        min_length=1,
        description="dataset: the column of a flawed demonstration of each row (a solution with a wrong step), "
        "taught in place of the demonstration with probability sft.demo_error; null: none (sft.demo_error 0)",
    )
    system_prompt: Optional[str] = Field(
        None,
        description="dataset: a system message put before each prompt that has none of its own (null: none)",
    )
    chat_template: Optional[bool] = Field(
        None,
        description="dataset: build prompts with the tokenizer's chat template (apply_chat_template with the "
        "generation prompt); null: when the tokenizer has one; false: the messages' text as it is",
    )
    max_prompt_tokens: Optional[int] = Field(
        None,
        ge=1,
        description="dataset: longest prompt kept, in tokens (template applied); null: the model's context "
        "(max_position_embeddings) less rollout.max_new_tokens",
    )
    drop_long_prompts: bool = Field(
        True,
        description="dataset: drop the prompts over task.max_prompt_tokens, with one count on stderr; "
        "false: such a prompt stops the run before any actor starts, naming its file and row",
    )
    num_train: int = Field(
        4000,
        ge=1,
        description="training problems generated (arithmetic) or taken from "
        "HumanEval (code, at most its 164 less num_eval)",
    )
    num_eval: int = Field(
        200,
        ge=1,
        description="held-out problems generated (arithmetic, never among the training "
        "ones) or the last HumanEval problems (code)",
    )
    min_value: int = Field(0, ge=0, description="arithmetic: smallest operand of a generated problem")
    max_value: int = Field(99, ge=1, description="arithmetic: largest operand of a generated problem")
    operations: list[Literal["+", "-", "*"]] = Field(
        ["+"], description="arithmetic: operators of the generated problems, drawn uniformly"
    )
    shaping: list[Any] = Field(
        default_factory=list,
        description="reward functions applied in order to the task's "
        "reward: names or {name: {params}} (cosine_length, repetition; envs/rewards.py checks "
        "them)",
    )

    @field_validator("train_path")
    @classmethod
    def _train_path(cls, v, info):
        if v is None and info.data.get("name") == "dataset":
            raise ValueError("is required when task.name is 'dataset'")
        return v


class SFTConfig(Section):
    steps: int = Field(
        150, ge=0, description="supervised warm-up steps on the task's demonstrations before RL (0: none)"
    )
    demo_error: float = Field(
        0.0,
        ge=0,
        le=1,
        description="probability that a warm-up demonstration is the task's "
        "flawed one (arithmetic: carries dropped; dataset: task.flawed_demonstration_key), like imperfect SFT data",
    )
    batch_size: int = Field(32, ge=1, description="demonstrations per warm-up step")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate of the warm-up")


class RolloutConfig(Section):
    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="hf: transformers in each worker's process (CPU or "
        "GPU); vllm: a vLLM engine per worker on tensor_parallel_size GPUs",
    )
    num_workers: int = Field(
        1,
        ge=1,
        le=64,
        description="rollout workers (Ray actors) of the run's policy; each "
        "generates a contiguous share of a step's requests",
    )
    threads_per_worker: int = Field(1, ge=1, description="torch CPU threads of each rollout worker")
    max_new_tokens: int = Field(8, ge=1, le=4096, description="most tokens generated per response")
    temperature: float = Field(
        1.0,
        ge=0,
        description="sampling temperature (0: greedy); the learner and the "
        "reference score logits divided by it (by 1 when it is 0)",
    )
    top_p: float = Field(
        1.0, gt=0, le=1, description="nucleus sampling: the smallest token set of this total probability (1: off)"
    )
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens (0: the whole vocabulary)")
    batch_size: int = Field(64, ge=1, description="hf backend: sequences per generate call")
    eval_greedy: bool = Field(
        True, description="held-out evaluation decodes greedily; false: one sample at rollout.temperature (pass@1)"
    )
    decode: Literal["lean", "generate"] = Field(
        "lean",
        description="hf backend: lean decode loop (Llama-family models; others fall back) or transformers' generate",
    )
    kv_cache: Literal["full", "specache"] = Field(
        "full",
        description="full: the whole KV cache in full precision; specache: SpeCache two-tier KV cache (hf backend)",
    )
    specache_k: int = Field(64, ge=1, description="full-precision KV pairs fetched per decode step")
    specache_bits: int = Field(2, ge=1, le=4, description="bits of the low-bit KV copy in the fast tier")
    specache_window: int = Field(32, ge=0, description="most recent positions kept in full precision")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="hf backend: the lean decode loop's compute dtype (its fused weights, activations and KV cache; "
        "norms reduce and logits come out in float32; the model's own weights stay float32). bfloat16 decodes as "
        "vLLM and TRL's bf16 do, faster on CPUs with bf16 matmuls at hidden sizes of ~200 and up "
        "(docs/benchmarks.md); the sampler's logprobs then differ from the learner's by bf16 rounding "
        "(the mismatch/* metrics; algorithm.off_policy_correction tis or mis corrects for it)",
    )
    quantized: Optional[str] = Field(None, description="SliM-LLM quantised dir (rlsys quantize) to serve, hf backend")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per vLLM engine (vllm backend)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU memory fraction a vLLM engine takes")
    inflight_update: Literal["finish", "resume", "continue"] = Field(
        "finish",
        description="trainer.mode async: what a generation in progress does when new weights arrive. finish: it "
        "ends under the weights it started with; resume (partial rollouts): it is generated in chunks of "
        "rollout.inflight_chunk_tokens, each unfinished response stopped at a chunk's end and resumed from its "
        "prefix (prompt and tokens so far, prefilled again) by the newest weights the worker holds; continue: the "
        "weights load between two decode steps and the generation goes on under them over the KV cache the older "
        "weights wrote (the lean decoder). Under resume and continue every token records the policy version that "
        "sampled it (token_versions) and a row's policy_version is its oldest",
    )
    inflight_chunk_tokens: int = Field(
        32, ge=1, description="rollout.inflight_update resume: tokens generated per chunk before new weights may load"
    )

    @field_validator("decode")
    @classmethod
    def _hf_decode(cls, v, info):
        if v != "lean" and info.data.get("backend") != "hf":
            raise ValueError("is a setting of rollout.backend 'hf' only")
        return v

    @field_validator("dtype")
    @classmethod
    def _lean_dtype(cls, v, info):
        d = info.data
        if v != "float32" and (d.get("backend") != "hf" or d.get("decode") != "lean" or d.get("kv_cache") != "full"):
            raise ValueError(
                f"{v} is the lean decoder's (rollout.backend hf, rollout.decode lean, rollout.kv_cache full), not "
                f"backend {d.get('backend')}, decode {d.get('decode')}, kv_cache {d.get('kv_cache')}"
            )
        return v

    @field_validator("tensor_parallel_size", "gpu_memory_utilization")
    @classmethod
    def _vllm_only(cls, v, info):
        if v != cls.model_fields[info.field_name].default and info.data.get("backend") != "vllm":
            raise ValueError("is a setting of rollout.backend 'vllm' only")
        return v

    @field_validator("quantized")
    @classmethod
    def _quantized_dir(cls, v, info):
        if v is None:
            return v
        if info.data.get("backend") != "hf":
            raise ValueError("is served by rollout.backend 'hf' only")
        if not ((Path(v) / "quantize_config.json").exists() and (Path(v) / "quantized.safetensors").exists()):
            raise ValueError(
                "must be a directory written by `rlsys quantize` (quantize_config.json, quantized.safetensors)"
            )
        return v

    @field_validator("kv_cache")
    @classmethod
    def _specache_backend(cls, v, info):
        if v == "specache" and info.data.get("backend") != "hf":
            raise ValueError("specache is served by rollout.backend 'hf' only")
        return v

    def specache_settings(self) -> dict | None:
        """The SpeCache settings a rollout backend takes, or None for the full cache."""
        if self.kv_cache != "specache":
            return None
        return {"k": self.specache_k, "bits": self.specache_bits, "window": self.specache_window}


def located_file_spec(key: str, spec: Optional[str], config_dir: Path | None) -> Optional[str]:
    """A `path/to/file.py:name` spec with its file found and made absolute: a relative path is looked
    up from the working directory, then from `config_dir` (the config file's); a one-line ConfigError
    naming `key` when it is in neither. Other specs (a module path, a built-in name, None) as they are."""
    target, _, name = (spec or "").rpartition(":")
    if not target.endswith(".py"):
        return spec
    path = Path(target)
    places = [path] if path.is_absolute() else [Path.cwd() / path]
    if config_dir is not None and not path.is_absolute():
        places.append(Path(config_dir) / path)
    for place in places:
        if place.is_file():
            return f"{place.resolve()}:{name}"
    where = " or ".join(str(p.parent) for p in places)
    raise ConfigError(f"config error: {key} = {spec!r}: no file {target} in {where}")


class LoraSettings(Section):
    """LoRA adapters (peft) instead of full fine-tuning: the learner trains and syncs the adapters only."""

    rank: int = Field(
        0,
        ge=0,
        le=1024,
        description="adapter rank r; 0: no LoRA, every weight trains. With r > 0 the optimizer holds the adapters "
        "(and a critic's value head) only, the weight sync sends the adapters and the rollout workers merge them "
        "into their copy of the initial weights (W0 + alpha/r * B A); the learner with its adapters off is the "
        "reference (no reference actor, except for an algorithm that moves its anchor: BRiTE)",
    )
    alpha: float = Field(16.0, gt=0, description="LoRA alpha: the adapters' update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input in the training forward")
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="names (last component) of the linear layers that get adapters (peft's target_modules; the "
        "defaults are the Llama/Qwen2 attention and MLP projections)",
    )
    export: Literal["merged", "adapter"] = Field(
        "merged",
        description="what a checkpoint's hf/ holds: merged, the initial weights with the adapters merged in "
        "(loads with AutoModelForCausalLM); adapter, the adapter directory in peft's format "
        "(PeftModel.from_pretrained over the initial policy)",
    )


class LearnerConfig(Section):
    num_ranks: int = Field(
        1,
        ge=1,
        le=64,
        description="data-parallel learner ranks (one DeepSpeed process group; "
        "one GPU each on a cluster with GPUs); each trains on its share of a step's batch",
    )
    zero_stage: int = Field(
        0,
        ge=0,
        le=3,
        description="DeepSpeed ZeRO stage: 0 none, 1 optimizer state, 2 + "
        "gradients, 3 + parameters sharded over the ranks",
    )
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate (the peak of the schedule)")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="decay after the warm-up")
    warmup_steps: int = Field(0, ge=0, description="trainer steps of linear lr warm-up")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final lr / lr of the linear and cosine schedules")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(
        1.0, gt=0, description="largest global gradient norm of an optimizer step (clipped above it)"
    )
    micro_batch_size: int = Field(
        64,
        ge=1,
        description="not used: the learner runs each minibatch whole (see learner.minibatches) or in "
        "micro-batches by tokens (learner.max_tokens_per_microbatch)",
    )
    epochs: int = Field(1, ge=1, description="passes over each trainer step's batch")
    minibatches: int = Field(1, ge=1, description="shards of each rank's batch per epoch, one optimizer step each")
    threads: int = Field(1, ge=1, description="torch CPU threads of each learner rank")
    bf16: bool = Field(
        False,
        description="bf16 mixed precision: on CUDA DeepSpeed's bf16 (bf16 weights, fp32 optimizer state); on a CPU "
        "DeepSpeed's torch_autocast (linear layers and attention in bf16, weights and optimizer in fp32; "
        "faster where the CPU has bf16 instructions, e.g. AVX512-BF16 or AMX)",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="activation checkpointing: each decoder layer of the policy keeps only its input in the "
        "training forward and runs again in the backward (less activation memory, about one more forward of "
        "compute per step; the same gradients); rows sharing a prompt still run it once",
    )
    max_tokens_per_microbatch: int | None = Field(
        None,
        ge=1,
        description="token budget of a learner micro-batch (null: each minibatch in one padded forward): each "
        "minibatch, still one optimizer step, runs in micro-batches of at most this many real tokens (prompt + "
        "response; a prompt group, e.g. a GRPO group or a preference pair, is never cut, and one larger than the "
        "budget goes alone), each packed into one sequence without padding; the gradients accumulate and each "
        "micro-batch's loss counts by its share of what the loss averages over (the minibatch's response tokens, or "
        "the algorithm's loss_denominator: the whole minibatch's gradient); rows sharing a prompt then each run "
        "it. The reference and a distillation teacher score in packed batches of "
        "the same budget",
    )
    auto_pack: bool = Field(
        True,
        description="with max_tokens_per_microbatch null: a minibatch whose padded forward would compute more than "
        "1.5x the token positions of its rows (responses of spread lengths, padded to the longest) runs in packed "
        "micro-batches of 4096 tokens instead, the same gradient (rlsys/packing.py packing_pays; not for a loss "
        "that declares UnpackedOnly; under zero_stage 2/3 several ranks all pack when one does); the reference "
        "and a teacher alike; false: always padded",
    )
    lora: LoraSettings = Field(LoraSettings(), description="LoRA adapters instead of full fine-tuning (rank 0: off)")
    offload: Literal["none", "optimizer", "params"] = Field(
        "none",
        description="DeepSpeed ZeRO-Offload of a CUDA learner: optimizer, the optimizer state and its step in host "
        "memory (ZeRO 1-3); params, the parameters too (ZeRO-3). A CPU learner holds both in host memory already: "
        "there the key changes nothing (the learner says so once)",
    )

    @model_validator(mode="after")
    def _offload_needs_zero(self):
        if self.offload == "optimizer" and self.zero_stage == 0:
            raise ValueError("offload 'optimizer' needs zero_stage 1, 2 or 3 (ZeRO partitions what it offloads)")
        if self.offload == "params" and self.zero_stage != 3:
            raise ValueError(f"offload 'params' needs zero_stage 3, not {self.zero_stage}")
        return self


class TrainerConfig(Section):
    steps: int = Field(
        20,
        ge=0,
        description="trainer steps of the run, each: rollout, learner update, weight sync to the rollout workers",
    )
    prompts_per_step: int = Field(
        32,
        ge=1,
        description="task prompts sampled per step (the rows are these times the algorithm's responses per prompt)",
    )
    eval_every: int = Field(
        10,
        ge=0,
        description="held-out evaluation every this many steps, besides before the "
        "first and after the last (0: only those)",
    )
    checkpoint_every: int = Field(
        0, ge=0, description="checkpoint every this many steps and after the last (0: no checkpoints, so no resume)"
    )
    keep_checkpoints: int = Field(2, ge=1, description="newest checkpoints kept; older ones are deleted")
    checkpoint_on_signal: bool = Field(
        True,
        description="on SIGTERM (a scheduler's preemption, `kill`): finish the step in flight, checkpoint it and "
        "exit 143 with one line naming the step, the checkpoint and the resume command (false: no checkpoint)",
    )
    checkpoint_on_interrupt: bool = Field(
        False,
        description="on Ctrl-C (SIGINT): the same, checkpoint included (false: exit 130 after the step in flight "
        "without one; a second Ctrl-C exits at once)",
    )
    log_samples: int = Field(
        4,
        ge=0,
        description="rollout rows per step written to runs/<name>/samples.jsonl and TensorBoard's text tab: the "
        "prompt as the model saw it (template applied), the response, the reward (0: none)",
    )
    sync_timeout_s: float = Field(
        120.0,
        gt=0,
        description="the most a weight sync, forming the broadcast group or "
        "placing the vLLM engines may take, in seconds, before the run fails in one line",
    )
    sync_bucket_mb: float = Field(
        512.0,
        gt=0,
        description="object-store sync: weights larger than this go in buckets of at most this many MB, each "
        "loaded by every worker before the next is made, so a sync never holds a second full copy in the object "
        "store (a policy that fits in one bucket goes as one object, unawaited)",
    )
    start_timeout_s: float = Field(
        600.0,
        gt=0,
        description="the most the run's rollout and learner actors may take to "
        "start (a cluster that cannot place them ends the run in one line)",
    )
    weight_sync: Literal["auto", "shared_memory", "object_store", "broadcast"] = Field(
        "auto",
        description="shared_memory: a /dev/shm file on learner rank 0's node the workers there map; "
        "object_store: Ray's object store; auto: shared_memory where every rollout worker is on learner rank 0's "
        "node and /dev/shm has room, else object_store; broadcast: a torch.distributed group from learner rank 0 "
        "(NCCL with vllm, else gloo)",
    )
    mode: Literal["sync", "overlap", "async"] = Field(
        "sync",
        description="how generation and training interleave: sync: a step's rows are generated, then trained on; "
        "overlap: the next step's rows are generated while the learner trains (one policy version behind); async: "
        "a producer thread generates batch after batch into the buffer while the learner trains on each as soon as "
        "it is ready, at most buffer.max_staleness versions behind (trainer.staleness_policy). overlap and async "
        "need buffer.max_staleness >= 1 and an algorithm that declares TrainsOnStaleRows (docs/configuration.md's "
        "rules list them)",
    )
    staleness_policy: Literal["wait", "drop"] = Field(
        "wait",
        description="async: how buffer.max_staleness (k) is kept. wait: the producer starts batch i only once the "
        "learner holds version i - k, so no row is ever more than k versions old; drop: the producer runs ahead (at "
        "most k + 1 batches queued) and a batch with a row more than k versions behind the learner when taken is "
        "dropped whole and counted (staleness/dropped_batches)",
    )
    deterministic: bool = Field(
        False,
        description="async: fix the interleaving of generation and training so a run repeats bit for bit (batch i "
        "is generated wholly by policy version max(0, i - k); the weights of version v reach the workers once batch "
        "v + k - 1 is generated), at the cost of the learner waiting for those batches (for tests and reruns)",
    )


class BufferConfig(Section):
    max_staleness: int = Field(
        0,
        ge=0,
        description="drop rows more than this many policy versions behind the "
        "learner when taken (0: strictly on-policy)",
    )
    capacity: int = Field(100_000, ge=1, description="most rows held; the oldest go first")


class RayConfig(Section):
    address: Optional[str] = Field(
        None,
        description="Ray cluster to join (e.g. auto, or the GCS host:port); null: "
        "$RAY_ADDRESS if set, else an embedded cluster on 127.0.0.1 with token auth",
    )
    num_cpus: Optional[int] = Field(
        None,
        ge=1,
        description="logical CPUs of the embedded cluster (null: the machine's; at least 2); not used with an address",
    )


def custom_resources(v: dict[str, float]) -> dict[str, float]:
    bad = {k: x for k, x in v.items() if not x > 0 or k in ("CPU", "GPU", "memory")}
    if bad:
        raise ValueError(f"takes custom resources with amounts > 0 (CPU and GPU come from the roles), not {bad}")
    return v


class LearnerPlacement(Section):
    """Where the learner ranks go: one placement-group bundle per rank."""

    resources: dict[str, float] = Field(
        {},
        description="custom Ray resources each rank asks for (a node started with `ray start --resources "
        "'{\"node_a\": 4}'` offers them): pins the ranks to the nodes that have them; {} anywhere",
    )
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="the ranks' placement group strategy: PACK on as few nodes as fit, STRICT_SPREAD one rank per "
        "node (DeepSpeed's rendezvous at rank 0's node address)",
    )

    _custom = field_validator("resources")(lambda v: custom_resources(v))


class RolloutPlacement(Section):
    """Where the rollout workers go."""

    resources: dict[str, float] = Field(
        {},
        description="custom Ray resources each rollout worker asks for: pins the workers to the nodes that "
        "have them; {} anywhere (hf backend; a vLLM engine's placement group takes GPUs)",
    )

    _custom = field_validator("resources")(lambda v: custom_resources(v))


class ServicesPlacement(Section):
    """Where the run's services go: the reference, the reward source, the experience buffer, a
    distillation teacher and the attached evaluators (actors a run does not recreate: a node lost
    under them ends the run)."""

    resources: dict[str, float] = Field(
        {},
        description="custom Ray resources each service actor asks for (reference, reward and buffer: 3 x these, "
        "plus a teacher and each attached evaluator): keeps them on nodes that have them (e.g. off nodes that may be "
        "preempted); {} anywhere",
    )

    _custom = field_validator("resources")(lambda v: custom_resources(v))


class PlacementConfig(Section):
    """Which nodes of a multi-node Ray cluster each role runs on."""

    learner: LearnerPlacement = Field(LearnerPlacement(), description="the learner ranks")
    rollout: RolloutPlacement = Field(RolloutPlacement(), description="the rollout workers")
    services: ServicesPlacement = Field(
        ServicesPlacement(), description="the reference, reward, buffer, teacher and evaluator actors"
    )


class SandboxConfig(Section):
    """Code execution for tasks that need it (task.name=code): a SandboxPool on Ray."""

    backend: Literal["bwrap", "docker"] = Field(
        "bwrap", description="bwrap: bubblewrap namespaces on the host; docker: containers through the Docker API"
    )
    workers: int = Field(2, ge=1, le=256, description="concurrent sandboxed runs")
    wall_time_s: float = Field(
        10.0, gt=0, le=600, description="wall-clock limit of one run, in seconds (the paper: 10 s per test)"
    )
    cpu_time_s: float = Field(10.0, gt=0, le=600, description="CPU-time limit of one run, in seconds")
    memory_mb: int = Field(1024, ge=64, le=65536, description="memory limit of one run, in MB (the paper: 1 GB)")


BUILTIN_TOOLS = ("calculator", "python")  # envs/tools.py BUILTINS
CALL_STATUSES = ("ok", "malformed", "unknown_tool", "error", "timeout")  # envs/tools.py STATUSES
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # package.module:name


class EnvConfig(Section):
    """Multi-turn episodes (docs/agents.md): an environment the policy talks to over several turns, for every
    algorithm whose rollout is the common one."""

    name: Optional[str] = Field(
        None,
        description="null: single-turn rollouts (one response per sample); tools: tool-using episodes "
        "(envs/tool_env.py ToolEnv over the task's rows, the tools of env.tools); path/to/file.py:ClassName (a "
        "relative path: from the working directory, then from the config file's directory) or "
        "package.module:ClassName: a user's env, made once per episode as ClassName(task) with reset(row) and "
        "step(text) (envs/base.py Env)",
    )
    tools: list[str] = Field(
        [],
        description="env.name=tools: the tools the policy may call, built-ins (calculator; python, run in the "
        "sandbox with the sandbox section's limits) or package.module:function (its signature and docstring "
        "become the tool's schema)",
    )
    max_turns: int = Field(
        4, ge=1, le=64, description="most policy turns per episode; an episode not done by then ends there"
    )
    max_tokens: Optional[int] = Field(
        None,
        ge=2,
        description="an episode's token budget: prompt, policy turns and observations; a turn is given at most "
        "what is left (and rollout.max_new_tokens), and an observation that does not fit ends the episode (RLEF's "
        "code dialogs too: the last answer is then the final one); null: the model's context length",
    )
    lockstep: bool = Field(
        False,
        description="play a batch's episodes turn by turn: each generation call waits for every env step in "
        "flight, so a rerun with the same config and seed samples the same episodes bit for bit; false: a call "
        "goes on with the episodes whose steps are back (a slow tool holds up only its own episode), and which "
        "episodes share a call follows the steps' timing",
    )
    timeout_s: float = Field(
        10.0, gt=0, le=600, description="env.name=tools: the most one tool call may take, in seconds (status timeout)"
    )
    call_penalty: dict[str, float] = Field(
        {},
        description="env.name=tools: what each call of a status costs (ok, malformed, unknown_tool, error, "
        "timeout), taken from its turn's reward, e.g. {malformed: 0.1}; {}: calls cost nothing",
    )

    @field_validator("name")
    @classmethod
    def _env_name(cls, v):
        target, _, attr = (v or "").rpartition(":")
        a_file = target.endswith(".py") and attr.isidentifier()
        if v is not None and v != "tools" and not (IMPORT_PATH.match(v) or a_file):
            raise ValueError("is not tools, path/to/file.py:ClassName nor package.module:ClassName")
        return v

    @field_validator("tools")
    @classmethod
    def _tool_specs(cls, v, info):
        if v and info.data.get("name") != "tools":
            raise ValueError("are the tools of env.name 'tools' (a user's env declares its own)")
        if not v and info.data.get("name") == "tools":
            raise ValueError("must name at least one tool with env.name 'tools' (e.g. [calculator])")
        bad = [s for s in v if s not in BUILTIN_TOOLS and not IMPORT_PATH.match(s)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a built-in ({', '.join(BUILTIN_TOOLS)}) nor package.module:function")
        if len(set(v)) != len(v):
            raise ValueError("names a tool twice")
        return v

    @field_validator("call_penalty")
    @classmethod
    def _penalties(cls, v, info):
        if v and info.data.get("name") != "tools":
            raise ValueError("prices the tool calls of env.name 'tools'")
        unknown = sorted(set(v) - set(CALL_STATUSES))
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a call status ({', '.join(CALL_STATUSES)})")
        return v

    def located_name(self, config_dir: Path | None) -> Optional[str]:
        """env.name with its file (path/to/file.py:ClassName) found and made absolute, as reward.function's."""
        return located_file_spec("env.name", self.name, config_dir)


class JudgeConfig(Section):
    """The generative judge (actors/judge.py) as a reward source: plan, execution, verdict."""

    mode: Literal["pointwise", "pairwise"] = Field(
        "pointwise",
        description="pointwise: 'Score: N' mapped to [0, 1]; pairwise: win rates within each group, both orders",
    )
    backend: Literal["hf", "vllm"] = Field("hf", description="the judge's generation backend (as rollout.backend)")
    batch_size: int = Field(32, ge=1, description="sequences per generate call")
    max_plan_tokens: int = Field(
        64, ge=1, le=4096, description="most tokens of the judge's plan (what to check), written once per instruction"
    )
    max_execution_tokens: int = Field(
        128,
        ge=1,
        le=4096,
        description="most tokens of the judge's execution of its plan, which ends in the verdict line",
    )
    temperature: float = Field(0.0, ge=0, description="the judge's sampling temperature (0: greedy)")
    min_score: int = Field(1, description="pointwise: lowest score the judge is asked for (reward 0)")
    max_score: int = Field(
        10, description="pointwise: highest score the judge is asked for (reward 1); above min_score"
    )
    unparsable_reward: float = Field(0.0, description="pointwise reward of a response whose score is unparsable")

    @field_validator("max_score")
    @classmethod
    def _above_min(cls, v, info):
        if "min_score" in info.data and v <= info.data["min_score"]:
            raise ValueError(f"must be above reward.judge.min_score ({info.data['min_score']})")
        return v


def _model_dir_for(source: str, v, info, required: bool):
    """A reward model/judge directory: only for reward.source `source`, required there if `required`, must hold a
    model."""
    chosen = info.data.get("source")
    if v is None:
        if required and chosen == source:
            raise ValueError(f"is required when reward.source is '{source}'")
        return v
    if chosen != source:
        raise ValueError(f"is used by reward.source '{source}' only (reward.source is '{chosen}')")
    if not (Path(v) / "config.json").exists():
        raise ValueError("is not a model directory (no config.json)")
    return v


BUILTIN_REWARD_FUNCTIONS = ("math", "exact", "choice", "regex", "code")  # envs/reward_functions.py BUILTINS


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RewardConfig(Section):
    """Where rewards come from: the task's rule or a reward function, a sequence-classification reward model, a
    judge, or a reward server."""

    source: Literal["rule", "model", "judge", "http"] = Field(
        "rule",
        description="rule: the task's own reward (its answer checker) or reward.function; model: reward.model_dir's "
        "score; judge: the generative judge's verdict (reward.judge); http: a reward server (reward.url)",
    )
    model_dir: Optional[str] = Field(
        None,
        validate_default=True,
        description="reward model dir (`rlsys rm train`); required with reward.source=model",
    )
    judge_dir: Optional[str] = Field(
        None, description="judge causal LM dir (reward.source=judge); null: the initial policy judges"
    )
    function: Optional[str] = Field(
        None,
        description="reward.source=rule: the reward function, a built-in (math, exact, choice, regex, code; "
        "envs/reward_functions.py), path/to/file.py:name (a relative path: from the working directory, then from "
        "the config file's directory) or package.module:name, called as name(prompt, response, row) and returning "
        "a float or a dict with `reward` and extra numbers (logged as reward/<key> means); null: the task's own reward",
    )
    answer_key: Optional[str] = Field(
        None,
        min_length=1,
        description="the row's column that holds the reference answer (math, exact, choice); null: the task's "
        "(task.answer_key of task.name=dataset), else answer",
    )
    pattern: Optional[str] = Field(
        None,
        validate_default=True,
        description="reward.function=regex (required there): a Python regular expression; a response in which it is "
        "found (re.search: anchor it with ^ and $ to ask for the whole response) gets 1, any other 0",
    )
    batched: bool = Field(
        False,
        description="call a user's reward.function once per scoring call as name(prompts, responses, rows) -> list",
    )
    workers: int = Field(
        2,
        ge=1,
        le=64,
        description="worker processes that run reward.function, one row at a time each; a worker past "
        "reward.timeout_s is killed and replaced",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        description="the most one row of reward.function may take (batched: one call; code: at least "
        "sandbox.wall_time_s + 10), or one request to reward.url, in seconds; a row past it gets reward.on_error",
    )
    on_error: float = Field(
        0.0,
        description="the reward of a row whose function raises, times out or returns a non-number (or that the "
        "server answers null for); each such row counts in reward/errors, and the first error is printed",
    )
    max_error_rate: float = Field(
        1.0,
        gt=0,
        le=1,
        description="the run stops, naming the function and its last error, when this fraction of the rows of the "
        "last reward.error_window scoring calls failed (1: every row)",
    )
    error_window: int = Field(
        3, ge=1, description="scoring calls reward.max_error_rate looks back over (one per step for most algorithms)"
    )
    allow_remote: bool = Field(
        False, description="allow a reward.url that is not a loopback address (rows and responses leave the machine)"
    )
    url: Optional[str] = Field(
        None,
        validate_default=True,
        description="reward.source=http (required there): the reward server, sent one POST per scoring call "
        'with {"items": [{"prompt", "response", "row"}, ...]} and answering {"rewards": [...]}; a loopback '
        "address unless reward.allow_remote",
    )
    retries: int = Field(
        3,
        ge=0,
        le=20,
        description="reward.source=http: tries after the first (backoff 0.5 s, doubling) before the run stops with "
        "one line naming the URL",
    )
    judge: JudgeConfig = Field(
        JudgeConfig(),
        description="the judge of reward.source=judge: it writes a plan per "
        "instruction, executes it on each response and ends with a verdict",
    )

    @field_validator("model_dir")
    @classmethod
    def _model_dir(cls, v, info):
        return _model_dir_for("model", v, info, required=True)

    @field_validator("judge_dir")
    @classmethod
    def _judge_dir(cls, v, info):
        return _model_dir_for("judge", v, info, required=False)

    @field_validator("function")
    @classmethod
    def _function(cls, v, info):
        if v is None:
            return v
        if info.data.get("source") != "rule":
            raise ValueError(f"is used by reward.source 'rule' only (reward.source is '{info.data.get('source')}')")
        if v in BUILTIN_REWARD_FUNCTIONS:
            return v
        target, _, name = v.rpartition(":")
        module = all(part.isidentifier() for part in target.split("."))
        if not name.isidentifier() or not (target.endswith(".py") or module):
            raise ValueError(
                f"must be a built-in ({', '.join(BUILTIN_REWARD_FUNCTIONS)}), path/to/file.py:name or "
                f"package.module:name"
            )
        return v

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, v, info):
        regex = info.data.get("function") == "regex"
        if v is None:
            if regex:
                raise ValueError("is required when reward.function is 'regex'")
            return v
        if not regex:
            raise ValueError("is used by reward.function 'regex' only")
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"is not a valid regular expression ({e})") from None
        return v

    @field_validator("batched")
    @classmethod
    def _batched(cls, v, info):
        if v and info.data.get("function") in (None, *BUILTIN_REWARD_FUNCTIONS):
            raise ValueError("is for a user's reward.function (path/to/file.py:name or package.module:name) only")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v, info):
        source = info.data.get("source")
        if v is None:
            if source == "http":
                raise ValueError("is required when reward.source is 'http'")
            return v
        if source != "http":
            raise ValueError(f"is used by reward.source 'http' only (reward.source is '{source}')")
        parsed = urlparse(v)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError("must be an http:// or https:// URL")
        if not info.data.get("allow_remote") and not _is_loopback(parsed.hostname):
            raise ValueError(
                "is not a loopback address: rows and responses would leave this machine (set reward.allow_remote: "
                "true to allow it)"
            )
        return v

    def located_function(self, config_dir: Path | None) -> Optional[str]:
        """reward.function with its file (path/to/file.py:name) found and made absolute: a relative path is looked
        up from the working directory, then from `config_dir` (the config file's); ConfigError when it is in
        neither. Built-ins and module paths as they are."""
        if self.function in BUILTIN_REWARD_FUNCTIONS:
            return self.function
        return located_file_spec("reward.function", self.function, config_dir)


class AlgorithmSection(BaseModel):
    """Only `name` is checked here; the algorithm's own Config validates the other keys."""

    model_config = ConfigDict(extra="allow")
    name: str = Field("grpo", description="the algorithm (one of those below); its own keys sit beside name")
    # the file's keys when the command line names another algorithm (`keys_written_for_another_algorithm`)
    _written_for_another: set[str] = PrivateAttr(default_factory=set)

    def written_for_another(self) -> set[str]:
        """The keys a config file wrote for another algorithm than the one the command line names."""
        return set(self._written_for_another)


class JobConfig(Section):
    run: RunConfig = Field(RunConfig(), description="the run's name, seed and where its directory goes")
    model: ModelConfig = Field(
        ModelConfig(),
        description="the initial policy: a local HF model, or a tiny Llama-family decoder built from these sizes",
    )
    task: TaskConfig = Field(TaskConfig(), description="the task: its prompts, its rule reward and its held-out split")
    sft: SFTConfig = Field(SFTConfig(), description="the supervised warm-up on the task's demonstrations before RL")
    rollout: RolloutConfig = Field(RolloutConfig(), description="the rollout workers: backend, sampling and decoding")
    learner: LearnerConfig = Field(LearnerConfig(), description="the learner ranks: DeepSpeed, optimizer and schedule")
    trainer: TrainerConfig = Field(
        TrainerConfig(), description="the loop: steps, evaluation, checkpoints, weight sync and timeouts"
    )
    buffer: BufferConfig = Field(BufferConfig(), description="the experience buffer between rollout and learner")
    ray: RayConfig = Field(RayConfig(), description="which Ray cluster the run uses")
    placement: PlacementConfig = Field(
        PlacementConfig(), description="which nodes of a multi-node cluster the learner ranks and rollout workers use"
    )
    reward: RewardConfig = Field(
        RewardConfig(), description="where rewards come from: the task's rule, a reward model or a generative judge"
    )
    sandbox: SandboxConfig = Field(
        SandboxConfig(),
        description="code execution for the tasks that run code (task.name "
        "code, humaneval): a pool of sandboxes on Ray and each run's limits",
    )
    env: EnvConfig = Field(
        EnvConfig(),
        description="multi-turn episodes: the environment each prompt's episodes are played in (null name: "
        "single-turn), its tools and bounds",
    )
    algorithm: AlgorithmSection = Field(
        AlgorithmSection(), description="the algorithm, by name, and its own keys (the algorithm sections below)"
    )

    def algorithm_params(self) -> dict[str, Any]:
        return {k: v for k, v in self.algorithm.model_dump().items() if k != "name"}


# ---- rules across sections ---------------------------------------------------------------------
CROSS_SECTION_RULES = (
    "`trainer.mode: overlap | async` needs an algorithm whose loss corrects rows one policy version old "
    "({stale}) and `buffer.max_staleness >= 1`; `async` needs `trainer.weight_sync: auto | object_store` (the "
    "workers load new weights between generations while the learner runs on); `rollout.inflight_update: resume | "
    "continue`, `trainer.deterministic` and `trainer.staleness_policy: drop` need `trainer.mode: async` "
    "(deterministic waits: not with drop nor with continue; inflight updates: `rollout.backend: hf`, continue also "
    "`rollout.decode: lean` and `rollout.kv_cache: full`); async with `learner.lora` needs `zero_stage` < 3.",
    "An algorithm that trains several policies (cdg with `algorithm.models` other than `shared`) needs "
    "`rollout.backend: hf` and a `trainer.weight_sync` other than `broadcast`.",
    "`task.shaping` needs `reward.source: rule`: it shapes the task's rule reward or a `reward.function`'s (a "
    "reward >= 1 counts as correct), not a reward model's, a judge's or a reward server's score.",
    "`learner.max_tokens_per_microbatch` needs an algorithm whose loss one weight per packed micro-batch keeps "
    "exact (every algorithm but {unpacked}).",
    "`learner.lora.rank > 0` with `rollout.backend: vllm` needs a `trainer.weight_sync` other than `broadcast`: the "
    "engine serves the adapters as a LoRA request read from a directory, not loaded in place.",
    "`env.name` (multi-turn episodes) needs an algorithm whose rollout plays them ({episodes}), no `task.shaping` "
    "(it shapes one response, not an episode) and, with a tiny model, `env.max_tokens` within "
    "`model.max_position_embeddings`.",
)


def check_job(cfg: JobConfig, algorithm) -> None:
    """The rules that involve more than one section, or a section and the algorithm
    (CROSS_SECTION_RULES); the first broken one raises a one-line ConfigError. A rule of one
    section is that section's validator. `build_algorithm` calls this, so every command that
    builds the algorithm checks them before any actor starts."""
    # here, not at the top: rlsys.contract imports torch, which loading a config does not need
    from rlsys.contract import PlaysEpisodes, TrainsOnStaleRows, UnpackedOnly, policy_names

    name = cfg.algorithm.name
    mode = cfg.trainer.mode
    if mode != "sync":
        if not isinstance(algorithm, TrainsOnStaleRows):
            raise ConfigError(
                f"config error: 'trainer.mode'={mode}: algorithm '{name}' needs its "
                "rollout on the current policy (overlap and async take an algorithm that declares TrainsOnStaleRows: "
                "the rules in docs/configuration.md list them)"
            )
        if cfg.buffer.max_staleness < 1:
            raise ConfigError(
                f"config error: 'trainer.mode'={mode} trains on rows at least one policy version old: "
                "set buffer.max_staleness >= 1"
            )
    t = cfg.trainer
    if mode != "async" and (t.deterministic or t.staleness_policy != "wait"):
        key = "trainer.deterministic" if t.deterministic else "trainer.staleness_policy"
        raise ConfigError(f"config error: '{key}' applies to trainer.mode=async only (here: {mode})")
    if t.deterministic and t.staleness_policy == "drop":
        raise ConfigError(
            "config error: 'trainer.deterministic' fixes the interleaving by waiting: it takes "
            "trainer.staleness_policy=wait, not drop"
        )
    if mode == "async" and cfg.learner.lora.rank > 0 and cfg.learner.zero_stage == 3:
        raise ConfigError(
            "config error: 'trainer.mode'=async with learner.lora under learner.zero_stage=3: the producer's "
            "reference calls (the learner with its adapters off) would interleave with training's collectives "
            "on the ranks (allowed: zero_stage 0-2, or mode sync/overlap)"
        )
    if cfg.rollout.inflight_update != "finish" and (mode != "async" or cfg.rollout.backend != "hf"):
        raise ConfigError(
            f"config error: 'rollout.inflight_update'={cfg.rollout.inflight_update}: weights change during a "
            f"generation only under trainer.mode=async with rollout.backend=hf (here: {mode}, {cfg.rollout.backend})"
        )
    if cfg.rollout.inflight_update == "continue" and (cfg.rollout.decode != "lean" or cfg.rollout.kv_cache != "full"):
        raise ConfigError(
            "config error: 'rollout.inflight_update'=continue loads weights between the lean decoder's steps: it "
            f"needs rollout.decode=lean and rollout.kv_cache=full (here: {cfg.rollout.decode}, {cfg.rollout.kv_cache})"
        )
    if cfg.rollout.inflight_update == "continue" and t.deterministic:
        raise ConfigError(
            "config error: 'rollout.inflight_update'=continue: the decode step that new weights reach depends on "
            "timing, which trainer.deterministic=true rules out (use finish or resume)"
        )
    if mode == "async" and cfg.trainer.weight_sync not in ("auto", "object_store"):
        raise ConfigError(
            f"config error: 'trainer.weight_sync'={cfg.trainer.weight_sync}: trainer.mode=async loads new weights "
            "into workers between their generations while the learner trains on (allowed: auto, object_store)"
        )
    policies = policy_names(algorithm)
    if len(policies) > 1 and (cfg.rollout.backend != "hf" or cfg.trainer.weight_sync == "broadcast"):
        raise ConfigError(
            f"config error: algorithm '{name}' trains {len(policies)} policies "
            f"({', '.join(policies)}): that needs rollout.backend=hf and a trainer.weight_sync other "
            f"than broadcast"
        )
    if cfg.task.shaping and cfg.reward.source != "rule":
        raise ConfigError(
            f"config error: 'task.shaping' shapes the task's rule reward, but reward.source is "
            f"'{cfg.reward.source}' (its scores are not shaped): remove task.shaping or use "
            f"reward.source=rule"
        )
    if cfg.learner.lora.rank and cfg.rollout.backend == "vllm" and cfg.trainer.weight_sync == "broadcast":
        raise ConfigError(
            "config error: 'learner.lora' with rollout.backend=vllm: the engine serves the adapters as a LoRA "
            "request from a directory, so trainer.weight_sync must be object_store or shared_memory, not broadcast"
        )
    if cfg.learner.max_tokens_per_microbatch is not None and isinstance(algorithm, UnpackedOnly):
        raise ConfigError(
            f"config error: 'learner.max_tokens_per_microbatch'={cfg.learner.max_tokens_per_microbatch}: algorithm "
            f"'{name}' adds loss means over different units, which packed micro-batches cannot weigh exactly "
            "(allowed: null)"
        )
    if cfg.env.name is not None:
        if not isinstance(algorithm, PlaysEpisodes):
            raise ConfigError(
                f"config error: 'env.name'={cfg.env.name!r}: algorithm '{name}' has a rollout of its own, not the "
                "common one that plays episodes (the algorithms that declare PlaysEpisodes: the rules in "
                "docs/configuration.md list them)"
            )
        if cfg.task.shaping:
            raise ConfigError(
                "config error: 'task.shaping' shapes one response, not an episode of env.name: remove one of them"
            )
        context = cfg.model.max_position_embeddings
        if cfg.model.path is None and cfg.env.max_tokens is not None and cfg.env.max_tokens > context:
            raise ConfigError(
                f"config error: 'env.max_tokens'={cfg.env.max_tokens}: above the tiny model's context "
                f"(model.max_position_embeddings={context}; allowed: at most it, or null for it)"
            )


# ---- the reference: docs/configuration.md ------------------------------------------------------
REFERENCE_INTRO = """\
# Configuration reference

<!-- Generated from the config models by `rlsys config doc --output docs/configuration.md`;
     tests/floor/test_config.py fails when it is not current. Edit the descriptions in the code. -->

A job is one YAML file of sections (`configs/*.yaml`). `rlsys run CONFIG key=value ...` overrides
any key by its dotted name, the value read as YAML (`trainer.steps=5`, `algorithm.kl_coef=0.02`,
`task.operations=['+','-']`). An unknown key or a bad value fails before any actor starts, with one
line naming the key, the value and what is allowed. The core sections are `rlsys/config.py`'s; the
`algorithm` section holds `name` and the chosen algorithm's own keys (its `Config` in
`algorithms/<name>.py`). `[a, b]` in a type is the allowed range, `(` and `)` leaving the end out."""


def config_reference(algorithms: Mapping[str, type]) -> str:
    """docs/configuration.md, rendered from the models: a table per core section (JobConfig's
    fields, a nested section after its parent), the rules across sections, then one section per
    algorithm with its Config's keys. `algorithms`: registered name -> algorithm class, as
    `algorithms.base` has them (passed in: the floor never imports algorithms)."""
    # here, not at the top: rlsys.contract imports torch, which loading a config does not need
    from rlsys.contract import PlaysEpisodes, TrainsOnStaleRows, UnpackedOnly

    unpacked = ", ".join(n for n in sorted(algorithms) if issubclass(algorithms[n], UnpackedOnly))
    stale = ", ".join(n for n in sorted(algorithms) if issubclass(algorithms[n], TrainsOnStaleRows))
    episodes = ", ".join(n for n in sorted(algorithms) if issubclass(algorithms[n], PlaysEpisodes))
    sections = " · ".join(f"[{t}](#{_anchor(t)})" for t in [*JobConfig.model_fields, "rules across sections"])
    names = " · ".join(f"[{n}](#{_anchor(f'algorithm.name: {n}')})" for n in sorted(algorithms))
    out = [REFERENCE_INTRO, "", f"Sections: {sections}", "", f"Algorithms: {names}", ""]
    for name, field in JobConfig.model_fields.items():
        out += _section_doc(name, field.annotation, field.description, name, level=2)
    out += [
        "## Rules across sections",
        "",
        "Checked by `check_job` (`rlsys/config.py`) when the algorithm is built, before any actor starts:",
        "",
    ]
    out += [f"- {rule.format(stale=stale, episodes=episodes, unpacked=unpacked)}" for rule in CROSS_SECTION_RULES]
    out += [
        "",
        "## Algorithms",
        "",
        "`algorithm.name` picks one; its keys sit beside `name` in the `algorithm` section. Naming another "
        "algorithm on the command line than the file's (`algorithm.name=rloo` on a GRPO config) keeps the file's "
        "keys the named one has and leaves out, naming them, those it lacks.",
        "",
    ]
    for name in sorted(algorithms):
        config = algorithms[name].Config
        out += _section_doc(f"algorithm.name: {name}", config, _doc_line(config), "algorithm", level=3)
    return "\n".join(out).rstrip("\n") + "\n"


def _section_doc(title: str, model: type[BaseModel], intro: str | None, prefix: str, level: int) -> list[str]:
    """A heading, the section's one-line intro, a table of its keys, then its nested sections."""
    out = [f"{'#' * level} {title}", ""]
    if intro:
        out += [intro[0].upper() + intro[1:] + ("" if intro.endswith(".") else "."), ""]
    rows = [(k, f) for k, f in model.model_fields.items() if not _is_section(f.annotation)]
    if rows:
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        for key, field in rows:
            default = json.dumps(field.get_default(call_default_factory=True))
            cells = [f"`{prefix}.{key}`", f"`{_type_cell(field)}`", f"`{default}`", field.description or ""]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    for key, field in model.model_fields.items():
        if _is_section(field.annotation):
            out += _section_doc(f"{prefix}.{key}", field.annotation, field.description, f"{prefix}.{key}", level + 1)
    return out


def _is_section(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _doc_line(cls: type) -> str | None:
    """The first paragraph of a class's own docstring, on one line."""
    doc = cls.__dict__.get("__doc__")
    return " ".join(doc.strip().split("\n\n")[0].split()) if doc else None


def _type_cell(field) -> str:
    """The field's type with its bounds: `int >= 1`, `float in (0, 1]`, `int >= 1 | null`."""
    args = get_args(field.annotation)
    if get_origin(field.annotation) in (Union, types.UnionType) and type(None) in args and len(args) == 2:
        return f"{_type_text(next(a for a in args if a is not type(None)))}{_bounds(field)} | null"
    return f"{_type_text(field.annotation)}{_bounds(field)}"


def _type_text(annotation) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is Union or origin is types.UnionType:
        return " | ".join(_type_text(a) for a in args)
    if origin is list:
        return f"list[{_type_text(args[0])}]" if args and args[0] is not Any else "list"
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(field) -> str:
    """The field's numeric bounds as ` >= a`, ` in [a, b]`, ...; a string's least length."""
    low = high = None
    for m in field.metadata:
        if isinstance(m, annotated_types.Ge):
            low = ("[", ">=", m.ge)
        elif isinstance(m, annotated_types.Gt):
            low = ("(", ">", m.gt)
        elif isinstance(m, annotated_types.Le):
            high = ("]", "<=", m.le)
        elif isinstance(m, annotated_types.Lt):
            high = (")", "<", m.lt)
        elif isinstance(m, annotated_types.MinLen):
            return f", at least {m.min_length} character{'s' if m.min_length > 1 else ''}"
    if low and high:
        return f" in {low[0]}{low[2]}, {high[2]}{high[0]}"
    if low or high:
        return f" {(low or high)[1]} {(low or high)[2]}"
    return ""


def _anchor(title: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return "".join(c for c in title.lower() if c.isalnum() or c in " -_").replace(" ", "-")


# ---- loading -----------------------------------------------------------------------------------
RENAMED_KEYS = {"trainer.overlap_rollout": "trainer.mode: overlap"}  # an old config is told the new key


def _describe(err: dict, prefix: str) -> str:
    key = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
    value = err.get("input")
    if err["type"] == "extra_forbidden":
        renamed = RENAMED_KEYS.get(key)
        return f"config error: unknown key '{key}'" + (f" (it became {renamed})" if renamed else "")
    if err["type"] == "missing":
        return f"config error: '{key}' is required"
    return f"config error: {key} = {value!r}: {err['msg']}"


def validate_section(model_cls: type[BaseModel], data: dict, prefix: str = "") -> BaseModel:
    """Validate `data` into `model_cls`, turning the first pydantic error into a ConfigError."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e.errors()[0], prefix)) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a","b","c"], yaml-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"config error: override '{text}' is not of the form key=value")
    key, raw = text.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"config error: override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"config error: '{'.'.join(path)}': '{part}' is not a section")
            node = child
        node[path[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config error: file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config error: {path} is not valid YAML{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config error: {path} must hold a mapping of sections")
    return data


def keys_written_for_another_algorithm(written: dict, overrides: list[str]) -> set[str]:
    """The file's algorithm keys not set on the command line, when the command line names another
    algorithm than the file does (`algorithm.name=rloo` over a GRPO config): `build_algorithm`
    leaves out, naming them, those the named algorithm has no field for."""
    file_section = written.get("algorithm") or {}
    parsed = [parse_override(o) for o in overrides]
    named = next((value for path, value in reversed(parsed) if path == ["algorithm", "name"]), None)
    whole = any(path == ["algorithm"] for path, _ in parsed)  # algorithm={...}: the file's section replaced
    if not isinstance(file_section, dict) or whole or named in (None, file_section.get("name", "grpo")):
        return set()
    given = {path[1] for path, _ in parsed if len(path) > 1 and path[0] == "algorithm"}
    return {key for key in file_section if key != "name" and key not in given}


def load_config(path: str | Path | None = None, overrides: list[str] = (), data: dict | None = None) -> JobConfig:
    written = load_yaml(path) if path is not None else (data or {})
    cfg = validate_section(JobConfig, apply_overrides(written, list(overrides)))
    cfg.algorithm._written_for_another = keys_written_for_another_algorithm(written, list(overrides))
    cfg.reward.function = cfg.reward.located_function(Path(path).parent if path is not None else None)
    cfg.env.name = cfg.env.located_name(Path(path).parent if path is not None else None)
    return cfg


def dump_config(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
