"""BRiTE: bootstrapping reinforced thinking (Zhong et al. 2025, ../shared/papers/brite.md).

A rationale z sits between the question x and the answer y:
P(z, y | x, theta) = P(z | x, theta) P(y | x, z, theta). Each iteration t alternates
  psi-step (`psi_steps` learner steps): KL-regularised RL for the sampler Q_psi,
      max_Q E_Q[r(z)] - beta KL(Q || P(.|x)),   r(z) = log P(y* | x, z, theta)      (shaped reward)
    whose optimum is Q*(z) ∝ P(z|x) exp(r(z)/beta): for beta = 1 the posterior P(z | x, y*);
  theta-step (`theta_steps` learner steps): max_theta E_{z~Q_psi} log P(z, y* | x, theta),
    the likelihood of the sampled rationale followed by the gold answer (sft_loss). With
    `theta_weights: posterior` each row is weighted toward Q* by self-normalised importance
    weights within its prompt's group (`posterior_weights`), for a psi-step that has not
    converged: an option, not the page's method (default `none`).
As on the page, one network is both Q_psi and P_theta; phase and iteration are algorithm
state, saved in checkpoints, so a resumed run continues inside the same phase.

Response format on the arithmetic task: `<rationale>#<answer><eos>`, the marker being
envs.arithmetic.ANSWER_MARKER (one token), which the task's answer reader understands. A
step samples the rationale, then the answer:
  1. z ~ policy(. | x): up to `rationale_tokens` tokens, stopped by the marker. A rationale
     that ended otherwise (eos, which is dropped, or the length) gets the marker appended
     as an environment token (loss_mask 0 for the psi-step: the policy did not sample it).
  2. y ~ policy(. | x, z): up to `answer_tokens` tokens, stopped by eos; only its
     correctness is kept (`reward`, the controller's reward/accuracy), since the
     gold-answer variant scores y* instead.
  3. Scoring pass: each row's response is z + y* + eos; the learner's forward on the
     current weights (`ctx.policy_logprobs`) gives log P(y* eos | x, z, theta) as the sum
     of the logprobs after the rationale (`shaped_rewards`). The learner is the current
     theta; the reference worker is the frozen initial model, which would score theta_0.
     The learner divides logits by rollout.temperature, so rollout.temperature must be 1.
The psi-step turns r into the sequence return R = r - beta * sum_z (log Q - log P_ref)
(the Monte Carlo form of the KL-regularised objective, gradient-exact), with a leave-one-out
baseline over the `group_size` rationales of a prompt, in the clipped surrogate over the
rationale tokens the policy sampled. Its KL anchor is P(.|x, theta_t), as on the page
(`kl_anchor: theta_t`): at the first psi-step of each iteration the reference worker is
loaded with the current weights (`ctx.anchor_reference`), so the anchor is theta after the
previous theta-steps and the KL to it starts at zero; checkpoints keep the anchor.
`kl_anchor: initial` keeps the frozen initial policy instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, field_validator

from algorithms.base import register, set_token_column
from algorithms.common import broadcast_to_tokens, clipped_policy_loss, rloo_advantages
from algorithms.sft import sft_loss
from envs.arithmetic import ANSWER_MARKER, carry_dropped_answer, ones_digit_step
from envs.base import TrainSplitView
from rlsys.batch import TrainBatch, collate
from rlsys.contract import (
    Algorithm,
    AlgorithmConfig,
    HasWarmupTask,
    ModelOutputs,
    MovesReference,
    ReportsPrepareMetrics,
    Stateful,
)
from rlsys.experience import make_experience, meta_of, new_uid
from rlsys.generation import GenerationRequest

PHASES = ("psi", "theta")
EXTRA_SCHEMA = pa.schema(
    [("rationale_len", pa.int32()), ("shaped_reward", pa.float32()), ("phase", pa.string()), ("iteration", pa.int64())]
)


class BRiTEConfig(AlgorithmConfig):
    """BRiTE (Zhong et al. 2025): psi-steps of KL-regularised RL on rationales alternate with theta-steps of
    likelihood fine-tuning."""

    psi_steps: int = Field(1, ge=0, description="learner steps of KL-regularised RL per iteration")
    theta_steps: int = Field(1, ge=0, description="learner steps of likelihood fine-tuning per iteration")
    group_size: int = Field(4, ge=2, description="rationales sampled per prompt")
    rationale_tokens: int = Field(
        8, ge=1, description="most sampled tokens of a rationale (a cut one gets the marker appended)"
    )
    answer_tokens: int = Field(4, ge=1, description="most tokens of the sampled answer, eos included")
    kl_coef: float = Field(1.0, ge=0, description="beta; 1 makes the psi-step optimum the posterior")
    kl_anchor: Literal["theta_t", "initial"] = Field(
        "theta_t", description="the psi-step's KL reference: theta at the start of the iteration, or the initial policy"
    )
    clip_eps: float = Field(
        0.2, gt=0, lt=1, description="psi-step: PPO clip range of the ratio to the rollout policy: [1 - eps, 1 + eps]"
    )
    theta_weights: Literal["none", "posterior"] = Field(
        "none",
        description="theta-step rows as sampled, or weighted toward the psi-step's optimum Q* (posterior_weights)",
    )
    warmup: Literal["rationale", "answer"] = Field(
        "rationale", description="warm-up target: '<rationale>#<answer>' (RationaleWarmupTask) or the bare answer"
    )

    @field_validator("theta_steps")
    @classmethod
    def _some_phase(cls, v, info):
        if v + info.data.get("psi_steps", 1) == 0:
            raise ValueError("psi_steps + theta_steps must be at least 1")
        return v


# ---- pure functions ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PhasePosition:
    """Where the alternation stands: the phase of the next learner step, the iteration t and
    how many steps of this phase are done."""

    phase: str = "psi"
    iteration: int = 0
    step_in_phase: int = 0

    def settle(self, psi_steps: int, theta_steps: int) -> "PhasePosition":
        """The same position, moved past any phase that is already complete (or empty)."""
        pos, length = self, {"psi": psi_steps, "theta": theta_steps}
        while pos.step_in_phase >= length[pos.phase]:
            pos = (
                PhasePosition("theta", pos.iteration, 0)
                if pos.phase == "psi"
                else PhasePosition("psi", pos.iteration + 1, 0)
            )
        return pos

    def advance(self, psi_steps: int, theta_steps: int) -> "PhasePosition":
        """The position after one learner step of this phase."""
        return PhasePosition(self.phase, self.iteration, self.step_in_phase + 1).settle(psi_steps, theta_steps)


def phase_at(step: int, psi_steps: int, theta_steps: int) -> tuple[str, int]:
    """(phase, iteration) of learner step `step` (0-based) from the start: psi_steps psi-steps,
    then theta_steps theta-steps, per iteration."""
    iteration, k = divmod(step, psi_steps + theta_steps)
    return ("psi" if k < psi_steps else "theta"), iteration


def shaped_rewards(token_logprobs: Sequence[Sequence[float]], rationale_lens: Sequence[int]) -> np.ndarray:
    """r = log P(y* | x, z): the sum of each response's token logprobs after its rationale
    (responses are z + y* + eos, scored by one forward pass; chain rule over y*'s tokens)."""
    return np.array([float(np.sum(lp[n:], dtype=np.float64)) for lp, n in zip(token_logprobs, rationale_lens)])


def kl_regularised_returns(rewards, logq, logp_ref, beta: float) -> np.ndarray:
    """R = r - beta * (log Q(z) - log P(z)) per sequence: E_Q[R] = E_Q[r] - beta KL(Q || P) and
    E_Q[(R - b) grad log Q] is that objective's gradient (the psi-step's return)."""
    return np.asarray(rewards, np.float64) - beta * (np.asarray(logq, np.float64) - np.asarray(logp_ref, np.float64))


def kl_rl_optimum(log_prior, rewards, beta: float = 1.0) -> np.ndarray:
    """The maximiser of E_Q[r] - beta KL(Q || P) over a finite set: Q* ∝ P exp(r / beta)."""
    logits = np.asarray(log_prior, np.float64) + np.asarray(rewards, np.float64) / beta
    q = np.exp(logits - logits.max())
    return q / q.sum()


def posterior_weights(rewards, logq, logp_anchor, groups: Sequence[str]) -> np.ndarray:
    """Self-normalised importance weights, per prompt group, of rationales z ~ Q toward the
    psi-step's optimum Q*(z) ∝ P(z|x, theta_t) exp(r(z)): w ∝ exp(r + log P_anchor(z) - log Q(z)),
    scaled to mean 1 within each group. The theta-step's weighted likelihood then estimates
    E_{Q*} log P(z, y*|x, theta) when the psi-step's sampler has not reached Q*
    (`theta_weights: posterior`; with Q = Q* the weights are all 1 in expectation)."""
    log_w = np.asarray(rewards, np.float64) + np.asarray(logp_anchor, np.float64) - np.asarray(logq, np.float64)
    _, group = np.unique(np.asarray(groups), return_inverse=True)
    top = np.full(group.max() + 1, -np.inf)
    np.maximum.at(top, group, log_w)
    w = np.exp(log_w - top[group])
    total, size = np.bincount(group, weights=w), np.bincount(group)
    return w * size[group] / total[group]


def weighted_sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """-sum_i w_i sum_t m_it log p_it / sum m: the likelihood loss with per-sequence weights
    (weights 1: `sft_loss`)."""
    return -(weights[:, None] * logprobs * mask).sum() / mask.sum().clamp(min=1.0)


def close_rationale(tokens: Sequence[int], logprobs: Sequence[float], marker: int, eos: int):
    """A sampled rationale ending in the marker: (token ids, logprobs, loss mask). The policy's
    own marker is kept; a trailing eos is dropped and the marker appended as an environment
    token (mask 0, logprob 0), as after a rationale cut by the length limit."""
    tokens, logprobs = list(tokens), list(logprobs)
    if tokens and tokens[-1] == marker:
        return tokens, logprobs, [1] * len(tokens)
    if tokens and tokens[-1] == eos:
        tokens, logprobs = tokens[:-1], logprobs[:-1]
    return tokens + [marker], logprobs + [0.0], [1] * len(tokens) + [0]


def marker_token_id(tokenizer, marker: str = ANSWER_MARKER) -> int:
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise ValueError(f"brite: the answer marker {marker!r} must be one token of the tokenizer, it is {ids}")
    return ids[0]


# ---- the warm-up in the rationale format ------------------------------------------------------------
def rationale_target(rationale: int, answer: int) -> str:
    """The warm-up's target text `<rationale>#<answer>`; the reply ends with eos after it."""
    return f"{rationale}{ANSWER_MARKER}{answer}"


def rationale_row(row: dict, prompt: str) -> dict:
    """`row` with its "answer" replaced by `<rationale>#<answer>` for `prompt`: the ones-digit step
    (`envs.arithmetic.ones_digit_step`), then the answer; the gold answer kept in "gold_answer"."""
    gold = int(str(row["answer"]).strip())  # a non-numeric answer is a ValueError, as a non-arithmetic prompt
    rationale = ones_digit_step(prompt)
    return {
        **row,
        "answer": rationale_target(rationale, gold),
        "rationale": str(rationale),
        "gold_answer": row["answer"],
    }


def carry_dropped_rationale_row(row: dict, prompt: str) -> dict:
    """A warm-up row (`rationale_row`) as a demonstrator who forgets every carry writes it: the
    ones step mod 10, then `envs.arithmetic.carry_dropped_answer` ("18+17=" -> "5#25", right:
    "15#35"); the answer still follows the rationale (it is the rationale plus a multiple of 10).
    Rows of other operations than addition as they are."""
    dropped = carry_dropped_answer(prompt)
    if dropped is None:
        return row
    rationale = ones_digit_step(prompt) % 10
    return {**row, "answer": rationale_target(rationale, int(dropped)), "rationale": str(rationale)}


@dataclass
class RationaleWarmupTask(TrainSplitView):
    """The task as BRiTE's supervised warm-up sees it (`BRiTE.warmup_task`): every training row's
    target is `<rationale>#<answer>` (`rationale_row`), so the warmed-up model writes an
    intermediate result its answer depends on, in the format the rollout samples. With
    `sft.demo_error` the warm-up draws carry-dropped rows (`flawed_demonstration`), a rationale
    prior for the psi-step to correct. Other splits, the prompts, grading (against the gold
    answer) and the corpus are the task's own."""

    def train_rows(self, rows: list[dict]) -> list[dict]:
        return [rationale_row(r, self.task.prompt_text(r)) for r in rows]

    def flawed_demonstration(self, row: dict) -> dict:
        """A warm-up row as a sloppy demonstrator writes it (`sft.demo_error`): carries dropped in
        the rationale and the answer (`carry_dropped_rationale_row`)."""
        return carry_dropped_rationale_row(row, self.task.prompt_text(row))

    def is_correct(self, row: dict, response_text: str) -> bool:
        return self.task.is_correct(_graded(row), response_text)

    def reward(self, row: dict, response_text: str) -> float:
        return self.task.reward(_graded(row), response_text)


def _graded(row: dict) -> dict:
    """The row as the task grades it: a warm-up row's gold answer back under "answer"."""
    return {**row, "answer": row["gold_answer"]} if "gold_answer" in row else row


def longest_rationale_tokens(tokenizer, rows: Sequence[dict]) -> tuple[int, str]:
    """(token count, text) of the longest rationale among warm-up rows, the marker not counted."""
    return max((len(tokenizer(r["rationale"], add_special_tokens=False)["input_ids"]), r["rationale"]) for r in rows)


# ---- the plug-in ---------------------------------------------------------------------------------
@register("brite")
class BRiTE(Algorithm, Stateful, HasWarmupTask, ReportsPrepareMetrics, MovesReference):
    Config = BRiTEConfig
    needs_value_head = False

    def __init__(self, config: BRiTEConfig | None = None):
        self.config = config or self.Config()
        self.position = PhasePosition().settle(self.config.psi_steps, self.config.theta_steps)

    def state(self) -> dict:
        p = self.position
        return {"phase": p.phase, "iteration": p.iteration, "step_in_phase": p.step_in_phase}

    def load_state(self, state: dict) -> None:
        if state.get("phase") not in PHASES:
            raise ValueError(f"brite: checkpoint state has phase {state.get('phase')!r} (expected psi or theta)")
        self.position = PhasePosition(state["phase"], int(state["iteration"]), int(state["step_in_phase"])).settle(
            self.config.psi_steps, self.config.theta_steps
        )

    def warmup_task(self, task, tokenizer):
        """The task the supervised warm-up trains on (the controller's hook): with `warmup:
        rationale` a RationaleWarmupTask, its rows checked here (arithmetic prompts, the marker one
        token, rationale + marker within `rationale_tokens`); with `warmup: answer` the task."""
        from rlsys.config import ConfigError  # here: rlsys.config is loaded only by what builds a run

        c = self.config
        if c.warmup == "answer":
            return task
        warm = RationaleWarmupTask(task)
        try:
            marker_token_id(tokenizer)
            rows = warm.rows("train")
        except ValueError as e:
            raise ConfigError(
                f"config error: 'algorithm.warmup'=rationale: task '{task.name}' has no ones-digit "
                f"rationale ({e}); set algorithm.warmup=answer"
            ) from None
        n, text = longest_rationale_tokens(tokenizer, rows)
        if n + 1 > c.rationale_tokens:
            raise ConfigError(
                f"config error: 'algorithm.rationale_tokens'={c.rationale_tokens}: the warm-up rationale "
                f"{text!r} and the marker take {n + 1} tokens"
            )
        return warm

    def rollout(self, ctx, prompts) -> pa.Table:
        c, tok, phase = self.config, ctx.tokenizer, self.position.phase
        if ctx.sampling().temperature != 1.0:
            raise ValueError(
                "brite: rollout.temperature must be 1.0 (the scoring pass reads log P at the sampling temperature)"
            )
        marker, eos = marker_token_id(tok), tok.eos_token_id
        params = ctx.sampling(
            n=c.group_size, max_new_tokens=c.rationale_tokens, stop_token_ids=(marker,), seed=ctx.next_seed()
        )
        rationales = ctx.generate([GenerationRequest(list(p.prompt_ids), params) for p in prompts])
        closed = [close_rationale(g.response_ids, g.logprobs, marker, eos) for g in rationales]
        params = ctx.sampling(n=1, max_new_tokens=c.answer_tokens, seed=ctx.next_seed())
        answers = ctx.generate(
            [GenerationRequest(g.prompt_ids + z, params) for g, (z, _, _) in zip(rationales, closed)]
        )
        rows = []
        for g, (z, z_logprobs, z_mask), a in zip(rationales, closed, answers):
            prompt = prompts[g.request_index]
            gold = tok(str(prompt.meta["answer"]), add_special_tokens=False)["input_ids"] + [eos]
            sampled = tok.decode(z + a.response_ids, skip_special_tokens=True)
            rows.append(
                dict(
                    uid=new_uid(),
                    group=prompt.uid,
                    prompt_ids=g.prompt_ids,
                    response_ids=z + gold,
                    logprobs=z_logprobs + [0.0] * len(gold),
                    policy_version=g.policy_version,
                    reward=float(ctx.task.is_correct(prompt.meta, sampled)),
                    loss_mask=z_mask + [0] * len(gold) if phase == "psi" else [1] * (len(z) + len(gold)),
                    rationale_len=len(z),
                    phase=phase,
                    iteration=self.position.iteration,
                    meta={**prompt.meta, "sampled": sampled, "marker_sampled": bool(z_mask[-1])},
                )
            )
        table = make_experience(rows, EXTRA_SCHEMA)
        scored = ctx.policy_logprobs(table)  # log P(response token | prefix, theta) on the learner's weights
        lens = table.column("rationale_len").to_pylist()
        table = table.set_column(
            table.schema.get_field_index("shaped_reward"),
            "shaped_reward",
            pa.array(shaped_rewards(scored, lens), type=pa.float32()),
        )
        table = set_token_column(
            table, "logprobs", [lp[:n] + s[n:] for lp, s, n in zip(table.column("logprobs").to_pylist(), scored, lens)]
        )
        uses_anchor = c.kl_coef > 0 or c.theta_weights == "posterior"
        first_of_iteration = self.position.step_in_phase == 0 and (phase == "psi" or c.psi_steps == 0)
        if uses_anchor and c.kl_anchor == "theta_t" and first_of_iteration:
            ctx.anchor_reference()  # P(.|x, theta_t): the weights the previous theta-steps left
        if (phase == "psi" and c.kl_coef > 0) or (phase == "theta" and c.theta_weights == "posterior"):
            table = set_token_column(table, "ref_logprobs", ctx.ref_logprobs(table))
        return table

    def _returns(self, table: pa.Table) -> np.ndarray:
        """The psi-step's sequence returns R = r - beta * sum over sampled rationale tokens of log Q - log P_ref."""
        r = np.asarray(table.column("shaped_reward").to_pylist(), np.float64)
        if self.config.kl_coef == 0:
            return r
        logq, logp = self._rationale_logprob_sums(table)
        return kl_regularised_returns(r, logq, logp, self.config.kl_coef)

    @staticmethod
    def _rationale_logprob_sums(table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """Sums of the sampler's and the anchor's logprobs over each row's sampled rationale tokens
        (an appended marker, an environment token, left out)."""
        masks = [
            [1] * (n - 1) + [int(m["marker_sampled"])]
            for n, m in zip(table.column("rationale_len").to_pylist(), meta_of(table))
        ]

        def sums(column):
            return np.array(
                [sum(v for v, m in zip(lp, mask) if m) for lp, mask in zip(table.column(column).to_pylist(), masks)]
            )

        return sums("logprobs"), sums("ref_logprobs")

    def prepare(self, table: pa.Table) -> TrainBatch:
        """psi rows: advantages on the sampled rationale tokens; theta rows: the likelihood mask
        over rationale + gold answer. Commits one step of the phase the rows were sampled in."""
        phases = set(table.column("phase").to_pylist())
        if len(phases) != 1:
            raise ValueError(f"brite: a batch mixes phases {sorted(phases)}")
        phase = phases.pop()
        batch = collate(table)
        batch.extras["theta"] = torch.full((len(batch),), float(phase == "theta"))
        if phase == "psi":
            adv = rloo_advantages(self._returns(table), table.column("group").to_pylist())
            batch.advantages = broadcast_to_tokens(torch.tensor(adv, dtype=torch.float32), batch.response_mask)
        elif self.config.theta_weights == "posterior":
            logq, logp = self._rationale_logprob_sums(table)
            weights = posterior_weights(
                table.column("shaped_reward").to_pylist(), logq, logp, table.column("group").to_pylist()
            )
            batch.extras["weight"] = torch.tensor(weights, dtype=torch.float32)
        self.position = self.position.advance(self.config.psi_steps, self.config.theta_steps)
        return batch

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        metas = meta_of(table)
        phase = table.column("phase")[0].as_py()
        out = {
            "brite/theta_phase": float(phase == "theta"),
            "brite/iteration": float(table.column("iteration")[0].as_py()),
            "brite/shaped_reward": float(np.mean(table.column("shaped_reward").to_pylist())),
            "brite/answer_accuracy": float(np.mean(table.column("reward").to_pylist())),
            "brite/rationale_tokens": float(np.mean(table.column("rationale_len").to_pylist())),
            "brite/marker_sampled": float(np.mean([m["marker_sampled"] for m in metas])),
        }
        if phase == "psi" and self.config.kl_coef > 0:
            logq, logp = self._rationale_logprob_sums(table)
            out["brite/kl_ref"] = float(np.mean(logq - logp))
        if phase == "theta" and self.config.theta_weights == "posterior":  # effective sample size / rows
            logq, logp = self._rationale_logprob_sums(table)
            w = posterior_weights(
                table.column("shaped_reward").to_pylist(), logq, logp, table.column("group").to_pylist()
            )
            out["brite/theta_ess"] = float(w.sum() ** 2 / (len(w) * (w**2).sum()))
        return out

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        theta = batch.extras["theta"]
        if bool((theta != theta[0]).any()):
            raise ValueError("brite: a minibatch mixes psi and theta rows")
        mask = batch.response_mask
        if theta[0] > 0.5:
            loss = sft_loss(outputs.logprobs, mask)
            if "weight" in batch.extras:  # theta_weights: posterior
                weighted = weighted_sft_loss(outputs.logprobs, mask, batch.extras["weight"])
                return weighted, {"loss/theta_nll": loss.item(), "loss/theta_weighted_nll": weighted.item()}
            return loss, {"loss/theta_nll": loss.item()}
        loss, clip_frac, approx_kl = clipped_policy_loss(
            outputs.logprobs, batch.old_logprobs, batch.advantages, mask, self.config.clip_eps
        )
        return loss, {"loss/psi_policy": loss.item(), "clip_frac": clip_frac.item(), "approx_kl_old": approx_kl.item()}
