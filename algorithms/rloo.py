"""RLOO (Ahmadian et al. 2024): REINFORCE with a leave-one-out baseline.

    A_i = r_i - mean_{j != i} r_j    over the k responses to one prompt,
used in the same clipped surrogate and k3 KL loss as GRPO; only the advantage differs.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
from pydantic import Field

from algorithms.base import AlgorithmConfig, register, rewards_of
from algorithms.common import rloo_advantages
from algorithms.grpo import GRPO


class RLOOConfig(AlgorithmConfig):
    group_size: int = Field(4, ge=2, description="responses sampled per prompt (k)")
    clip_eps: float = Field(0.2, gt=0, lt=1)
    kl_coef: float = Field(0.04, ge=0)


@register("rloo")
class RLOO(GRPO):
    Config = RLOOConfig

    def advantages(self, table: pa.Table) -> np.ndarray:
        return rloo_advantages(rewards_of(table), table.column("group").to_pylist())
