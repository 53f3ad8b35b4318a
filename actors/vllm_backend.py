"""vLLM rollout backend: the same interface as the transformers backend (actors/rollout.py).

`import vllm` happens only in `VLLMBackend.__init__`, so this module (and its pure
functions, unit-tested everywhere) imports without vllm.

How it maps onto vLLM's public API:
- the engine is `vllm.LLM(model_dir, tensor_parallel_size, gpu_memory_utilization, ...,
  worker_extension_cls="actors.vllm_worker.RlsysWorkerExtension", skip_tokenizer_init=True,
  logprobs_mode="processed_logprobs")`; prompts go in as token ids (`TokensPrompt`), one
  `vllm.SamplingParams` per request (`vllm_sampling_kwargs`), and vLLM batches them itself;
- new weights go in place through `LLM.collective_rpc` into the worker extension, which
  calls `model_runner.model.load_weights(weights=[(name, tensor), ...])` on every
  tensor-parallel worker (vLLM's weight loaders stack q/k/v and gate/up and shard);
  afterwards the prefix cache is reset (its KV was computed with the old weights).

Logprobs. The transformers backend records log_softmax(logits / T) of each sampled token
(raw logits for greedy), before top-k/top-p. vLLM's engine-wide `logprobs_mode`:
`raw_logprobs` (its default) is log_softmax(logits) with no temperature, so it is wrong for
T != 1; `processed_logprobs` is taken after temperature and after top-k/top-p truncation.
This backend uses `processed_logprobs`: equal to the transformers backend's convention
whenever top_k = 0 and top_p = 1 (the config defaults), and for greedy requests; with
top-k/top-p truncation it is the log-probability under the truncated, renormalised
distribution the token was drawn from (>= the untruncated value).

Not served (one line each, `unsupported_reason`): PILAF interpolated sampling, response
embeddings, the SpeCache KV cache and SliM-LLM quantised policies (make_backend refuses the
last two before getting here).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from actors.lora import is_adapter_state, write_peft_adapter
from rlsys.generation import Generation, GenerationRequest, SamplingParams

WORKER_EXTENSION = "actors.vllm_worker.RlsysWorkerExtension"
MAX_VLLM_TEMPERATURE = 2.0  # vLLM's SamplingParams refuses temperature > 2
DEFAULT_WEIGHT_BUCKET_BYTES = 512 << 20


# ---- requests -> vLLM ----------------------------------------------------------------------
def unsupported_reason(request: GenerationRequest) -> str | None:
    """Why the vLLM backend cannot serve `request` (one line), or None."""
    if request.params.interpolation is not None:
        return (
            "rollout.backend=vllm does not serve interpolated sampling (PILAF); "
            "use rollout.backend=hf for algorithm pilaf"
        )
    if request.embedding is not None:
        return (
            "rollout.backend=vllm does not return response embeddings "
            f"(embedding={request.embedding!r}); use rollout.backend=hf"
        )
    if request.params.temperature > MAX_VLLM_TEMPERATURE:
        return f"rollout.backend=vllm: temperature {request.params.temperature} > {MAX_VLLM_TEMPERATURE} (vLLM's limit)"
    return None


def vllm_sampling_kwargs(params: SamplingParams, eos_ids: Iterable[int] = ()) -> dict[str, Any]:
    """rlsys SamplingParams -> keyword arguments of `vllm.SamplingParams`, one to one:
    temperature (0 = greedy in both), top_p, top_k (0 = off here, -1 = off in vLLM),
    max_new_tokens -> max_tokens, stop_token_ids (plus the model's eos ids, which the
    transformers backend always stops at), n, seed, and logprobs=0 (the sampled token's
    logprob only). Greedy with n > 1 asks vLLM for 1 sequence (vLLM refuses greedy n > 1;
    `generations_from_outputs` repeats it n times, which is exact for greedy decoding)."""
    return {
        "n": 1 if params.greedy else params.n,
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": -1 if params.top_k == 0 else int(params.top_k),
        "max_tokens": int(params.max_new_tokens),
        "stop_token_ids": sorted(set(params.stop_token_ids) | set(eos_ids)),
        "seed": params.seed,
        "logprobs": 0,
        "detokenize": False,  # token ids in, token ids out: the engine holds no tokenizer
    }


def plan_requests(requests: Sequence[GenerationRequest], eos_ids: Iterable[int] = ()):
    """One vLLM prompt (a TokensPrompt dict) and one sampling-kwargs dict per request, in
    request order: vLLM batches across requests itself (continuous batching), so there is
    no length bucketing here. Identical params share one kwargs dict (one vLLM object).
    Raises ValueError with one line for a request the backend cannot serve."""
    eos_ids = tuple(eos_ids)
    prompts, kwargs, shared = [], [], {}
    for i, request in enumerate(requests):
        reason = unsupported_reason(request)
        if reason:
            raise ValueError(f"request {i}: {reason}")
        if not request.prompt_ids:
            raise ValueError(f"request {i}: empty prompt_ids")
        prompts.append({"prompt_token_ids": [int(t) for t in request.prompt_ids]})
        if request.params not in shared:
            shared[request.params] = vllm_sampling_kwargs(request.params, eos_ids)
        kwargs.append(shared[request.params])
    return prompts, kwargs


# ---- vLLM outputs -> Generations -------------------------------------------------------------
def plain_output(request_output) -> list[dict]:
    """A vLLM RequestOutput as plain data: one dict per completion, in completion index
    order, with token_ids, the sampled tokens' logprobs and vLLM's finish_reason."""
    completions = sorted(request_output.outputs, key=lambda c: c.index)
    out = []
    for c in completions:
        token_ids = list(c.token_ids)
        if c.logprobs is None:
            raise RuntimeError("vLLM returned no logprobs (the backend asks for logprobs=0)")
        logprobs = [float(step[t].logprob) for t, step in zip(token_ids, c.logprobs)]
        out.append({"token_ids": token_ids, "logprobs": logprobs, "finish_reason": c.finish_reason})
    return out


def finish_reason(vllm_reason: str | None) -> str:
    """vLLM finish_reason -> Generation.finish_reason ("stop" for eos/stop ids, "length")."""
    if vllm_reason in ("stop", "length"):
        return vllm_reason
    raise RuntimeError(f"vLLM finished a sequence with reason {vllm_reason!r} (expected stop or length)")


def generations_from_outputs(requests: Sequence[GenerationRequest], outputs: Sequence[list[dict]]) -> list[Generation]:
    """Per request (in order) its plain completions -> `n` Generations per request, in
    request order, as the transformers backend returns them."""
    if len(outputs) != len(requests):
        raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(requests)} requests")
    gens: list[Generation] = []
    for i, (request, completions) in enumerate(zip(requests, outputs)):
        n = request.params.n
        if request.params.greedy and len(completions) == 1:
            completions = completions * n
        if len(completions) != n:
            raise RuntimeError(f"request {i}: vLLM returned {len(completions)} completions, expected n={n}")
        for c in completions:
            if len(c["logprobs"]) != len(c["token_ids"]):
                raise RuntimeError(f"request {i}: {len(c['token_ids'])} tokens but {len(c['logprobs'])} logprobs")
            gens.append(
                Generation(
                    i,
                    list(request.prompt_ids),
                    list(c["token_ids"]),
                    list(c["logprobs"]),
                    finish_reason(c["finish_reason"]),
                )
            )
    return gens


# ---- weights -------------------------------------------------------------------------------
NON_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some HF versions save; vLLM recomputes them


def vllm_weight_items(weights: dict[str, np.ndarray], tie_word_embeddings: bool) -> list[tuple[str, np.ndarray]]:
    """The HF state dict (what Learner.weights returns) -> (name, array) pairs for vLLM's
    `model.load_weights`, which takes HF checkpoint names and does the q/k/v and gate/up
    stacking and the tensor-parallel sharding itself. Drops `lm_head.weight` when the
    embeddings are tied (the same tensor as model.embed_tokens.weight; vLLM skips it) and
    rotary buffers. Arrays stay as they are: numpy has no bfloat16, so the dtype
    conversion to the engine's dtype happens in the worker (`engine_tensor`)."""
    items = []
    for name, array in weights.items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith(NON_WEIGHT_SUFFIXES):
            continue
        if name.startswith("value_head."):
            raise ValueError(f"weight {name} belongs to the PPO value head, not the policy")
        items.append((name, array))
    if not items:
        raise ValueError("no policy weights to load")
    return items


