"""Typed job configuration: YAML in configs/, dotted overrides from the command line.

A bad config fails before any actor starts with one line naming the key, the bad value
and what is allowed (`ConfigError`; the CLI prints it and exits 2).

The `algorithm` section is validated in two passes: here only its `name`; the chosen
algorithm's own `Config` model then validates the rest (`validate_section`), so a new
algorithm brings its own keys without touching this file.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ConfigError(ValueError):
    """One-line, user-facing configuration error."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(Section):
    name: str = "quickstart"
    seed: int = 0
    output_dir: str = "runs"


Architecture = Literal["qwen2", "qwen3", "llama", "mistral", "phi3", "gemma"]  # Llama-family decoders the tiny factory builds


class ModelConfig(Section):
    path: Optional[str] = Field(None, description="local HF model dir; none builds a tiny model")
    architecture: Architecture = Field(
        "qwen2", description="the tiny model's transformers model type (with `path`: the directory's own)")
    vocab_size: int = Field(512, ge=32, le=65536)
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(384, ge=8)
    num_hidden_layers: int = Field(4, ge=1, le=64)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1)
    max_position_embeddings: int = Field(256, ge=16)


class TaskConfig(Section):
    name: str = "arithmetic"
    train_path: Optional[str] = Field(None, description="jsonl/parquet of {prompt, answer}; none generates")
    eval_path: Optional[str] = None
    num_train: int = Field(4000, ge=1)
    num_eval: int = Field(200, ge=1)
    min_value: int = Field(0, ge=0)
    max_value: int = Field(99, ge=1)
    operations: list[Literal["+", "-", "*"]] = ["+"]
    shaping: list[Any] = Field(default_factory=list, description="reward functions applied in order to the task's "
                               "reward: names or {name: {params}} (cosine_length, repetition; envs/rewards.py checks them)")


class SFTConfig(Section):
    steps: int = Field(150, ge=0)
    demo_error: float = Field(0.0, ge=0, le=1, description="probability that a warm-up demonstration is the task's "
                              "flawed one (arithmetic: carries dropped), like imperfect SFT data")
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)


class RolloutConfig(Section):
    backend: Literal["hf", "vllm"] = "hf"
    num_workers: int = Field(1, ge=1, le=64)
    threads_per_worker: int = Field(1, ge=1)
    max_new_tokens: int = Field(8, ge=1, le=4096)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    batch_size: int = Field(64, ge=1, description="sequences per generate call")
    eval_greedy: bool = True
    decode: Literal["lean", "generate"] = Field("lean", description="hf backend: lean decode loop (Llama-family "
                                                "models; others fall back) or transformers' generate")
    kv_cache: Literal["full", "specache"] = Field("full", description="specache: SpeCache two-tier KV cache (hf backend)")
    specache_k: int = Field(64, ge=1, description="full-precision KV pairs fetched per decode step")
    specache_bits: int = Field(2, ge=1, le=4, description="bits of the low-bit KV copy in the fast tier")
    specache_window: int = Field(32, ge=0, description="most recent positions kept in full precision")
    quantized: Optional[str] = Field(None, description="SliM-LLM quantised dir (rlsys quantize) to serve, hf backend")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per vLLM engine (vllm backend)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU memory fraction a vLLM engine takes")

    @field_validator("decode")
    @classmethod
    def _hf_decode(cls, v, info):
        if v != "lean" and info.data.get("backend") != "hf":
            raise ValueError("is a setting of rollout.backend 'hf' only")
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
            raise ValueError("must be a directory written by `rlsys quantize` (quantize_config.json, quantized.safetensors)")
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


class LearnerConfig(Section):
    num_ranks: int = Field(1, ge=1, le=64)
    zero_stage: int = Field(0, ge=0, le=3)
    lr: float = Field(1e-3, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="decay after the warm-up")
    warmup_steps: int = Field(0, ge=0, description="trainer steps of linear lr warm-up")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final lr / lr of the linear and cosine schedules")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_size: int = Field(64, ge=1)
    epochs: int = Field(1, ge=1)
    minibatches: int = Field(1, ge=1)
    threads: int = Field(1, ge=1)
    bf16: bool = Field(False, description="DeepSpeed bf16 (CUDA learners)")


