"""RLEF: multi-turn code RL with execution feedback (Gehring et al. 2024; ../shared/papers/rlef.md).

Rollout: each prompt opens `samples_per_prompt` episodes of envs/code.py's CodeEnv, played
by the common multi-turn rollout (algorithms/episodes.py `play_episodes`, side by side): each
answer's public-test run goes to the run's sandbox pool (`ctx.execute`) from its episode's
thread while the other episodes generate; a failed run's feedback is the next observation; the
last answer's code runs on the private tests inside the episode's last step (or, for a dialog
whose next feedback would pass the run's episode budget, in `CodeEnv.end_early`). The dialog has no
chat template (`PlainEncoder`): problem, answer, feedback, answer, ... as the tokenizer reads
them, each answer's ids exactly as sampled. Held-out evaluation plays the same episodes, one
per problem (`evaluate`: 1@3).

One experience row per episode: prompt = the problem, response = answer_1 + feedback_1 +
answer_2 + ... with loss_mask 0 on the feedback (environment) tokens.

Per-turn rewards (gamma = 1):
    R_t = r_t - beta * mean_{tokens of answer t}(log pi - log ref)         (KL: geometric mean)
    r_t = -0.2 for no parsable code; the last turn also +1/-1 on the private tests.
    A_t = sum_{i>=t} R_i - V(c_t),   V(c_t) read at the last prompt token before answer t,
shared by every token of answer t (whitened over the batch's answer tokens by default,
as ppo.py does: the token-weighted mean push is then zero, which keeps long failed
episodes from simply pushing the policy's probabilities down). Loss:
    w * clipped surrogate(pi/pi_old, A, 0.2)  +  vf_coef * clipped value loss (0.2) at the V(c_t)
with w = min(1, pi_old / mu) the importance weight to the behaviour policy mu (the
sampler's logprobs; pi_old is the learner's own recomputation before the update), capped at 1.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Sequence

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field

from algorithms.base import register, set_token_column
from algorithms.common import clipped_policy_loss, clipped_value_loss, masked_mean, masked_whiten
from algorithms.episodes import Episode, EpisodeSettings, episode_rows, play_episodes
from envs.code import CodeEnv
from envs.conversation import PlainEncoder
from rlsys.batch import TrainBatch, collate
from rlsys.contract import (
    Algorithm,
    AlgorithmConfig,
    EvaluatesItself,
    HasOwnEpisodes,
    ModelOutputs,
    ReportsPrepareMetrics,
    UnpackedOnly,
)
from rlsys.experience import meta_of


class RLEFConfig(AlgorithmConfig):
    """RLEF (Gehring et al. 2024): multi-turn code RL with execution feedback (task code), PPO with per-turn values."""

    max_turns: int = Field(
        3,
        ge=1,
        le=10,
        description="most answers per episode (an episode ends at the first that passes the public tests)",
    )
    samples_per_prompt: int = Field(1, ge=1, le=64, description="episodes per prompt")
    kl_coef: float = Field(0.05, ge=0, description="beta of the per-turn KL penalty")
    clip_eps: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="PPO clip range of the ratio to the learner's own logprobs before the update: [1 - eps, 1 + eps]",
    )
    value_clip: float = Field(
        0.2, gt=0, description="clip range of the new value around the rollout's value in the value loss"
    )
    vf_coef: float = Field(0.5, ge=0, description="weight of the clipped value loss")
    feedback_chars: int = Field(500, ge=80, le=20000, description="longest feedback turn, in characters")
    whiten_advantages: bool = Field(
        True,
        description="whiten A over the batch's answer tokens (as ppo does); "
        "an affine map, so every token of a turn still shares one value",
    )


def turn_spans(turn_lengths: Sequence[int], feedback_lengths: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each answer inside the episode's response: answer_1, feedback_1, answer_2, ..."""
    spans, pos = [], 0
    for t, n in enumerate(turn_lengths):
        spans.append((pos, pos + n))
        pos += n + (feedback_lengths[t] if t < len(feedback_lengths) else 0)
    return spans


def turn_kl(logprobs: Sequence[float], ref_logprobs: Sequence[float], spans: Sequence[tuple[int, int]]) -> list[float]:
    """Per-turn mean over the answer's tokens of log pi - log ref (0 for an empty answer)."""
    lp, ref = np.asarray(logprobs, dtype=np.float64), np.asarray(ref_logprobs, dtype=np.float64)
    return [float((lp[a:b] - ref[a:b]).mean()) if b > a else 0.0 for a, b in spans]


