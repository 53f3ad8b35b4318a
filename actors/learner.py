"""DeepSpeed learner: one rank per instance (a Ray actor in real runs, in-process in tests).

The loss is the algorithm's `loss(outputs, batch)`, handed in as an object: the learner
knows nothing of any particular algorithm. Ranks rendezvous over torch.distributed
(gloo on CPU) at rank 0's node address (127.0.0.1 on one node); each rank trains on its shard
of the batch and DeepSpeed averages gradients.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from functools import partial

import numpy as np
import pyarrow as pa
import torch

from actors.lora import adapter_tensors, add_adapters, merged_state_dict
from actors.modeling import (
    PolicyOnly,
    PolicyWithValueHead,
    enable_activation_checkpointing,
    per_response_tokens,
    quiet_transformers,
    size_buckets,
    tensors_numpy,
    tied_state_dict,
)
from actors.shared_weights import SharedLayout, SharedWeights, remove_stale, shm_free_bytes, shm_path
from actors.weight_broadcast import BroadcastGroup, weight_manifest
from rlsys.batch import TrainBatch
from rlsys.contract import (
    ModelOutputs,
    SkipsRowsWithoutGradient,
    TrainsOnStaleRows,
    UnpackedOnly,
    UsesProximalLogprobs,
    loss_denominator,
)
from rlsys.logprobs import mismatch_metrics, prompt_lengths, repeated_prompts
from rlsys.models import find_tokenizer_dir, load_model, load_tokenizer, save_tokenizer
from rlsys.packing import AUTO_PACK_TOKENS, microbatches, packing_pays
from rlsys.weight_digest import digest


def deepspeed_config(
    zero_stage: int, grad_clip: float, bf16: bool = False, offload: str = "none", device: str = "cuda"
) -> dict:
    """The DeepSpeed config of a learner rank; `bf16` adds, on CUDA, DeepSpeed's bf16 section (bf16
    weights and activations, fp32 master weights in the optimizer) and, on a CPU, its
    `torch_autocast` section (the engine's forward under torch.autocast: linear layers and
    attention in bf16, the weights, their gradients and the optimizer in fp32); `offload`
    (optimizer, params) DeepSpeed's ZeRO-Offload of the optimizer state (and the parameters) to
    host memory, the step run there by the torch AdamW the learner hands in."""
    config = {
        "train_micro_batch_size_per_gpu": 1,  # we call the engine on whole minibatches ourselves
        "gradient_accumulation_steps": 1,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,  # a torch AdamW client optimizer: no JIT build of fused/cpu Adam
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16 and device == "cuda":
        config["bf16"] = {"enabled": True}
    elif bf16:  # gradients reduced in fp32 across ranks (no lower-precision modules)
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}
    if offload in ("optimizer", "params"):
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["zero_force_ds_cpu_optimizer"] = False  # our torch AdamW steps the offloaded state, not DeepSpeedCPUAdam
    if offload == "params":
        config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    return config


def micro_batch_weights(parts: list[TrainBatch], count, whole: TrainBatch) -> list[float]:
    """Each micro-batch's `count` (what a mean divides by) over the whole minibatch's: the
    weights under which the micro-batches' means sum to the minibatch's (equal when it is 0)."""
    if len(parts) == 1:
        return [1.0]
    total = count(whole)
    return [count(part) / total for part in parts] if total else [1.0 / len(parts)] * len(parts)


def learner_device(prefer_cuda: bool = True) -> tuple[str, str]:
    """(torch device, torch.distributed backend): CUDA and NCCL when a GPU is visible (Ray
    makes one visible to an actor that asks for num_gpus=1), else CPU and gloo."""
    if prefer_cuda and torch.cuda.is_available():
        return "cuda", "nccl"
    return "cpu", "gloo"


def lr_multiplier(
    step: int, total_steps: int, warmup_steps: int = 0, schedule: str = "constant", min_ratio: float = 0.0
) -> float:
    """The learning-rate factor after `step` optimizer steps: linear warm-up from 1/warmup to 1
    over `warmup_steps`, then `constant` (1), `linear` (1 -> min_ratio) or `cosine`
    (min_ratio + (1 - min_ratio) * 0.5 * (1 + cos(pi * progress))) until `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r} (constant, linear, cosine)")


def trained_state_dict(module, destination=None, prefix="", keep_vars=False, exclude_frozen_parameters=False):
    """`module.state_dict()` without frozen parameters, under every name they have: DeepSpeed's
    own `module_state_dict` finds the frozen names by `named_parameters()`, which lists a tied
    weight once, so a LoRA checkpoint kept the frozen lm_head (the embedding) under its second
    name. (The keyword arguments are DeepSpeed's; frozen parameters are left out always.)"""
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    state = module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
    return type(state)((k, v) for k, v in state.items() if k[len(prefix) :] not in frozen)


class Learner:
    def __init__(
        self,
        model_dir: str,
        algorithm,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        zero_stage: int = 0,
        epochs: int = 1,
        minibatches: int = 1,
        temperature: float = 1.0,
        threads: int = 1,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        seed: int = 0,
        lr_schedule: str = "constant",
        warmup_steps: int = 0,
        total_steps: int = 0,
        min_lr_ratio: float = 0.0,
        bf16: bool = False,
        gradient_checkpointing: bool = False,
        lora: dict | None = None,
        max_tokens_per_microbatch: int | None = None,
        auto_pack: bool = False,
        offload: str = "none",
    ):
        """`warmup_steps` and `total_steps` count optimizer steps (epochs x minibatches per train_step).
        `gradient_checkpointing`: the policy's decoder layers are recomputed in the backward instead of
        keeping their activations (`enable_activation_checkpointing`; the same gradients, shared prompts
        still run once). `lora`: learner.lora's keys (rank, alpha, dropout, target_modules, export); with a
        rank > 0 the policy trains LoRA adapters only (actors/lora.py) and a sync sends them alone.
        `max_tokens_per_microbatch`: each minibatch runs in packed micro-batches of at most this many
        tokens, its prompt groups kept whole (rlsys/packing.py), the gradients accumulated into its one
        optimizer step; None: each minibatch in one padded forward, or with `auto_pack` in packed
        micro-batches of AUTO_PACK_TOKENS where that computes far fewer positions (`packing_pays`; not
        for an UnpackedOnly loss)."""
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK="0",
            WORLD_SIZE=str(world_size),
            MASTER_ADDR=master_addr,  # rank 0's node (rlsys/placement.py learner_placement)
            MASTER_PORT=str(master_port),
        )
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        quiet_transformers()
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        device, dist_backend = learner_device()
        if device == "cuda":
            torch.cuda.set_device(0)  # LOCAL_RANK 0: each rank's actor sees its own GPU
        self.device = torch.device(device, 0) if device == "cuda" else torch.device("cpu")
        if offload != "none" and device != "cuda":
            print(
                f"rlsys: learner.offload={offload} on a CPU learner changes nothing: its parameters and optimizer "
                "state are in host memory already",
                file=sys.stderr,
            )
            offload = "none"
        self.offload = offload
        deepspeed.init_distributed(dist_backend=dist_backend, auto_mpi_discovery=False)
        self.rank, self.world_size = rank, world_size
        self.algorithm = algorithm
        self.epochs, self.minibatches = epochs, minibatches
        if max_tokens_per_microbatch is not None and max_tokens_per_microbatch < 1:
            raise ValueError(f"max_tokens_per_microbatch must be >= 1 or None, not {max_tokens_per_microbatch}")
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.auto_pack = auto_pack and not isinstance(algorithm, UnpackedOnly)
        # ranks meet in collectives: every minibatch's last backward (the gradient all-reduce), under
        # ZeRO-2/3 every backward (its gradient reduce), under ZeRO-3 every forward (the parameter
        # gather). Each rank plans from its own shard, so the ranks agree on their minibatches and,
        # in lockstep, on their micro-batches and forwards (`_agree`)
        self.lockstep = world_size > 1 and zero_stage >= 2
        self.temperature = temperature
        self.zero_stage = zero_stage
        # ZeRO-0 with fp32 weights: the learner clips with torch's foreach clip and reports the norm
        # (DeepSpeed clips there tensor by tensor and reports none); under ZeRO or CUDA bf16 DeepSpeed
        # clips its own state
        self.own_clip = (grad_clip or math.inf) if zero_stage == 0 and not (bf16 and device == "cuda") else None
        self._engine_args = dict(
            lr=lr,
            weight_decay=weight_decay,
            grad_clip=grad_clip if self.own_clip is None else 0.0,
            bf16=bf16,
            gradient_checkpointing=gradient_checkpointing,
            lora=lora if lora and lora.get("rank") else None,
            schedule=partial(
                lr_multiplier,
                total_steps=total_steps,
                warmup_steps=warmup_steps,
                schedule=lr_schedule,
                min_ratio=min_lr_ratio,
            ),
        )
        self.model_dir = model_dir  # the initial policy: its tokenizer goes with every export
        self.peft = None  # the peft model over the policy under learner.lora (the policy holds its adapters)
        self.engine, self.optimizer = self._build_engine(model_dir)
        self.weight_broadcast = None  # rank 0's BroadcastGroup under trainer.weight_sync=broadcast
        self.shared = None  # rank 0's SharedWeights under trainer.weight_sync=shared_memory
        self.steps = 0

    def _build_engine(self, model_dir: str):
        """A DeepSpeed engine over the policy in `model_dir` (plus a value head when the
        algorithm needs one) with a fresh AdamW and lr schedule; its decoder layers checkpointed
        under learner.gradient_checkpointing."""
        import deepspeed

        a = self._engine_args
        policy = load_model(model_dir)
        if a["lora"]:  # adapters injected in place: `policy` is the same model, its base weights frozen
            lora = a["lora"]
            self.peft = add_adapters(policy, lora["rank"], lora["alpha"], lora["dropout"], lora["target_modules"])
        if a["gradient_checkpointing"]:
            enable_activation_checkpointing(policy)
        module = PolicyWithValueHead(policy) if self.algorithm.needs_value_head else PolicyOnly(policy)
        optimizer = torch.optim.AdamW(
            [p for p in module.parameters() if p.requires_grad],  # under LoRA the adapters (and a value head)
            lr=a["lr"],
            weight_decay=a["weight_decay"],
            fused=self.device.type == "cpu",
        )  # one kernel over all tensors (3x faster on CPU)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, a["schedule"])  # stepped by the engine, checkpointed
        engine, optimizer, _, _ = deepspeed.initialize(
            model=module,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=deepspeed_config(self.zero_stage, a["grad_clip"], a["bf16"], self.offload, self.device.type),
        )
        if self.peft is not None:  # a checkpoint's model part: the trained tensors only
            engine.module_state_dict = partial(trained_state_dict, module)
        if self.world_size == 1 and self.zero_stage == 0:
            engine.enable_backward_allreduce = False  # one rank: the allreduce only flattens and copies back
        return engine, optimizer

    def restart(self, model_dir: str) -> int:
        """Start over from the policy in `model_dir`: its weights, a fresh optimizer and lr
        schedule (ReST retrains from the initial model each round). Collective: every rank."""
        self.engine, self.optimizer = None, None  # free the old engine before building the new one
        self.model_dir = model_dir
        self.engine, self.optimizer = self._build_engine(model_dir)
        return self.rank

    @property
    def module(self):
        return self.engine.module

    def train_step(self, batch, shared_slot: int | None = None, loads: list = ()) -> dict[str, float]:
        """`epochs` passes over `minibatches` shards of this rank's batch, one optimizer
        step per shard. Returns metrics averaged over the optimizer steps. With `shared_slot`
        (trainer.weight_sync=shared_memory) the new weights are then written into that slot, once
        the workers' `loads` (object refs: their loads of the version before, which moved them off
        the slot's old version) have finished, done or failed."""
        start = time.perf_counter()
        sums: dict[str, float] = defaultdict(float)
        n, mismatch = 0, {}
        proximal = isinstance(self.algorithm, UsesProximalLogprobs) and self.algorithm.proximal_logprobs_needed()
        # the batch's old_logprobs are the sampler's: the gap to the learner's is measured each step
        sampled = isinstance(self.algorithm, (UsesProximalLogprobs, TrainsOnStaleRows))
        # as many optimizer steps a rank (every rank has a row: one minibatch needs no all-reduce)
        minibatches = self._agree(min(self.minibatches, len(batch)), lowest=True) if self.minibatches > 1 else 1
        one_update = self.epochs == 1 and minibatches == 1
        if proximal and not one_update:  # the policy before the first update, for every minibatch
            batch.proximal_logprobs = self._logprobs_before_update(batch, minibatches)
            mismatch = mismatch_metrics(batch.proximal_logprobs, batch.old_logprobs, batch.response_mask)
        self.engine.train()
        for _ in range(self.epochs):
            for mb in batch.split(minibatches):
                share = self._share_of_ranks(mb)
                mb, scale, skipped = self._rows_with_gradient(mb.trim())
                first = n == 0 and sampled and not mismatch  # no update yet: this step's forwards are pi_prox
                metrics, first_mismatch = self._forward_backward(mb.to(self.device), share * scale, first, proximal)
                mismatch = first_mismatch if first else mismatch
                metrics["lr"] = self.engine.get_lr()[0]  # the rate this optimizer step uses
                metrics["rows_without_gradient"] = skipped
                own_norm = (
                    None
                    if self.own_clip is None
                    else torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.own_clip)
                )
                self.engine.step()
                grad_norm = own_norm if own_norm is not None else self.engine.get_global_grad_norm()  # by the step
                if grad_norm is not None:
                    metrics["grad_norm"] = float(grad_norm)
                for k, v in metrics.items():
                    sums[k] += v
                n += 1
        self.steps += 1
        if shared_slot is not None:
            if loads:
                import ray

                ray.wait(list(loads), num_returns=len(loads))
            self.write_shared(shared_slot)
        out = {k: v / max(n, 1) for k, v in sums.items()} | mismatch
        out["time/train_rank"] = time.perf_counter() - start
        out["train_tokens"] = float(batch.num_tokens())
        return out

    def _forward_backward(self, mb, scale: float, first: bool, proximal: bool) -> tuple[dict, dict]:
        """Forward and backward of one minibatch (its gradients, not yet the optimizer step), its
        loss times `scale`: one padded forward (rows sharing a prompt run it once), or under
        max_tokens_per_microbatch packed micro-batches (rlsys/packing.py), each micro-batch's loss
        weighted by its denominator over the minibatch's (`loss_denominator`: the loss's mean over
        the whole minibatch) and the gradients accumulated inside the engine up to its accumulation
        boundary at the last. In lockstep a rank with fewer micro-batches than another runs
        copies of its smallest at weight 0. Returns (the loss's metrics and `loss`, so weighted; the
        sampler mismatch when `first`: the forwards before the step's first update, which then
        also give the proximal logprobs when `proximal`)."""
        budget = self.max_tokens_per_microbatch
        pays = self.auto_pack and bool(self._agree(packing_pays(mb)) if self.lockstep else packing_pays(mb))
        packed = budget is not None or pays
        parts = microbatches(mb, budget or AUTO_PACK_TOKENS) if packed else [mb]
        weights = micro_batch_weights(parts, partial(loss_denominator, self.algorithm), mb)
        token_weights = micro_batch_weights(parts, TrainBatch.num_tokens, mb)
        if packed and self.lockstep:
            missing = self._agree(len(parts)) - len(parts)
            parts = parts + [min(parts, key=TrainBatch.num_tokens)] * missing
            weights, token_weights = weights + [0.0] * missing, token_weights + [0.0] * missing
        share = packed or self._shared_prompts(mb)
        metrics: dict[str, float] = defaultdict(float)
        mismatch: dict[str, float] = defaultdict(float)
        for i, (part, weight, token_weight) in enumerate(zip(parts, weights, token_weights)):
            if packed:  # ZeRO-0..3 reduce (and may free) the accumulated gradients at the boundary only
                self.engine.set_gradient_accumulation_boundary(i == len(parts) - 1)
            logits, logprobs, values = self.engine(
                part.input_ids, part.attention_mask, self.temperature, part.response_mask if share else None, packed
            )
            if first:
                part.proximal_logprobs = logprobs.detach() if proximal else None
                for k, v in mismatch_metrics(logprobs, part.old_logprobs, part.response_mask).items():
                    mismatch[k] += token_weight * v  # token means
            loss, part_metrics = self.algorithm.loss(ModelOutputs(logits, logprobs, values), part)
            loss = loss * (scale * weight) if scale * weight != 1.0 else loss
            self.engine.backward(loss)
            for k, v in part_metrics.items():
                metrics[k] += weight * v
            metrics["loss"] += loss.item()
        return dict(metrics), dict(mismatch)

    @torch.no_grad()
    def _logprobs_before_update(self, batch, minibatches: int) -> torch.Tensor:
        """log pi of every target token under the current weights, [B, L-1] as the batch's, by the
        training forward's minibatches without gradient (the proximal policy of a step of several
        optimizer steps)."""
        self.engine.eval()
        out = torch.zeros_like(batch.response_mask)
        row = 0
        for mb in batch.split(minibatches):
            mb = mb.trim().to(self.device)
            share = mb.response_mask if self._shared_prompts(mb, backward=False) else None
            with self._precision():
                logprobs = self.module(mb.input_ids, mb.attention_mask, self.temperature, share)[1]
            out[row : row + len(mb), : logprobs.shape[1]] = logprobs.float().cpu()
            row += len(mb)
        return out

    def _agree(self, value: int, lowest: bool = False) -> int:
        """The largest `value` of all ranks (the smallest with `lowest`), in one all-reduce that
        every rank must join; this rank's own with one rank."""
        return int(self._all_ranks(int(value), "min" if lowest else "max"))

    def _all_ranks(self, value: float, op: str) -> float:
        """`value` reduced over the ranks by `op` (sum, min, max) in one float64 all-reduce that
        every rank must join (exact for the integers it agrees on); `value` itself with one rank."""
        if self.world_size == 1:
            return value
        import deepspeed.comm as dist

        reduced = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(reduced, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
        return float(reduced.item())

    def _share_of_ranks(self, mb) -> float:
        """The factor on this rank's minibatch loss under which the ranks' gradients, which
        DeepSpeed averages, are the gradient of one loss over every rank's minibatch: world size
        x this rank's share of what the loss averages over (`loss_denominator`), summed over the
        ranks in one all-reduce. Shards of different token (or row) counts then weigh each token
        (row) alike, as one rank on the whole batch does."""
        if self.world_size == 1:
            return 1.0
        own = loss_denominator(self.algorithm, mb)
        total = self._all_ranks(own, "sum")
        return self.world_size * own / total if total > 0 else 1.0

    def _shared_prompts(self, mb, backward: bool = True) -> bool:
        """Whether `mb`'s padded forward may run its repeated prompts once (rlsys/logprobs.py
        `shared_prompt_passes`: two passes where the plain forward is one). Out of lockstep the
        forward decides; in lockstep, where ranks meet in the forward (ZeRO-3's gathers) or its
        backward (ZeRO-2/3's reduces), only when it would on every rank, for the same forwards."""
        if not self.lockstep or (self.zero_stage < 3 and not backward):
            return True
        repeated = repeated_prompts(mb.input_ids, mb.attention_mask, prompt_lengths(mb.response_mask))
        return not self._agree(repeated is None)

    def _rows_with_gradient(self, mb):
        """(the minibatch's rows whose loss term can have a gradient, the factor that rescales
        their mean loss to the whole minibatch's (their share of `loss_denominator`: tokens for a
        token mean, responses for a mean over responses), the share of rows left out).
        Leaving out rows the algorithm's `gradient_rows` says add nothing (GRPO's groups with
        equal rewards and no KL term) gives the same gradient for less compute; a minibatch
        with none keeps one row at factor 0, so the optimizer still steps on a zero gradient."""
        if not isinstance(self.algorithm, SkipsRowsWithoutGradient):
            return mb, 1.0, 0.0
        keep = self.algorithm.gradient_rows(mb)
        if bool(keep.all()):
            return mb, 1.0, 0.0
        skipped = 1.0 - float(keep.float().mean())
        if not bool(keep.any()):
            return mb.select(slice(0, 1)).trim(), 0.0, skipped
        kept = mb.select(keep).trim()
        return kept, loss_denominator(self.algorithm, kept) / (loss_denominator(self.algorithm, mb) or 1.0), skipped

    def values(self, table: pa.Table) -> list[list[float]]:
        """The value head's estimate for each response token's state (PPO)."""
        return self._per_response(table, output=2)

    def logprobs(self, table: pa.Table) -> list[list[float]]:
        """log pi of each response token under the current weights (DA-KD's student CE)."""
        return self._per_response(table, output=1)

    def reference_logprobs(self, table: pa.Table) -> list[list[float]]:
        """log pi_ref of each response token under learner.lora: the policy with its adapters off is
        the initial policy, so the learner is the run's reference and no copy of the base is kept.
        Under ZeRO-3 every rank must be called (the forward gathers the parameters together)."""
        with self.peft.disable_adapter():
            return self._per_response(table, output=1)

    @torch.no_grad()
    def _per_response(self, table: pa.Table, output: int) -> list[list[float]]:
        """One of the module's outputs (1: logprobs, 2: values) at each response token."""
        self.engine.eval()
        forward = lambda ids, mask, span, packed: self.module(
            ids.to(self.device), mask.to(self.device), self.temperature, span.to(self.device), packed
        )[output]
        with self._precision():
            return per_response_tokens(
                forward, table, max_tokens=self.max_tokens_per_microbatch, auto_pack=self.auto_pack
            )

    def _precision(self):
        """The engine's autocast (a CPU learner under learner.bf16) for a forward of the module
        outside the engine, so every forward of this learner computes as its training forward."""
        from deepspeed.runtime.torch_autocast import autocast_if_enabled

        return autocast_if_enabled(self.engine)

    @contextmanager
    def _full_policy(self):
        """The policy with whole parameters inside the block: under ZeRO-3 every rank must
        enter it (the parameters are gathered collectively)."""
        import deepspeed

        policy = self.module.policy
        if self.zero_stage == 3:
            with deepspeed.zero.GatheredParameters(list(policy.parameters()), modifier_rank=None):
                yield policy
        else:
            yield policy

    def _sync_tensors(self, policy) -> dict[str, torch.Tensor]:
        """What every weight sync sends: the policy's state dict (tied names: one tensor), or under
        learner.lora its adapters and their scaling alone (actors/lora.py)."""
        return adapter_tensors(self.peft) if self.peft is not None else tied_state_dict(policy)

    def weights(self) -> dict[str, np.ndarray] | None:
        """The synced weights (`_sync_tensors`: HF state-dict names, or the LoRA adapters) as numpy on
        rank 0; None on other ranks. Under ZeRO-3 every rank must call this (the parameters are
        gathered collectively) and they are copied out of the gathered buffers; otherwise they are
        views of the parameters (one copy fewer per sync: the actor's return value is serialized
        before the next step)."""
        with self._full_policy() as policy:
            return tensors_numpy(self._sync_tensors(policy), copy=self.zero_stage == 3) if self.rank == 0 else None

    def weights_and_digest(self) -> tuple[dict[str, np.ndarray] | None, dict[str, int] | None]:
        """`weights()` and their checksums (rlsys/weight_digest.py), for the object-store sync: two
        return values (`.options(num_returns=2)`), so a worker gets the digest without the weights."""
        weights = self.weights()
        return weights, (digest(weights) if weights is not None else None)

    def bucket_names(self, bucket_mb: float) -> list[list[str]]:
        """The policy's tensor names grouped into object-store sync buckets of at most `bucket_mb`
        MB each (`size_buckets`); a tied name costs nothing after the first (one array). LoRA
        adapters go in one bucket (a receiver merges a layer's A and B together).
        Collective under ZeRO-3 (the whole shapes exist inside the gather)."""
        sizes, seen = {}, set()
        with self._full_policy() as policy:
            if self.peft is not None:
                return [list(self._sync_tensors(policy))]
            for name, t in tied_state_dict(policy).items():
                sizes[name] = 0 if id(t) in seen else t.numel() * 4  # sent as float32 numpy
                seen.add(id(t))
        return size_buckets(sizes, bucket_mb * 2**20)

    def weights_bucket(self, names: list[str]) -> tuple[dict[str, np.ndarray] | None, dict[str, int] | None]:
        """`weights_and_digest` of the named tensors only: one bucket of an object-store sync
        (collective under ZeRO-3, as `weights`)."""
        with self._full_policy() as policy:
            if self.rank != 0:
                return None, None
            wanted = set(names)
            tensors = {k: v for k, v in self._sync_tensors(policy).items() if k in wanted}
            bucket = tensors_numpy(tensors, copy=self.zero_stage == 3)
            return bucket, digest(bucket)

    # ---- trainer.weight_sync=shared_memory (actors/shared_weights.py) ----------------------------
    def share_weights(self, policy: str, required_free: float = 1.25):
        """Rank 0 creates the policy's shared-memory weights file (two slots of the policy's
        tensors in its dtype: a bf16 learner's file is half an fp32 one's) and returns its
        SharedLayout, or a one-line reason it cannot: /dev/shm lacks `required_free` x the
        file's size. Collective under ZeRO-3 (returns None on other ranks)."""
        with self._full_policy() as policy_module:
            if self.rank != 0:
                return None
            remove_stale()
            layout = SharedLayout.of(shm_path(policy), self._sync_tensors(policy_module))
            free = shm_free_bytes()
            if free < required_free * layout.file_bytes:
                return (
                    f"/dev/shm has {free / 2**20:.1f} MiB free, the weights need {layout.file_bytes / 2**20:.1f} MiB "
                    f"(two copies) with {required_free - 1:.0%} to spare"
                )
            self.close_shared()
            self.shared = SharedWeights(layout, create=True)
            return layout

    def write_shared(self, slot: int) -> int:
        """Rank 0 copies the policy's weights into `slot` of its shared file; collective under ZeRO-3."""
        with self._full_policy() as policy:
            if self.rank == 0:
                if self.shared is None:
                    raise RuntimeError("write_shared before share_weights")
                self.shared.write(slot, self._sync_tensors(policy))
        return slot

    def close_shared(self) -> None:
        """Remove the shared weights file (the controller's shutdown)."""
        if self.shared is not None:
            self.shared.close(unlink=True)
        self.shared = None

    # ---- trainer.weight_sync=broadcast (actors/weight_broadcast.py) ----------------------------
    def broadcast_endpoint(self) -> tuple[str, int]:
        """(address, free port) on this rank's node for the weight-broadcast rendezvous."""
        import socket

        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def open_weight_broadcast(
        self, master_addr: str, master_port: int, world_size: int, backend: str, timeout_s: float
    ) -> int:
        """Rank 0 joins the weight-broadcast group as its sender (rank 0 of that group):
        NCCL from this rank's GPU, or gloo through host memory."""
        if self.rank == 0:
            if backend == "nccl" and self.device.type != "cuda":
                raise RuntimeError("the NCCL weight broadcast needs the learner on CUDA; no GPU is visible to rank 0")
            device = self.device if backend == "nccl" else torch.device("cpu")
            self.weight_broadcast = None  # a group formed again (a restarted worker rejoins) replaces the old one
            self.weight_broadcast = BroadcastGroup(
                master_addr, master_port, 0, world_size, backend, timeout_s, device=device, local_addr=master_addr
            )
        return self.rank

    def weight_manifest(self):
        """Names, shapes and dtypes of what `broadcast_weights` sends (rank 0; collective under ZeRO-3)."""
        with self._full_policy() as policy:
            return weight_manifest(self._sync_tensors(policy).items()) if self.rank == 0 else None

    def broadcast_weights(self, version: int) -> int:
        """Rank 0 broadcasts the policy's state dict tagged with `version`; every rank must call
        this under ZeRO-3. Returns the bytes sent (0 on other ranks)."""
        with self._full_policy() as policy:
            if self.rank != 0:
                return 0
            if self.weight_broadcast is None:
                raise RuntimeError("broadcast_weights before open_weight_broadcast")
            return self.weight_broadcast.send(version, list(self._sync_tensors(policy).values()))

    def save(self, path: str) -> None:
        """DeepSpeed checkpoint (model, optimizer, scheduler) under `path`; collective. Under
        learner.lora the model part holds the trained tensors only (the adapters, a value head):
        the frozen base weights are the initial policy's, which a resumed run loads anyway."""
        self.engine.save_checkpoint(
            path, tag="learner", save_latest=False, exclude_frozen_parameters=self.peft is not None
        )

    def load(self, path: str) -> None:
        load_path, _ = self.engine.load_checkpoint(path, tag="learner", load_module_strict=self.peft is None)
        if load_path is None:
            raise RuntimeError(f"no learner checkpoint in {path}")

    def export_hf(self, path: str) -> None:
        """A model dir of the policy at `path` (rank 0): its `save_pretrained` and the tokenizer
        of the dir it started from beside it, so `AutoModelForCausalLM` and `AutoTokenizer` both
        load `path`. Under learner.lora: the adapters merged into the initial weights (`export:
        merged`, the same loading), or peft's adapter directory (`export: adapter`, for
        `PeftModel.from_pretrained` over the initial policy). Every rank joins under ZeRO-3 (the
        parameters are gathered for it)."""
        with self._full_policy() as policy:
            if self.rank != 0:
                return
            if self.peft is not None and self._engine_args["lora"]["export"] == "adapter":
                self.peft.save_pretrained(path)
            elif self.peft is not None:
                policy.save_pretrained(path, state_dict=merged_state_dict(self.peft), safe_serialization=True)
            else:
                policy.save_pretrained(path, safe_serialization=True)
        if find_tokenizer_dir(self.model_dir) is not None:
            save_tokenizer(load_tokenizer(self.model_dir), path)

    def ready(self) -> int:
        return self.rank

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()
