"""Rollout worker: batched generation from token ids with per-token logprobs.

The backend interface (`RolloutBackend`) is what the transformers backend here and the
vLLM backend (actors/vllm_backend.py, imported lazily) both implement:
`generate(requests) -> generations` and `load_weights(weights)`.

Two optional request features: `SamplingParams.interpolation` samples from a token-by-token
mix of the policy's and the reference's logits (PILAF), and `GenerationRequest.embedding`
returns a mean-pooled hidden state of each response. A backend that serves either may load
the reference model (the initial policy, whose weights the rollout worker starts from),
lazily, on the first request that needs it.
"""

from __future__ import annotations

import inspect
import threading
import time
from contextlib import nullcontext
from typing import Protocol, Sequence

import numpy as np
import torch

from actors.lean_decode import LeanDecoder, positions_from_mask, supports_lean_decode
from actors.lora import MergedAdapters, is_adapter_state
from actors.modeling import adopt_numpy_state, load_numpy_state, pad_sequences, quiet_transformers
from actors.shared_weights import SharedWeights
from actors.weight_broadcast import BroadcastGroup
from rlsys.errors import WeightsCorrupt
from rlsys.generation import Generation, GenerationRequest, Interpolation, SamplingParams, interpolated_logits
from rlsys.models import load_model
from rlsys.weight_digest import first_mismatch


class RolloutBackend(Protocol):
    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]: ...
    def load_weights(self, weights: dict[str, np.ndarray], partial: bool = False) -> None: ...  # partial: a bucket


def expand_requests(requests: Sequence[GenerationRequest]) -> list[tuple[int, list[int], SamplingParams]]:
    """One entry per sampled sequence: (request index, prompt ids, params), n per request."""
    empty = [i for i, r in enumerate(requests) if len(r.prompt_ids) == 0]
    if empty:
        raise ValueError(
            f"generation request {empty[0]} has an empty prompt (no token to condition on; "
            f"{len(empty)} of {len(requests)} requests are empty)"
        )
    return [(i, list(r.prompt_ids), r.params) for i, r in enumerate(requests) for _ in range(r.params.n)]


def length_buckets(items: list, batch_size: int, key) -> list[list[int]]:
    """Indices grouped into batches of similar `key` length (less padding per batch)."""
    order = sorted(range(len(items)), key=lambda i: key(items[i]))
    return [order[s : s + batch_size] for s in range(0, len(order), batch_size)]


def cut_at_stop(tokens: list[int], stop_ids: set[int]) -> tuple[list[int], str]:
    """Response up to and including the first stop token."""
    for j, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: j + 1], "stop"
    return tokens, "length"


def rows_until_stop(new_tokens: torch.Tensor, logprobs: torch.Tensor, stop_ids: set[int]):
    """(tokens, logprobs, finish reason) of each row of a generated batch, cut after its first stop token."""
    results = []
    for row, lp in zip(new_tokens.tolist(), logprobs.tolist()):
        tokens, reason = cut_at_stop(row, stop_ids)
        results.append((tokens, lp[: len(tokens)], reason))
    return results


class ReferenceMixing:
    """A transformers logits processor that replaces the policy's next-token logits h_theta by
    `interpolated_logits(h_theta, h_ref, beta, mode)`. It runs the reference model alongside
    generate with its own KV cache (positions follow the left-padded prompts' attention mask,
    as transformers does for the policy). It runs before temperature/top-k/top-p, so those
    apply to the mixed logits; the recorded logprobs stay the policy's (raw logits)."""

    def __init__(self, reference, interpolation: Interpolation, prompt_attention_mask: torch.Tensor):
        self.reference, self.interpolation = reference, interpolation
        self.attention_mask = prompt_attention_mask
        self.seen, self.last_position = 0, None
        from transformers import DynamicCache  # filled in place; transformers 5.2x names the argument `cache`

        self.cache = DynamicCache()
        self.cache_arg = "cache" if "cache" in inspect.signature(reference.forward).parameters else "past_key_values"

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.seen == 0:
            new = input_ids
            positions = positions_from_mask(self.attention_mask)
        else:
            new = input_ids[:, self.seen :]
            ones = torch.ones_like(new, dtype=self.attention_mask.dtype)
            self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)
            positions = self.last_position[:, None] + 1 + torch.arange(new.shape[1], device=new.device)
        out = self.reference(
            input_ids=new,
            attention_mask=self.attention_mask,
            position_ids=positions,
            use_cache=True,
            **{self.cache_arg: self.cache},
        )
        self.seen, self.last_position = input_ids.shape[1], positions[:, -1]
        h_ref = out.logits[:, -1].to(scores.dtype)
        return interpolated_logits(scores, h_ref, self.interpolation.beta, self.interpolation.mode)


