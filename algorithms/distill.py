"""DA-KD: difficulty-aware knowledge distillation with the bidirectional discrepancy loss
(../shared/papers/dakd.md).

A trained teacher p is distilled into a smaller student q (the learner) on the task's
(prompt, ground-truth answer) pairs; each epoch spends compute only on the samples the
student finds hard:

1. difficulty score of each sample against its ground-truth tokens (`difficulty_scores`):
       DDS(x) = CE_student(x) / CE_teacher(x)
   high when the teacher is confident and the student is not;
2. keep ratio of epoch e of E (`keep_ratio`): cosine r_e = 0.5 cos(pi e / E) + 0.5 (default)
   or linear r_e = 1 - e / E (`full`, r_e = 1, is plain full-data KD, the baseline); the
   epoch trains on n_e = round(r_e N) samples (`subset_size`);
3. stratified subset (`stratified_subset`): sort by DDS descending, D_high = the top n_e,
   D_low = the rest; draw (1 - tau) n_e samples from D_high and tau n_e from D_low;
4. loss (`bdl`): P_m = (1 - lambda) p + lambda q, Q_m = lambda p + (1 - lambda) q,
   L = KL(P_m || Q_m) per answer token (lambda = 0: KL(p||q), 1: KL(q||p), 0.5: 0).
   P_m / Q_m lies between (1 - lambda) / lambda and lambda / (1 - lambda), so |dL/dq_i| is
   bounded by a function of lambda alone (`bdl_grad_bound`): no explosion on hard samples.

The teacher is a reference-style worker (`ctx.teacher_top_logprobs`: the k most likely next
tokens and their log p at each answer position; top_k 0 sends the whole distribution, and
with k > 0 both p and q are renormalised on the teacher's k tokens). DA-KD draws its batches
from its own epoch plan over the task's training rows (the controller's prompts only set the
batch size); the epoch, its subset order and the position in it are `state()`, so a
checkpoint holds the schedule.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal, Optional, Sequence

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, field_validator

from algorithms.base import register
from algorithms.common import masked_mean
from algorithms.sft import sft_ids, warmup
from rlsys.batch import TrainBatch, collate
from rlsys.contract import Algorithm, AlgorithmConfig, HasTeacher, ModelOutputs, ReportsPrepareMetrics, Stateful
from rlsys.experience import make_experience

TEACHER_COLUMNS = pa.schema(
    [("teacher_ids", pa.list_(pa.list_(pa.int32()))), ("teacher_logprobs", pa.list_(pa.list_(pa.float32())))]
)


# ---- the method, as pure functions ---------------------------------------------------------
def sequence_ce(token_logprobs: Sequence[Sequence[float]]) -> np.ndarray:
    """CE(x): mean negative log-likelihood of each sample's ground-truth tokens."""
    return np.array([-float(np.mean(lp)) if len(lp) else 0.0 for lp in token_logprobs])


def difficulty_scores(ce_student: Sequence[float], ce_teacher: Sequence[float], eps: float = 1e-6) -> np.ndarray:
    """DDS(x) = CE_student(x) / CE_teacher(x)."""
    return np.asarray(ce_student, dtype=np.float64) / np.maximum(np.asarray(ce_teacher, dtype=np.float64), eps)


def keep_ratio(epoch: int, epochs: int, schedule: str = "cosine") -> float:
    """r_e = 0.5 cos(pi e / E) + 0.5 (cosine), 1 - e / E (linear) or 1 (full: the full-data KD
    baseline), e = 0..E-1; an epoch past the schedule keeps the last epoch's ratio."""
    e = min(epoch, epochs - 1)
    if schedule == "cosine":
        return 0.5 * math.cos(math.pi * e / epochs) + 0.5
    if schedule == "linear":
        return 1.0 - e / epochs
    if schedule == "full":
        return 1.0
    raise ValueError(f"unknown keep-ratio schedule {schedule!r} (cosine, linear, full)")


def subset_size(n: int, ratio: float) -> int:
    """n_e = round(r_e N), half up, at least 1 and at most N."""
    return max(1, min(n, int(math.floor(ratio * n + 0.5))))