def turn_advantages(
    turn_rewards: Sequence[float], turn_kls: Sequence[float], turn_values: Sequence[float], kl_coef: float
) -> tuple[np.ndarray, np.ndarray]:
    """(returns G_t = sum_{i>=t} R_i, advantages A_t = G_t - V(c_t)) with
    R_t = r_t - kl_coef * kl_t and gamma = 1."""
    r = np.asarray(turn_rewards, dtype=np.float64) - kl_coef * np.asarray(turn_kls, dtype=np.float64)
    returns = np.cumsum(r[::-1])[::-1]
    return returns, returns - np.asarray(turn_values, dtype=np.float64)


def spread_over_turns(per_turn: Sequence[float], spans: Sequence[tuple[int, int]], length: int) -> list[float]:
    """A per-response-token list: per_turn[t] on every token of answer t, 0 on feedback tokens."""
    out = [0.0] * length
    for value, (a, b) in zip(per_turn, spans):
        out[a:b] = [float(value)] * (b - a)
    return out


def code_episode_meta(episode: Episode) -> dict:
    """What RLEF's rows keep of a played code episode besides the common summary: each answer's
    and each feedback's length in tokens (from the row's policy turns), whether the public and
    private tests passed, the answers without parsable code, the sandbox runs made."""
    conv, code = episode.conversation, episode.env.episode
    turns = conv.policy_turns
    return {
        "answer_lengths": [end - start for start, end in turns],
        "feedback_lengths": [nxt[0] - end for (_, end), nxt in zip(turns, turns[1:])],
        "public_passed": code.public_passed,
        "private_passed": code.private_passed,
        "no_code_turns": sum(x is None for x in code.programs),
        "sandbox_runs": sum(x is not None for x in code.programs) + (code.programs[-1] is not None),
    }


def capped_importance_weight(old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor) -> torch.Tensor:
    """min(1, pi_old / mu) per token (no gradient)."""
    return torch.exp(old_logprobs - behaviour_logprobs).clamp(max=1.0).detach()