class HFBackend:
    """transformers `generate` with KV cache; logprobs from the raw logits / temperature.
    `reference_dir` (default: `model_dir`, the initial policy) or an in-memory `reference`
    serves interpolated sampling and reference embeddings; it is loaded on first use."""

    def __init__(
        self,
        model_dir: str,
        batch_size: int = 64,
        model=None,
        reference_dir: str | None = None,
        reference=None,
        quantized: str | None = None,
        specache: dict | None = None,
        device: str = "cpu",
        decode: str = "lean",
        dtype: str = "float32",
    ):
        """`dtype` (rollout.dtype): the lean decoder's compute dtype."""
        quiet_transformers()
        self.requantize = None  # (group size, bit maps) when serving a SliM-LLM quantised policy
        self.adapters = None  # MergedAdapters once a LoRA sync arrives (learner.lora)
        if quantized:
            from rlsys.quantize import load_quantized  # the quantiser: only a quantised policy loads it
            from rlsys.quantize.model import quantized_bit_maps  # as above

            model, self.requantize = load_quantized(quantized), quantized_bit_maps(quantized)
        self.model = model if model is not None else load_model(model_dir)
        self.device = torch.device(device)  # "cuda" serves the policy from a GPU (benchmarks/gpu_check.py)
        self.model.to(self.device).eval()
        self.reference_dir = reference_dir or model_dir
        self._reference = reference.eval() if reference is not None else None
        self.batch_size = batch_size
        self.specache = specache  # SpeCache two-tier KV cache settings (k, bits, window); None: full cache
        cfg = self.model.config
        eos = cfg.eos_token_id
        if eos is None and cfg.pad_token_id is None:
            raise ValueError(
                f"{model_dir}: the model's config has neither eos_token_id nor pad_token_id; the rollout needs one "
                "(set eos_token_id in its config.json)"
            )
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else next(iter(self.eos_ids))
        # decode "lean": actors/lean_decode.py for Llama-family models (else, and for "generate", `model.generate`)
        if decode not in ("lean", "generate"):
            raise ValueError(f"rollout.decode must be 'lean' or 'generate', not {decode!r}")
        self.dtype = getattr(torch, dtype)
        self.lean = (
            LeanDecoder(self.model, self.dtype) if decode == "lean" and supports_lean_decode(self.model) else None
        )
        if self.lean is None and self.dtype != torch.float32:
            raise ValueError(
                f"rollout.dtype={dtype} is the lean decoder's, which does not run {model_dir} "
                f"(model_type {cfg.model_type}, rollout.decode {decode}): use rollout.dtype=float32"
            )
        self._lean_reference = None

    def load_weights(self, weights: dict[str, np.ndarray], partial: bool = False) -> None:
        """New policy weights (`partial`: one bucket of them); a quantised policy re-rounds them on
        its saved bit maps (in place, so it copies them); otherwise the model reads the given arrays
        without a copy. LoRA adapters (learner.lora) are merged into the initial weights."""
        if self.lean is not None:
            self.lean.weights_changed()
        if is_adapter_state(weights):
            self.adapters = self.adapters or MergedAdapters(self.model)
            self.adapters.load(weights)
        elif self.requantize is None:
            adopt_numpy_state(self.model, weights, partial)
        else:
            load_numpy_state(self.model, weights, partial)
        if self.requantize is None:
            return
        from rlsys.quantize.model import requantize  # the quantiser: only a quantised policy loads it

        requantize(self.model, self.requantize[1], self.requantize[0])

    @property
    def reference(self):
        """The frozen reference model, loaded on first use (only requests that need it pay)."""
        if self._reference is None:
            if self.reference_dir is None:
                raise ValueError("this request needs the reference model, and the backend has no reference_dir")
            self._reference = load_model(self.reference_dir).to(self.device).eval()
        return self._reference

    @property
    def lean_reference(self) -> LeanDecoder | None:
        """The reference's lean decoder, when the policy decodes lean and the reference can too."""
        if self.lean is None:
            return None
        if self._lean_reference is None and supports_lean_decode(self.reference):
            self._lean_reference = LeanDecoder(self.reference, self.dtype)
        return self._lean_reference

    @torch.no_grad()
    def embed(self, seqs: list[tuple[list[int], list[int]]], which: str) -> list[list[float]]:
        """Mean over each response's tokens of the last hidden state of the policy or the
        reference, for (prompt_ids, response_ids) pairs."""
        model = {"policy": self.model, "reference": self.reference}[which]
        out: list[list[float]] = []
        for s in range(0, len(seqs), self.batch_size):
            chunk = seqs[s : s + self.batch_size]
            ids, mask = pad_sequences([p + r for p, r in chunk], self.pad_id, left=False)
            ids, mask = ids.to(self.device), mask.to(self.device)
            hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1].float()
            for row, (p, r) in enumerate(chunk):
                out.append(hidden[row, len(p) : len(p) + len(r)].mean(0).tolist())
        return out

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, weights_between_steps=None
    ) -> tuple[list[tuple[list[int], list[float], str]], list[int] | None]:
        """Each prompt's (tokens, logprobs, finish reason), and with `weights_between_steps` the
        version that sampled each step (the lean decoder's `Decoded.step_versions`)."""
        input_ids, attention_mask = pad_sequences(prompts, self.pad_id, left=True)
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        stop_ids = self.eos_ids | set(params.stop_token_ids)
        if self.specache is not None and params.interpolation is None:
            return self._specache_batch(input_ids, attention_mask, params, stop_ids), None
        lean_reference = None if params.interpolation is None else self.lean_reference
        if self.lean is not None and (params.interpolation is None or lean_reference is not None):
            tokens, logprobs, step_versions = self.lean.generate(
                input_ids,
                attention_mask,
                params.max_new_tokens,
                temperature=params.temperature,
                top_k=params.top_k,
                top_p=params.top_p,
                greedy=params.greedy,
                stop_ids=stop_ids,
                pad_id=self.pad_id,
                reference=lean_reference,
                interpolation=params.interpolation,
                weights_between_steps=weights_between_steps,
            )
            return rows_until_stop(tokens, logprobs, stop_ids), step_versions
        mixing = (
            []
            if params.interpolation is None
            else [ReferenceMixing(self.reference, params.interpolation, attention_mask)]
        )
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            temperature=None if params.greedy else params.temperature,
            top_p=None if params.greedy or params.top_p >= 1.0 else params.top_p,
            top_k=None if params.greedy or params.top_k == 0 else params.top_k,
            eos_token_id=sorted(stop_ids),
            pad_token_id=self.pad_id,
            logits_processor=mixing or None,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
        )
        new_tokens = out.sequences[:, input_ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1).float()  # [B, T, V], before any processor
        if not params.greedy and params.temperature != 1.0:
            logits = logits / params.temperature
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens[..., None]).squeeze(-1)
        return rows_until_stop(new_tokens, logprobs, stop_ids), None

    def _specache_batch(self, input_ids, attention_mask, params: SamplingParams, stop_ids: set[int]):
        """Decode with the SpeCache cache (rlsys.kvcache): low-bit keys/values in the fast tier,
        the top-k full-precision pairs fetched per step. Same logprob convention as `generate`."""
        from rlsys.kvcache.generate import specache_generate  # registers an attention function with transformers

        sequences, logprobs, _ = specache_generate(
            self.model,
            input_ids,
            attention_mask,
            params.max_new_tokens,
            **self.specache,
            temperature=0.0 if params.greedy else params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            eos_token_id=sorted(stop_ids),
            pad_token_id=self.pad_id,
        )
        return rows_until_stop(sequences[:, input_ids.shape[1] :], logprobs, stop_ids)

    @property
    def takes_weights_between_steps(self) -> bool:
        """Whether a generation can load new weights between two decode steps (the lean decoder's
        `weights_between_steps`; rollout.inflight_update continue)."""
        return self.lean is not None and self.specache is None

    def generate(self, requests: Sequence[GenerationRequest], weights_between_steps=None) -> list[Generation]:
        """`weights_between_steps` (see `LeanDecoder.generate`): new weights may load between the
        decode steps; each generation's `token_versions` then records the version of every token."""
        seqs = expand_requests(requests)
        results: list[Generation | None] = [None] * len(seqs)
        # Batches share sampling params; requests with different params never mix.
        by_params: dict[SamplingParams, list[int]] = {}
        for k, (_, _, params) in enumerate(seqs):
            by_params.setdefault(params, []).append(k)
        for params, members in by_params.items():
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for bucket in length_buckets(members, self.batch_size, key=lambda k: len(seqs[k][1])):
                idx = [members[b] for b in bucket]
                outs, step_versions = self._generate_batch([seqs[k][1] for k in idx], params, weights_between_steps)
                for k, (tokens, lps, reason) in zip(idx, outs):
                    results[k] = Generation(seqs[k][0], seqs[k][1], tokens, lps, reason)
                    if step_versions is not None:
                        results[k].token_versions = step_versions[: len(tokens)]
        for which in ("policy", "reference"):
            wanted = [k for k, g in enumerate(results) if requests[g.request_index].embedding == which]
            if wanted:
                vectors = self.embed([(results[k].prompt_ids, results[k].response_ids) for k in wanted], which)
                for k, v in zip(wanted, vectors):
                    results[k].embedding = v
        return results


