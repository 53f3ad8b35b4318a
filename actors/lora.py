"""LoRA (learner.lora): the learner trains adapters with peft; the weight sync sends them alone.

Learner side (`add_adapters`, `adapter_tensors`): peft injects LoRA layers into the policy in place
(`get_peft_model`), the base weights frozen, so the learner holds the base once and trains A and B
of each target layer. A sync sends peft's own adapter state dict (its on-disk names,
`base_model.model.<layer>.lora_A.weight`) and one more tensor, `lora.scaling` (alpha / r): the
adapters say by themselves how they apply, so every sync mode (object store, shared memory,
broadcast) and every receiver (rollout worker, evaluator, a moved reference) handles them alike.

Receiver side (`MergedAdapters`): a model that serves the policy keeps its initial weights of the
adapted layers and sets W = W0 + scaling * B @ A on each sync (merged, so generation costs what it
costs without LoRA). `write_peft_adapter` turns the same tensors into a peft adapter directory, as
vLLM's LoRA requests and `PeftModel.from_pretrained` read them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

SCALING = "lora.scaling"  # the sync's extra tensor: alpha / r, shape [1]
PEFT_PREFIX = "base_model.model."  # peft's names of the wrapped model's modules
ADAPTER_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def add_adapters(model: nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str]):
    """The peft model over `model` with LoRA adapters of rank `rank` on the linear layers named
    `target_modules` (the base weights frozen, B zero so the policy starts unchanged). The model
    is changed in place: `peft_model.get_base_model()` is `model`, now with the adapters inside."""
    from peft import LoraConfig, get_peft_model  # the learner's dependency only

    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules), bias="none"
    )
    try:
        return get_peft_model(model, config)
    except ValueError as e:  # peft's "Target modules {...} not found in the base model"
        raise ValueError(f"learner.lora.target_modules {list(target_modules)}: {str(e).splitlines()[0]}") from None


def adapter_tensors(peft_model) -> dict[str, torch.Tensor]:
    """What a LoRA weight sync sends: the adapters (peft's state-dict names, as `save_pretrained`
    writes them) and `lora.scaling`."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model)
    config = peft_model.peft_config["default"]
    scaling = torch.tensor([config.lora_alpha / config.r], dtype=torch.float32)
    return {**{k: v.detach() for k, v in state.items()}, SCALING: scaling}


def is_adapter_state(weights) -> bool:
    """Whether a sync's tensors are LoRA adapters (they carry `lora.scaling`)."""
    return SCALING in weights


def adapter_pairs(weights) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Target layer (the served model's module name) -> its (A [r, in], B [out, r]); a name that
    is neither a layer's A nor its B, or an A without its B, is named in a KeyError."""
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for name, value in weights.items():
        if name == SCALING:
            continue
        suffix = next((s for s in ADAPTER_SUFFIXES if name.endswith(s)), None)
        if suffix is None or not name.startswith(PEFT_PREFIX):
            raise KeyError(f"LoRA sync tensor {name!r} is not a layer's lora_A or lora_B weight")
        layer = name[len(PEFT_PREFIX) : -len(suffix)]
        pairs.setdefault(layer, {})[suffix[1:7]] = np.asarray(value)
    incomplete = [layer for layer, ab in pairs.items() if len(ab) != 2]
    if incomplete:
        raise KeyError(f"LoRA sync lacks lora_A or lora_B of {incomplete[0]}")
    return {layer: (ab["lora_A"], ab["lora_B"]) for layer, ab in pairs.items()}


def scaling_of(weights) -> float:
    return float(np.asarray(weights[SCALING]).reshape(-1)[0])


def merged_weight(base: torch.Tensor, a, b, scaling: float) -> torch.Tensor:
    """W0 + scaling * B @ A, in W0's dtype (the delta computed in float32); a weight stored
    transposed (GPT-2's Conv1D, [in, out]) gets the transposed delta."""
    delta = (_float32(b) @ _float32(a)) * scaling
    if delta.shape != base.shape and delta.T.shape == base.shape:
        delta = delta.T
    if delta.shape != base.shape:
        raise ValueError(f"LoRA delta of shape {tuple(delta.shape)} does not fit a weight of shape {tuple(base.shape)}")
    return (base.float() + delta.to(base.device)).to(base.dtype)


def _float32(x) -> torch.Tensor:
    """A float32 tensor of a tensor or an array (copied: synced arrays may be read-only views)."""
    return x.float() if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x, dtype=np.float32))


class MergedAdapters:
    """A served model with LoRA adapters merged into its weights: it keeps the initial weights of
    the layers the adapters touch (the first sync copies them) and sets each to
    W0 + scaling * B @ A on every sync, never merging onto an earlier merge."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.base: dict[str, torch.Tensor] = {}  # parameter name -> its initial weight

    @torch.no_grad()
    def load(self, weights) -> int:
        """Merge the synced adapters into the model; returns the number of layers set."""
        params = dict(self.model.named_parameters())
        scaling = scaling_of(weights)
        pairs = adapter_pairs(weights)
        for layer, (a, b) in pairs.items():
            name = f"{layer}.weight"
            if name not in params:
                raise KeyError(f"LoRA adapters for {layer}: the served model has no parameter {name}")
            param = params[name]
            if name not in self.base:
                self.base[name] = param.detach().clone()
            if param.dtype != torch.float32:  # bf16 serving: the delta in float32, then rounded once
                param.data = merged_weight(self.base[name], a, b, scaling)
                continue
            a, b = _float32(a).to(param.device), _float32(b).to(param.device)
            out_in = (b.shape[0], a.shape[1])
            if param.shape not in (out_in, out_in[::-1]):
                raise ValueError(f"LoRA delta of shape {out_in} does not fit {name} of shape {tuple(param.shape)}")
            # W = W0 + s * B @ A written in place by one gemm: no temporary the size of the weight
            if param.shape == out_in:
                torch.addmm(self.base[name], b, a, alpha=scaling, out=param.data)
            else:  # a weight stored [in, out] (GPT-2's Conv1D)
                torch.addmm(self.base[name], a.T, b.T, alpha=scaling, out=param.data)
        return len(pairs)


def peft_adapter_config(weights, base_model: str) -> dict:
    """peft's adapter_config.json for the synced adapters: r from A's rows, alpha = scaling * r,
    the target modules from the layer names."""
    pairs = adapter_pairs(weights)
    rank = int(next(iter(pairs.values()))[0].shape[0])
    return {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": scaling_of(weights) * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted({layer.rsplit(".", 1)[-1] for layer in pairs}),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def write_peft_adapter(weights, path: str | Path, base_model: str) -> Path:
    """The synced adapters as a peft adapter directory (adapter_config.json and
    adapter_model.safetensors) at `path`: what vLLM's LoRARequest and PeftModel.from_pretrained read."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items() if k != SCALING}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(peft_adapter_config(weights, base_model), indent=1))
    return path


def merged_state_dict(peft_model) -> dict[str, torch.Tensor]:
    """The wrapped model's state dict as it would be without LoRA layers (HF names), each adapted
    weight merged (W0 + scaling * B @ A): what a merged export saves. Nothing in the model changes."""
    from peft.tuners.lora import LoraLayer

    model = peft_model.get_base_model()
    out = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items() if ".lora_" not in k}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            out[f"{name}.weight"] = merged_weight(
                module.get_base_layer().weight.detach(), a.detach(), b.detach(), module.scaling["default"]
            )
    return out