def weight_buckets(items: Sequence[tuple[str, np.ndarray]], max_bytes: int = DEFAULT_WEIGHT_BUCKET_BYTES):
    """Consecutive groups of (name, array) of at most `max_bytes` each (a larger single
    tensor goes alone): one collective_rpc per group bounds the engine's transient memory."""
    buckets, size = [], 0
    for name, array in items:
        nbytes = int(array.nbytes)
        if not buckets or size + nbytes > max_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, array))
        size += nbytes
    return buckets


def weight_payload(items: Sequence[tuple[str, Any]]) -> list[tuple[str, str, list[int], bytes]]:
    """(name, array) pairs as plain data for `LLM.collective_rpc`: (name, dtype string, shape,
    raw bytes). vLLM's engine process decodes rpc arguments with msgpack, which carries bytes,
    strings and lists everywhere but not numpy arrays as such. bf16 tensors (a bf16 learner's
    shared-memory slot) go as dtype "bfloat16" with their 2-byte values."""
    import torch

    from actors.shared_weights import BF16, bf16_bits  # torch: this module imports without it

    out = []
    for name, a in items:
        if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16:
            out.append((name, BF16, list(a.shape), bf16_bits(a).tobytes()))
        else:
            out.append((name, np.asarray(a).dtype.str, list(np.shape(a)), np.ascontiguousarray(a).tobytes()))
    return out