def make_backend(
    name: str,
    model_dir: str,
    batch_size: int,
    reference_dir: str | None = None,
    quantized: str | None = None,
    specache: dict | None = None,
    decode: str = "lean",
    dtype: str = "float32",
    **options,
) -> RolloutBackend:
    if name == "hf":
        return HFBackend(
            model_dir,
            batch_size=batch_size,
            reference_dir=reference_dir,
            quantized=quantized,
            specache=specache,
            decode=decode,
            dtype=dtype,
        )
    if specache:
        raise ValueError(f"rollout.kv_cache=specache is served by the hf backend only, not {name}")
    if quantized:
        raise ValueError(f"rollout.quantized is served by the hf backend only, not {name}")
    if name == "vllm":
        try:
            from actors.vllm_backend import VLLMBackend  # the vllm extra: optional, only backend vllm loads it
        except ImportError as e:
            raise RuntimeError(f"rollout.backend=vllm needs the vllm extra ({e})") from None
        return VLLMBackend(model_dir, **options)
    raise ValueError(f"unknown rollout backend '{name}' (hf, vllm)")


def fetched_parts(refs: list, digests: list | None):
    """A sync's buckets (object refs) with their checksums (refs, or None), fetched one at a time."""
    import ray  # reason: only actors receive bucket refs; the backends above run without Ray

    for part, checksums in zip(refs, digests or [None] * len(refs)):
        yield ray.get(part), checksums and ray.get(checksums)