def epoch_sizes(n: int, epochs: int, schedule: str = "cosine") -> list[int]:
    return [subset_size(n, keep_ratio(e, epochs, schedule)) for e in range(epochs)]


def schedule_steps(n: int, epochs: int, batch_size: int, schedule: str = "cosine") -> int:
    """Optimizer steps of the whole schedule (each epoch's last batch may be short):
    the `trainer.steps` that runs exactly E epochs."""
    return sum(math.ceil(s / batch_size) for s in epoch_sizes(n, epochs, schedule))


def stratified_subset(scores: np.ndarray, n_keep: int, tau: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of the epoch's samples, shuffled: D_high = the n_keep highest DDS, D_low = the
    rest; round(tau n_keep) drawn from D_low (all of it when smaller), the remainder from D_high."""
    order = np.argsort(-np.asarray(scores), kind="stable")
    high, low = order[:n_keep], order[n_keep:]
    n_low = min(len(low), int(math.floor(tau * n_keep + 0.5)))
    chosen = np.concatenate([rng.choice(high, n_keep - n_low, replace=False), rng.choice(low, n_low, replace=False)])
    return rng.permutation(chosen)


def _log_mix(log_a: torch.Tensor, log_b: torch.Tensor, w: float) -> torch.Tensor:
    """log(w a + (1 - w) b) from log a and log b; exact (and finite) at w = 0 and 1."""
    if w >= 1.0:
        return log_a
    if w <= 0.0:
        return log_b
    return torch.logaddexp(log_a + math.log(w), log_b + math.log1p(-w))


def bdl(teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, lam: float) -> torch.Tensor:
    """Bidirectional discrepancy loss per position, over the last (vocabulary) dim:
    KL(P_m || Q_m), P_m = (1-lam) p + lam q, Q_m = lam p + (1-lam) q, from normalised log p, log q."""
    log_P = _log_mix(teacher_logprobs, student_logprobs, 1.0 - lam)
    log_Q = _log_mix(teacher_logprobs, student_logprobs, lam)
    return (log_P.exp() * (log_P - log_Q)).sum(-1)


def bdl_grad_bound(lam: float) -> float:
    """sup |dL/dq_i| of the BDL: dL/dq_i = lam (log rho_i + 1) - (1-lam) rho_i with
    rho_i = P_i/Q_i in [1/A, A], A = max(lam/(1-lam), (1-lam)/lam): at most
    lam (log A + 1) + (1-lam) A (infinite at lam = 0 or 1, the one-sided KLs)."""
    if lam <= 0.0 or lam >= 1.0:
        return math.inf
    a = max(lam / (1 - lam), (1 - lam) / lam)
    return lam * (math.log(a) + 1) + (1 - lam) * a


def on_support(logprobs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log-probabilities gathered at `ids` (last dim) and renormalised over them."""
    picked = logprobs.gather(-1, ids)
    return picked - picked.logsumexp(-1, keepdim=True)


# ---- the plug-in -------------------------------------------------------------------------------
class TeacherConfig(AlgorithmConfig):
    path: Optional[str] = Field(
        None,
        description="local HF model dir of a trained teacher (its tokenizer must be "
        "the student's); null trains a tiny one of the sizes below",
    )
    hidden_size: int = Field(128, ge=8, description="tiny teacher: width of the residual stream")
    intermediate_size: int = Field(384, ge=8, description="tiny teacher: width of the MLP's hidden layer")
    num_hidden_layers: int = Field(4, ge=1, le=64, description="tiny teacher: decoder layers")
    num_attention_heads: int = Field(4, ge=1, description="tiny teacher: attention heads")
    num_key_value_heads: int = Field(2, ge=1, description="tiny teacher: key/value heads of grouped-query attention")
    sft_steps: int = Field(600, ge=1, description="supervised warm-up steps of the tiny teacher")
    batch_size: int = Field(32, ge=1, description="tiny teacher: demonstrations per warm-up step")
    lr: float = Field(3e-3, gt=0, description="tiny teacher: AdamW learning rate of the warm-up")

    @field_validator("path")
    @classmethod
    def _model_dir(cls, v):
        if v is not None and not (Path(v) / "config.json").exists():
            raise ValueError("must be a local model directory (with config.json)")
        return v


def prepare_teacher(t: TeacherConfig, run_dir, task, tokenizer, seed: int) -> Path:
    """The teacher's model dir, from an `algorithm.teacher` section `t`: t.path (its vocabulary
    must equal the student's), or a tiny model of the teacher sizes trained by the SFT warm-up,
    saved once to run_dir/teacher. Shared by the algorithms with a teacher (distill, opd)."""
    from rlsys.config import ConfigError  # here: rlsys.config is loaded only by what builds a run
    from rlsys.models import TinyModelSpec, build_tiny_model, load_tokenizer, save_model_dir  # imports rlsys.config

    if t.path:
        if load_tokenizer(t.path).get_vocab() != tokenizer.get_vocab():
            raise ConfigError(
                f"config error: algorithm.teacher.path = {t.path!r}: its tokenizer differs from the "
                f"student's (train the teacher on this task's tokenizer)"
            )
        return Path(t.path)
    out = Path(run_dir) / "teacher"
    if not (out / "config.json").exists():
        sizes = t.model_dump(
            include={
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
            }
        )
        model = build_tiny_model(TinyModelSpec(**sizes), tokenizer, seed=seed + 1)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # in the driver, beside the actors: one core
        try:
            warmup(model, tokenizer, task, task.rows("train"), t.sft_steps, t.batch_size, t.lr, seed)
        finally:
            torch.set_num_threads(threads)
        save_model_dir(model, tokenizer, out)
    return out


class DistillConfig(AlgorithmConfig):
    """DA-KD: difficulty-aware distillation of a teacher into the policy, with the bidirectional discrepancy loss."""

    epochs: int = Field(6, ge=1, description="E: epochs of the keep-ratio schedule")
    schedule: Literal["cosine", "linear", "full"] = Field(
        "cosine",
        description="share of the samples epoch e keeps: cosine 0.5 cos(pi e / E) + 0.5, linear 1 - e / E; "
        "full: all of them (plain KD, the baseline)",
    )
    tau: float = Field(0.1, ge=0, le=1, description="share of each epoch drawn from the easy part D_low")
    bdl_lambda: float = Field(
        0.9, ge=0, le=1, description="lambda of the bidirectional discrepancy loss (0: KL(p || q), 1: KL(q || p))"
    )
    top_k: int = Field(0, ge=0, description="teacher tokens per position (0: the whole distribution)")
    teacher: TeacherConfig = Field(
        TeacherConfig(),
        description="the teacher: a trained local model, or a tiny one trained on the task before the run",
    )


@register("distill")
class DAKD(Algorithm, Stateful, HasTeacher, ReportsPrepareMetrics):
    Config = DistillConfig
    needs_value_head = False

    def __init__(self, config: DistillConfig | None = None):
        self.config = config or self.Config()
        self.epoch, self.position, self.order = -1, 0, []
        self.epoch_metrics: dict[str, float] = {}
        self._data = None  # (prompt ids, answer ids) of the training rows
        self._teacher_ce = None

    def __getstate__(self):  # the learner gets the loss only: no data or caches on the wire
        return {**self.__dict__, "_data": None, "_teacher_ce": None, "order": []}

    # -- teacher ----------------------------------------------------------------------------
    def teacher_dir(self, run_dir, task, tokenizer, seed: int) -> Path:
        """`prepare_teacher` of the `teacher` section."""
        return prepare_teacher(self.config.teacher, run_dir, task, tokenizer, seed)

    # -- sampling: the epoch plan -----------------------------------------------------------
    def _training_ids(self, ctx):
        if self._data is None:
            self._data = sft_ids(ctx.tokenizer, ctx.task.rows("train"), ctx.task)
        return self._data

    def _table_of(self, ctx, index: Sequence[int]) -> pa.Table:
        prompts, answers = self._training_ids(ctx)
        rows = [
            dict(
                uid=f"train-{i}",
                group=f"train-{i}",
                prompt_ids=prompts[i],
                response_ids=answers[i],
                logprobs=[],
                reward=0.0,
                policy_version=ctx.policy_version,
                meta={"sample": int(i)},
            )
            for i in index
        ]
        return make_experience(rows, TEACHER_COLUMNS)

    def _scores(self, ctx) -> np.ndarray:
        """DDS of every training sample under the current student (the learner's weights)."""
        every = self._table_of(ctx, range(len(self._training_ids(ctx)[0])))
        if self._teacher_ce is None:  # the teacher is frozen
            self._teacher_ce = sequence_ce(ctx.teacher_logprobs(every))
        return difficulty_scores(sequence_ce(ctx.policy_logprobs(every)), self._teacher_ce)

    def _begin_epoch(self, ctx) -> None:
        c, n = self.config, len(self._training_ids(ctx)[0])
        self.epoch += 1
        ratio = keep_ratio(self.epoch, c.epochs, c.schedule)
        n_keep = subset_size(n, ratio)
        rng = np.random.default_rng(ctx.next_seed())
        self.epoch_metrics = {
            "distill/epoch": float(self.epoch),
            "distill/keep_ratio": ratio,
            "distill/epoch_samples": float(n_keep),
        }
        if n_keep == n:  # everything is kept: no scores needed
            self.order = rng.permutation(n).tolist()
        else:
            dds = self._scores(ctx)
            self.order = stratified_subset(dds, n_keep, c.tau, rng).tolist()
            self.epoch_metrics["distill/dds_mean"] = float(dds.mean())
        self.position = 0

    def rollout(self, ctx, prompts) -> pa.Table:
        """The next len(prompts) samples of the epoch's subset (fewer at its end), with the
        teacher's top-k next-token logprobs at every answer position."""
        if self.position >= len(self.order):
            self._begin_epoch(ctx)
        index = self.order[self.position : self.position + len(prompts)]
        self.position += len(index)
        table = self._table_of(ctx, index)
        top = ctx.teacher_top_logprobs(table, self.config.top_k)
        for name, column in zip(TEACHER_COLUMNS.names, zip(*top)):
            table = table.set_column(
                table.schema.get_field_index(name), name, pa.array(list(column), type=TEACHER_COLUMNS.field(name).type)
            )
        return table

    def prepare(self, table: pa.Table) -> TrainBatch:
        batch = collate(table)
        B, T = batch.response_mask.shape
        k = len(table.column("teacher_ids")[0].as_py()[0])
        ids, logprobs = torch.zeros((B, T, k), dtype=torch.long), torch.zeros((B, T, k))
        for i, (p, tid, tlp) in enumerate(
            zip(
                table.column("prompt_ids").to_pylist(),
                table.column("teacher_ids").to_pylist(),
                table.column("teacher_logprobs").to_pylist(),
            )
        ):
            span = slice(len(p) - 1, len(p) - 1 + len(tid))
            ids[i, span], logprobs[i, span] = torch.tensor(tid), torch.tensor(tlp)
        batch.extras.update(teacher_ids=ids, teacher_logprobs=logprobs)
        return batch

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        return dict(self.epoch_metrics)

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        """Masked mean over answer tokens of BDL(p, q) on the teacher's tokens."""
        mask, ids = batch.response_mask, batch.extras["teacher_ids"]
        log_q = on_support(torch.log_softmax(outputs.logits.float(), dim=-1), ids)
        teacher = batch.extras["teacher_logprobs"]
        log_p = teacher - teacher.logsumexp(-1, keepdim=True)
        loss = masked_mean(bdl(log_p, log_q, self.config.bdl_lambda), mask)
        with torch.no_grad():
            ce = -masked_mean(outputs.logprobs, mask)
        return loss, {"loss/bdl": loss.item(), "distill/ce_student": ce.item()}

    # -- checkpointed state -------------------------------------------------------------------
    def state(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "order": list(map(int, self.order)),
            "epoch_metrics": self.epoch_metrics,
        }

    def load_state(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.order, self.epoch_metrics = list(state["order"]), dict(state.get("epoch_metrics", {}))