def tied_embeddings(model_dir: str | Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))


def eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The model config's eos id(s), which the transformers backend always stops at."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


# ---- placement and engine ----------------------------------------------------------------------
def rollout_placement(num_workers: int, tensor_parallel_size: int, cpus_per_worker: float = 1.0):
    """Ray placement-group bundles for `num_workers` vLLM engines of `tensor_parallel_size`
    GPUs each: one bundle per engine holding all its GPUs (a bundle lives on one node, so
    an engine's tensor-parallel group never spans nodes), engines packed onto as few nodes
    as possible. Returns (bundles, strategy); worker i runs in bundle i with
    num_gpus=tensor_parallel_size and vLLM's multiprocessing executor uses those GPUs."""
    if num_workers < 1 or tensor_parallel_size < 1:
        raise ValueError(
            f"rollout placement needs >= 1 worker and >= 1 GPU each, got {num_workers} x {tensor_parallel_size}"
        )
    bundle = {"GPU": float(tensor_parallel_size), "CPU": float(cpus_per_worker)}
    return [dict(bundle) for _ in range(num_workers)], "PACK"


def engine_kwargs(
    model_dir: str,
    tensor_parallel_size: int = 1,
    gpu_memory_utilization: float = 0.9,
    seed: int = 0,
    dtype: str = "auto",
    max_model_len: int | None = None,
    enforce_eager: bool = False,
    max_lora_rank: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for a rollout engine; `max_lora_rank` (learner.lora.rank)
    turns on its LoRA support, one adapter at a time (the policy's latest)."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization {gpu_memory_utilization} must be in (0, 1]")
    kwargs = {
        "model": str(model_dir),
        "tensor_parallel_size": int(tensor_parallel_size),
        "gpu_memory_utilization": float(gpu_memory_utilization),
        "seed": int(seed),
        "dtype": dtype,
        "skip_tokenizer_init": True,  # prompts are token ids; no tokenizer is loaded
        "logprobs_mode": "processed_logprobs",  # after temperature (see the module docstring)
        "generation_config": "vllm",  # no sampling defaults from the model's generation_config.json
        "worker_extension_cls": WORKER_EXTENSION,
        "distributed_executor_backend": "mp" if tensor_parallel_size > 1 else None,
        "enforce_eager": enforce_eager,
    }
    if max_model_len is not None:
        kwargs["max_model_len"] = int(max_model_len)
    if max_lora_rank:
        kwargs.update(enable_lora=True, max_lora_rank=int(max_lora_rank), max_loras=1)
    return {k: v for k, v in kwargs.items() if v is not None}


class VLLMBackend:
    """The rollout backend on a vLLM engine (GPU). Same interface as HFBackend:
    `generate(requests) -> list[Generation]` and `load_weights(weights)`."""

    def __init__(
        self,
        model_dir: str,
        batch_size: int = 64,
        reference_dir: str | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        seed: int = 0,
        dtype: str = "auto",
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        max_lora_rank: int | None = None,
    ):
        try:
            import vllm
        except ImportError as e:
            raise RuntimeError(f"rollout.backend=vllm needs vllm installed ({e})") from None
        self.vllm = vllm
        self.model_dir = model_dir
        self.eos_ids = eos_token_ids(model_dir)
        self.tied = tied_embeddings(model_dir)
        self.llm = vllm.LLM(
            **engine_kwargs(
                model_dir,
                tensor_parallel_size,
                gpu_memory_utilization,
                seed,
                dtype,
                max_model_len,
                enforce_eager,
                max_lora_rank,
            )
        )
        self.lora_request = None  # the policy's adapters (learner.lora) as a vLLM LoRARequest, once synced
        self.lora_dir = None  # where their peft directories are written, one per sync
        self.weight_sync_ranks = tensor_parallel_size  # members this engine adds to a broadcast group

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        prompts, kwargs = plan_requests(requests, self.eos_ids)
        objects: dict[int, Any] = {}
        params = [objects.setdefault(id(k), self.vllm.SamplingParams(**k)) for k in kwargs]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        return generations_from_outputs(requests, [plain_output(o) for o in outputs])

    def load_weights(self, weights: dict[str, np.ndarray], partial: bool = False) -> None:
        """In place, on every tensor-parallel worker, through the worker extension (vLLM's
        `load_weights` takes any subset of the tensors: a bucket loads as the whole does). LoRA
        adapters become the engine's LoRA request instead (`use_adapters`)."""
        if is_adapter_state(weights):
            self.use_adapters(weights)
            return
        for bucket in weight_buckets(vllm_weight_items(weights, self.tied)):
            self.llm.collective_rpc("rlsys_load_weights", args=(weight_payload(bucket),))
        self.llm.reset_prefix_cache()

    def use_adapters(self, weights) -> None:
        """Serve the base model with these adapters: written as a peft directory and requested by
        a new LoRARequest id (vLLM caches adapters by id), the previous directory removed."""
        import shutil
        import tempfile

        from vllm.lora.request import LoRARequest

        if self.lora_dir is None:
            self.lora_dir = Path(tempfile.mkdtemp(prefix="rlsys-lora-"))
        previous = self.lora_request
        lora_id = 1 if previous is None else previous.lora_int_id + 1
        path = write_peft_adapter(weights, self.lora_dir / f"v{lora_id}", self.model_dir)
        self.lora_request = LoRARequest(f"policy-{lora_id}", lora_id, str(path))
        if previous is not None:
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()

    # weight broadcast (trainer.weight_sync=broadcast): each tensor-parallel worker of the
    # engine is one member of the group, ranks first_rank .. first_rank + tp - 1
    def open_weight_broadcast(
        self, master_addr: str, master_port: int, first_rank: int, world_size: int, timeout_s: float
    ) -> None:
        self.llm.collective_rpc(
            "rlsys_open_broadcast", args=(master_addr, master_port, first_rank, world_size, timeout_s)
        )

    def receive_weight_broadcast(self, version: int, manifest) -> None:
        self.llm.collective_rpc(
            "rlsys_receive_broadcast", args=(version, [(s.name, list(s.shape), s.dtype) for s in manifest])
        )
        self.llm.reset_prefix_cache()