class OfferedWeights:
    """rollout.inflight_update continue: weights offered to a worker from its "weights" concurrency
    group while its generation holds `model_lock` (the newest offer waits for the next decode step)."""

    def __init__(self):
        self.model_lock = threading.Lock()  # held while the model generates or loads weights
        self._lock = threading.Lock()
        self._offered: tuple[int, list] | None = None  # (version, its tensors in one or more parts)

    def put(self, version: int, parts: list) -> None:
        with self._lock:
            if self._offered is None or version > self._offered[0]:
                self._offered = (version, parts)

    def take(self) -> tuple[int, list] | None:
        with self._lock:
            offered, self._offered = self._offered, None
        return offered

    def pending(self) -> bool:
        return self._offered is not None


class RolloutWorker:
    """One rollout role: a backend plus the policy version it currently holds."""

    def __init__(
        self,
        model_dir: str,
        backend: str = "hf",
        batch_size: int = 64,
        threads: int = 1,
        index: int = 0,
        reference_dir: str | None = None,
        quantized: str | None = None,
        specache: dict | None = None,
        backend_options: dict | None = None,
        decode: str = "lean",
        inflight_update: str = "finish",
        dtype: str = "float32",
    ):
        """`backend_options`: the vllm backend's engine settings (tensor_parallel_size, ...);
        `decode`, `dtype`: the hf backend's decode loop and its compute dtype (rollout.decode,
        rollout.dtype); `inflight_update` continue: weights
        offered during a generation (`offer_weights`, from the actor's "weights" concurrency group)
        load between two of its decode steps."""
        torch.set_num_threads(threads)
        self.index = index
        # the reference defaults to model_dir: the initial policy, as the ReferenceWorker loads it
        self.backend = make_backend(
            backend,
            model_dir,
            batch_size,
            reference_dir=reference_dir,
            quantized=quantized,
            specache=specache,
            decode=decode,
            dtype=dtype,
            **(backend_options or {}),
        )
        self.weight_broadcast = None  # this worker's BroadcastGroup member (trainer.weight_sync=broadcast)
        self.shared = None  # the learner's SharedWeights file, mapped (trainer.weight_sync=shared_memory)
        self.version = 0
        self.tokens_generated = 0
        self.generate_seconds = 0.0
        self.offers = None
        if inflight_update == "continue":
            if not getattr(self.backend, "takes_weights_between_steps", False):
                raise ValueError(
                    f"rollout.inflight_update=continue loads weights between decode steps of the lean decoder "
                    f"(rollout.backend hf, rollout.decode lean, rollout.kv_cache full, a Llama-family model): "
                    f"{model_dir} is served by another loop"
                )
            self.offers = OfferedWeights()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        start = time.perf_counter()
        if self.offers is None:
            gens = self.backend.generate(requests)
        else:
            with self.offers.model_lock:  # offers that arrive meanwhile load between decode steps
                gens = self.backend.generate(requests, weights_between_steps=self._take_offered)
            self._take_offered_if_idle()
        self.generate_seconds += time.perf_counter() - start
        for g in gens:
            g.policy_version = min(g.token_versions) if g.token_versions else self.version
            self.tokens_generated += len(g.response_ids)
        return gens

    def offer_weights(self, version: int, weights, digest=None) -> int:
        """rollout.inflight_update continue, called in the actor's "weights" concurrency group: new
        weights (every tensor, or a list of bucket refs with their digests' refs) fetched and checked
        here while a generation may run, then loaded between two of its decode steps, or now when
        none runs. Of the versions offered before a load, only the newest is loaded."""
        buckets = isinstance(weights, list)
        parts = list(fetched_parts(weights, digest)) if buckets else [(weights, digest)]
        for i, (part, checksums) in enumerate(parts):
            self._check(version, part, checksums, (i, len(parts)) if buckets else None)
        self.offers.put(version, [part for part, _ in parts])
        self._take_offered_if_idle()
        return version

    def _take_offered(self) -> int:
        """Load the newest offered weights, if newer than the model's (the caller holds the model
        lock); the version the model now holds."""
        offered = self.offers.take() if self.offers.pending() else None  # once per decode step: no lock when none
        if offered is not None and offered[0] > self.version:
            version, parts = offered
            with torch.inference_mode(False):  # the decoder's steps run in inference mode; weights are not its
                for part in parts:
                    self.backend.load_weights(part, partial=len(parts) > 1)
            self.version = version
        return self.version

    def _take_offered_if_idle(self) -> None:
        """An offer that arrived as a generation ended: loaded now, unless a generation holds the
        model again (it loads the offer at its next step)."""
        if self.offers.pending() and self.offers.model_lock.acquire(blocking=False):
            try:
                self._take_offered()
            finally:
                self.offers.model_lock.release()

    def load_weights(self, version: int, weights, digest=None, bucket: tuple[int, int] | None = None) -> int:
        """New weights from the object store, checked against the learner's `digest` first.
        `weights`: every tensor (a dict); or bucket (i, n) of a sync in buckets, some of them, the
        version changing with the last; or a list of bucket refs with their digests' refs (a
        restarted worker or an evaluator catching up), fetched and loaded one at a time."""
        # under continue an offer may be loading from the "weights" group
        with self.offers.model_lock if self.offers is not None else nullcontext():
            return self._load_checked(version, weights, digest, bucket)

    def _load_checked(self, version: int, weights, digest, bucket: tuple[int, int] | None) -> int:
        if isinstance(weights, list):
            for i, (part, checksums) in enumerate(fetched_parts(weights, digest)):
                self._load_checked(version, part, checksums, (i, len(weights)))
                del part  # each bucket's arrays live on in the model only: one bucket fetched at a time
            return version
        self._check(version, weights, digest, bucket)
        self.backend.load_weights(weights, partial=bucket is not None)
        if bucket is None or bucket[0] == bucket[1] - 1:
            self.version = version
        return version

    def _check(self, version: int, weights: dict, digest, bucket: tuple[int, int] | None) -> None:
        """WeightsCorrupt naming the first tensor that does not match the learner's `digest`."""
        bad = first_mismatch(digest, weights) if digest is not None else None
        if bad is not None:
            where = f" (bucket {bucket[0]} of {bucket[1]})" if bucket else ""
            raise self._corrupt(version, bad, "the object store" + where)

    def _corrupt(self, version: int, tensor: str, path: str) -> WeightsCorrupt:
        return WeightsCorrupt(
            f"rollout worker {self.index}: the weights of version {version} arrived corrupt through {path}: "
            f"tensor {tensor} does not match the learner's checksum"
        )

    def load_shared(self, version: int, layout, slot: int, *written) -> int:
        """The weights of `version` from `slot` of the learner's shared-memory file (actors/
        shared_weights.py), mapped on first use; the model adopts the slot's arrays. `written`:
        the learner calls that wrote them (Ray runs this call once they have finished)."""
        if self.shared is None or self.shared.layout != layout:
            self.shared = SharedWeights(layout)
        if self.shared.verify(slot) is not None:  # read once more, through a fresh mapping
            self.shared = SharedWeights(layout)
            bad = self.shared.verify(slot)
            if bad is not None:
                raise self._corrupt(version, bad, f"shared memory ({layout.path}, slot {slot})")
        self.backend.load_weights(self.shared.arrays(slot))
        self.version = version
        return version

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    # ---- trainer.weight_sync=broadcast (actors/weight_broadcast.py) ----------------------------
    def weight_sync_ranks(self) -> int:
        """Members this worker adds to the weight-broadcast group: 1, or a vLLM engine's
        tensor-parallel workers (each receives its copy inside the engine)."""
        return getattr(self.backend, "weight_sync_ranks", 1)

    def in_weight_broadcast(self) -> bool:
        """Whether this worker is a member of the broadcast group (a restarted one is not)."""
        return self.weight_broadcast is not None or hasattr(self.backend, "open_weight_broadcast")

    def open_weight_broadcast(
        self, master_addr: str, master_port: int, first_rank: int, world_size: int, backend: str, timeout_s: float
    ) -> int:
        if hasattr(self.backend, "open_weight_broadcast"):  # the vLLM engine's workers join themselves
            self.backend.open_weight_broadcast(master_addr, master_port, first_rank, world_size, timeout_s)
            return first_rank
        import ray

        device = getattr(self.backend, "device", torch.device("cpu"))
        local = ray.util.get_node_ip_address() if ray.is_initialized() else None
        self.weight_broadcast = None  # a group formed again (a restarted worker rejoins) replaces the old one
        self.weight_broadcast = BroadcastGroup(
            master_addr,
            master_port,
            first_rank,
            world_size,
            backend,
            timeout_s,
            device=device if backend == "nccl" else "cpu",
            local_addr=local,
        )
        return first_rank

    def receive_weights(self, version: int, manifest) -> int:
        """One broadcast sync: the weights tagged `version` from learner rank 0, loaded in place."""
        if hasattr(self.backend, "receive_weight_broadcast"):
            self.backend.receive_weight_broadcast(version, manifest)
        else:
            if self.weight_broadcast is None:
                raise RuntimeError("receive_weights before open_weight_broadcast")
            try:
                received = dict(self.weight_broadcast.receive(version, manifest))
            except WeightsCorrupt as e:
                raise WeightsCorrupt(f"rollout worker {self.index}: {e} (the broadcast group)") from None
            self.backend.load_weights(received)
        self.version = version
        return version

    def policy_version(self) -> int:
        return self.version

    def pid(self) -> int:
        import os

        return os.getpid()

    def stats(self) -> dict:
        return {
            "index": self.index,
            "version": self.version,
            "tokens": self.tokens_generated,
            "seconds": self.generate_seconds,
            "lean_decode": getattr(self.backend, "lean", None) is not None,
        }