class TrainerConfig(Section):
    steps: int = Field(20, ge=0)
    prompts_per_step: int = Field(32, ge=1)
    eval_every: int = Field(10, ge=0)
    checkpoint_every: int = Field(0, ge=0)
    keep_checkpoints: int = Field(2, ge=1)
    sync_timeout_s: float = Field(120.0, gt=0)
    start_timeout_s: float = Field(600.0, gt=0, description="the most the run's rollout and learner actors may take to "
                                   "start (a cluster that cannot place them ends the run in one line)")
    weight_sync: Literal["auto", "shared_memory", "object_store", "broadcast"] = Field(
        "auto", description="shared_memory: a /dev/shm file on learner rank 0's node the workers there map; "
        "object_store: Ray's object store; auto: shared_memory where every rollout worker is on learner rank 0's "
        "node and /dev/shm has room, else object_store; broadcast: a torch.distributed group from learner rank 0 "
        "(NCCL with vllm, else gloo)")
    overlap_rollout: bool = Field(False, description="generate the next step's experience while the learner trains "
                                  "(one policy version behind; needs buffer.max_staleness >= 1; grpo, rloo)")


class BufferConfig(Section):
    max_staleness: int = Field(0, ge=0, description="drop rows older than this many policy versions")
    capacity: int = Field(100_000, ge=1)


class RayConfig(Section):
    address: Optional[str] = None
    num_cpus: Optional[int] = Field(None, ge=1)


class SandboxConfig(Section):
    """Code execution for tasks that need it (task.name=code): a SandboxPool on Ray."""

    backend: Literal["bwrap", "docker"] = "bwrap"
    workers: int = Field(2, ge=1, le=256, description="concurrent sandboxed runs")
    wall_time_s: float = Field(10.0, gt=0, le=600, description="per run (the paper: 10 s per test)")
    cpu_time_s: float = Field(10.0, gt=0, le=600)
    memory_mb: int = Field(1024, ge=64, le=65536, description="the paper: 1 GB")


class JudgeConfig(Section):
    """The generative judge (actors/judge.py) as a reward source: plan, execution, verdict."""

    mode: Literal["pointwise", "pairwise"] = Field(
        "pointwise", description="pointwise: 'Score: N' mapped to [0, 1]; pairwise: win rates within each group, both orders")
    backend: Literal["hf", "vllm"] = "hf"
    batch_size: int = Field(32, ge=1, description="sequences per generate call")
    max_plan_tokens: int = Field(64, ge=1, le=4096)
    max_execution_tokens: int = Field(128, ge=1, le=4096)
    temperature: float = Field(0.0, ge=0, description="0 is greedy")
    min_score: int = 1
    max_score: int = 10
    unparsable_reward: float = Field(0.0, description="pointwise reward of a response whose score is unparsable")

    @field_validator("max_score")
    @classmethod
    def _above_min(cls, v, info):
        if "min_score" in info.data and v <= info.data["min_score"]:
            raise ValueError(f"must be above reward.judge.min_score ({info.data['min_score']})")
        return v


def _model_dir_for(source: str, v, info, required: bool):
    """A reward model/judge directory: only for reward.source `source`, required there if `required`, must hold a model."""
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


class RewardConfig(Section):
    """Where rewards come from: the task's rule, a sequence-classification reward model, or a judge."""

    source: Literal["rule", "model", "judge"] = "rule"
    model_dir: Optional[str] = Field(None, validate_default=True, description="reward model dir (`rlsys rm train`)")
    judge_dir: Optional[str] = Field(None, description="judge causal LM dir; none: the initial policy judges")
    judge: JudgeConfig = JudgeConfig()

    @field_validator("model_dir")
    @classmethod
    def _model_dir(cls, v, info):
        return _model_dir_for("model", v, info, required=True)

    @field_validator("judge_dir")
    @classmethod
    def _judge_dir(cls, v, info):
        return _model_dir_for("judge", v, info, required=False)


class AlgorithmSection(BaseModel):
    """Only `name` is checked here; the algorithm's own Config validates the other keys."""

    model_config = ConfigDict(extra="allow")
    name: str = "grpo"


class JobConfig(Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sft: SFTConfig = SFTConfig()
    rollout: RolloutConfig = RolloutConfig()
    learner: LearnerConfig = LearnerConfig()
    trainer: TrainerConfig = TrainerConfig()
    buffer: BufferConfig = BufferConfig()
    ray: RayConfig = RayConfig()
    reward: RewardConfig = RewardConfig()
    sandbox: SandboxConfig = SandboxConfig()
    algorithm: AlgorithmSection = AlgorithmSection()

    def algorithm_params(self) -> dict[str, Any]:
        return {k: v for k, v in self.algorithm.model_dump().items() if k != "name"}


def _describe(err: dict, prefix: str) -> str:
    key = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
    value = err.get("input")
    if err["type"] == "extra_forbidden":
        return f"config error: unknown key '{key}'"
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


def load_config(path: str | Path | None = None, overrides: list[str] = (), data: dict | None = None) -> JobConfig:
    raw = load_yaml(path) if path is not None else (data or {})
    raw = apply_overrides(raw, list(overrides))
    return validate_section(JobConfig, raw)


def dump_config(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