@register("rlef")
class RLEF(Algorithm, EvaluatesItself, ReportsPrepareMetrics, HasOwnEpisodes, UnpackedOnly):
    Config = RLEFConfig
    needs_value_head = True

    def __init__(self, config: RLEFConfig | None = None):
        self.config = config or self.Config()

    def episode_settings(self, tokenizer, task, run, max_tokens: int) -> EpisodeSettings:
        """The code dialogs as episodes: a CodeEnv per episode over the task's CodeEpisode (its
        sandbox limits, `max_turns`, `feedback_chars`), its programs run by `run`; a dialog whose
        next feedback would pass `max_tokens` ends there, its last answer the final one."""
        c = self.config
        new_episode = partial(task.episode, max_turns=c.max_turns, feedback_chars=c.feedback_chars)
        return EpisodeSettings(lambda: CodeEnv(run, new_episode), PlainEncoder(tokenizer), c.max_turns, max_tokens)

    def _settings(self, ctx) -> EpisodeSettings:
        """The episode settings over the run's sandbox pool (`ctx.execute`, looked up per run)."""
        return self.episode_settings(
            ctx.tokenizer, ctx.task, lambda requests: ctx.execute(requests), ctx.episode_tokens
        )

    def rollout(self, ctx, prompts) -> pa.Table:
        c = self.config
        params = ctx.sampling(n=1, seed=ctx.next_seed())
        episodes = play_episodes(ctx, prompts, c.samples_per_prompt, params, self._settings(ctx))
        table = episode_rows(episodes, code_episode_meta)
        table = set_token_column(table, "ref_logprobs", ctx.ref_logprobs(table))
        table = set_token_column(table, "values", ctx.values(table))
        learner = [list(map(float, v)) for v in ctx.policy_logprobs(table)]
        return table.append_column("learner_logprobs", pa.array(learner, type=pa.list_(pa.float32())))

    def evaluate(self, ctx, prompts, params) -> dict[str, float]:
        """Held-out metrics as the paper reports them: one episode per problem (up to max_turns
        answers with public-test feedback), `accuracy` = its final code passing the private tests
        (1@3 at the default), sampled with `params` (the controller's: greedy by default)."""
        episodes = [e.env.episode for e in play_episodes(ctx, prompts, 1, params, self._settings(ctx))]
        return {
            "accuracy": float(np.mean([bool(e.private_passed) for e in episodes])),
            "public_pass": float(np.mean([e.public_passed for e in episodes])),
            "turns_mean": float(np.mean([len(e.answers) for e in episodes])),
            "first_answer_public_pass": float(np.mean([e.public_passed and len(e.answers) == 1 for e in episodes])),
        }

    def _turn_targets(self, table: pa.Table) -> list[tuple[list[tuple[int, int]], np.ndarray, np.ndarray]]:
        """Per row: the answer spans, G_t and A_t."""
        out = []
        behaviour, ref = table.column("logprobs").to_pylist(), table.column("ref_logprobs").to_pylist()
        values = table.column("values").to_pylist()
        for m, lp, rf, v in zip(meta_of(table), behaviour, ref, values):
            spans = turn_spans(m["answer_lengths"], m["feedback_lengths"])
            v_turn = [v[a] if a < len(v) else 0.0 for a, _ in spans]
            returns, adv = turn_advantages(m["turn_rewards"], turn_kl(lp, rf, spans), v_turn, self.config.kl_coef)
            out.append((spans, returns, adv))
        return out

    def prepare(self, table: pa.Table) -> TrainBatch:
        batch = collate(table)  # old_logprobs: the sampler's (behaviour) logprobs
        prompts = table.column("prompt_ids").to_pylist()
        learner = table.column("learner_logprobs").to_pylist()
        advantages, returns, value_mask = (torch.zeros_like(batch.response_mask) for _ in range(3))
        old = batch.old_logprobs.clone()
        for i, (spans, g, a) in enumerate(self._turn_targets(table)):
            o = len(prompts[i]) - 1  # response token j sits at column o + j
            old[i, o : o + len(learner[i])] = torch.tensor(learner[i])
            for t, (s, e) in enumerate(spans):
                advantages[i, o + s : o + e] = float(a[t])
                if e > s:
                    returns[i, o + s], value_mask[i, o + s] = float(g[t]), 1.0
        batch.extras = {"behaviour_logprobs": batch.old_logprobs, "value_mask": value_mask}
        advantages = advantages * batch.response_mask
        if self.config.whiten_advantages:
            advantages = masked_whiten(advantages, batch.response_mask)
        batch.old_logprobs, batch.advantages, batch.returns = old, advantages, returns
        return batch

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        metas = meta_of(table)
        turns = Counter(len(m["answer_lengths"]) for m in metas)
        first_fail = [m for m in metas if len(m["answer_lengths"]) > 1 or not m["public_passed"]]
        out = {
            "rlef/private_pass": float(np.mean([bool(m["private_passed"]) for m in metas])),
            "rlef/public_pass": float(np.mean([bool(m["public_passed"]) for m in metas])),
            "rlef/turns_mean": float(np.mean([len(m["answer_lengths"]) for m in metas])),
            "rlef/no_code_turns": float(np.mean([m["no_code_turns"] for m in metas])),
            "rlef/sandbox_runs": float(sum(m.get("sandbox_runs", 0) for m in metas)),
            "rlef/fixed_after_feedback": float(np.mean([bool(m["public_passed"]) for m in first_fail]))
            if first_fail
            else 0.0,
        }
        for k in range(1, self.config.max_turns + 1):
            out[f"rlef/turns_{k}"] = turns.get(k, 0) / len(metas)
        return out

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        c, mask = self.config, batch.response_mask
        weight = capped_importance_weight(batch.old_logprobs, batch.extras["behaviour_logprobs"])
        # w > 0, so -min(r*A, clip(r)*A) * w is the surrogate with advantages w*A
        policy_loss, clip_frac, approx_kl = clipped_policy_loss(
            outputs.logprobs, batch.old_logprobs, batch.advantages * weight, mask, c.clip_eps
        )
        value_mask = batch.extras["value_mask"]
        value_loss = clipped_value_loss(outputs.values, batch.old_values, batch.returns, value_mask, c.value_clip)
        loss = policy_loss + c.vf_coef * value_loss
        return loss, {
            "loss/policy": policy_loss.item(),
            "loss/value": value_loss.item(),
            "clip_frac": clip_frac.item(),
            "approx_kl_old": approx_kl.item(),
            "kl_ref": masked_mean(outputs.logprobs.detach() - batch.ref_logprobs, mask).item(),
            "is_weight_mean": masked_mean(weight, mask).item(),
        }
