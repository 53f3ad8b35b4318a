"""CDG: Critic-Discernment Game self-play (../shared/papers/cdg.md; the game is envs/cdg_game.py).

One policy plays three roles by role prompts: the prover (solution z, then a final answer z'
after a critique of unknown intent), the helpful critic (sees only wrong z) and the misleading
critic (sees only correct z). Rewards, with correctness checked by the task's `is_correct`:

    prover:     R = 1[z ok] * (1[z' ok] + eta) + (1 - 1[z ok]) * 1[z' ok]       (`prover_reward`)
    helpful:    P(wrong -> right after its critique)                             (`flip_rate`)
    misleading: P(right -> wrong after its critique)

flip rates estimated by `finals` repeated final answers per critique. Two modes (`mode`):

- online: every prover transcript and every critique is a row with its episode reward;
  `advantage: grpo` (default): GRPO group advantages (prover rows grouped per problem,
  critiques per solution they critique), PPO clipped surrogate, k3 KL to the reference;
  `advantage: gae`: PPO (algorithms/ppo.py's `ppo_prepare` / `ppo_loss`) with a value head on
  each model, the episode reward on a row's last token, the KL in the per-token reward, and GAE
  stepping over the tokens the row's model did not write (the prover's row: the critique).
- rest (the paper's offline ReST), as phases inside the normal loop: `play_steps` steps of
  play (no learner update: `prepare` returns None), each sample's success rate estimated by
  repeated play and the samples above the thresholds kept (`rest_keep`) in a pool that
  accumulates across rounds up to `max_pool_per_role` per role; then `sft_steps` steps of
  supervised fine-tuning (`sft_loss`) on batches drawn from the pool; then the next round.
  As in the paper, each round's fine-tuning starts from the initial model (`restarts_policy`
  tells the controller to restart the learner from it, fresh optimizer included);
  `restart_each_round: false` fine-tunes the current policy instead.

A stored transcript is one row per role turn: the prover's row holds z + critique + z' with
loss_mask 1 on z and z' only; a critic's row holds its own critique after its context. A kept
prover sample is fine-tuned on z' (and on z when z was right); a kept critique on itself.
Mode, round, phase, step in phase and the pool are `state()`, so checkpoints hold them.

Roles and models (`models`): `shared` (the paper's default: one policy, role prompts),
`prover_critic` (a prover model and one critic model for both critic roles) or `per_role`
(three models). Every model starts as a copy of the warmed-up policy and learns only from its
own roles' rows (`split_by_policy`); the controller gives each its rollout worker and learner,
and the game's sampler sends each context to the model of the role playing it. The prover's
model is the run's policy (evaluated, exported as hf/); the others are saved beside it in
checkpoints (learner-<name>/, hf-<name>/). `warmup_revision` adds revision turns in the
game's format to the supervised warm-up, for a model that has never seen the game.
"""

from __future__ import annotations

import json
from typing import Literal, Sequence

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field, field_validator

from algorithms.base import register, rewards_of, set_token_column
from algorithms.common import (
    broadcast_to_tokens,
    clipped_policy_loss_with_kl,
    group_stats,
    grpo_advantages,
    rows_with_gradient,
)
from algorithms.ppo import ppo_loss, ppo_prepare
from algorithms.sft import sft_loss
from envs.cdg_game import (
    ROLES,
    Game,
    RevisionWarmupTask,
    Templates,
    Turn,
    critic_context,
    final_only_mask,
    play_games,
    prover_transcript,
)
from rlsys.batch import TrainBatch, collate
from rlsys.contract import (
    Algorithm,
    AlgorithmConfig,
    HasWarmupTask,
    ModelOutputs,
    ReportsPrepareMetrics,
    RestartsPolicy,
    SkipsRowsWithoutGradient,
    Stateful,
    TrainsSeveralPolicies,
)
from rlsys.experience import make_experience, meta_of, new_uid
from rlsys.generation import GenerationRequest


class CDGConfig(AlgorithmConfig):
    """CDG: Critic-Discernment Game self-play of a prover, a helpful and a misleading critic; online RL or ReST
    rounds."""

    mode: Literal["online", "rest"] = Field("online", description="online RL (`advantage`) or offline ReST rounds")
    eta: float = Field(0.5, ge=0, description="prover bonus for a correct first solution (kept against a misleader)")
    solutions: int = Field(4, ge=1, description="prover solutions z per problem (the prover's GRPO group)")
    critiques: int = Field(2, ge=1, description="critiques per solution (a critic's GRPO group)")
    finals: int = Field(
        2, ge=1, description="final answers z' per critique: the repeated play behind flip/success rates"
    )
    critique_tokens: int = Field(0, ge=0, description="max new tokens of a critique; 0: rollout.max_new_tokens")
    helpful_prompt: str = Field(
        "helpful critic:",
        min_length=1,
        description="role prefix of the helpful critic's context (before the problem and the solution)",
    )
    misleading_prompt: str = Field(
        "misleading critic:", min_length=1, description="role prefix of the misleading critic's context"
    )
    critique_open: str = Field(" critique:", min_length=1, description="text after the solution that opens a critique")
    revise_open: str = Field(
        " final:", min_length=1, description="text after the critique that opens the prover's final answer"
    )
    restate_problem: bool = Field(True, description="end the revision context with the problem asked again")
    warmup_revision: bool = Field(
        False, description="also warm up on revision turns (a model that has never seen the game)"
    )
    models: Literal["shared", "prover_critic", "per_role"] = Field(
        "shared", description="one policy for all roles, a prover and a critic model, or a model per role"
    )
    # online
    advantage: Literal["grpo", "gae"] = Field(
        "grpo",
        description="grpo: group-relative advantages, k3 KL in the loss; gae: PPO with a value head on each "
        "model, KL folded into the per-token reward",
    )
    clip_eps: float = Field(
        0.2, gt=0, lt=1, description="online: PPO clip range of the ratio to the rollout policy: [1 - eps, 1 + eps]"
    )
    kl_coef: float = Field(
        0.04,
        ge=0,
        description="online: KL to the reference: grpo: k3 weight in the loss; gae: penalty in the per-token reward",
    )
    std_normalize: bool = Field(True, description="grpo: divide the advantages by the group's reward std")
    vf_coef: float = Field(0.5, ge=0, description="gae: weight of the clipped value loss")
    value_clip: float = Field(0.2, gt=0, description="gae: clip range of the new value around the rollout's value")
    gamma: float = Field(1.0, ge=0, le=1, description="gae: discount per token")
    lam: float = Field(0.95, ge=0, le=1, description="gae: GAE lambda")
    whiten_advantages: bool = Field(True, description="gae: whiten the advantages over the batch's trained tokens")

    @field_validator("advantage")
    @classmethod
    def _gae_is_online(cls, advantage, info):
        if advantage == "gae" and info.data.get("mode") == "rest":
            raise ValueError("'gae' is for mode online (ReST rounds fine-tune by SFT, no value head)")
        return advantage

    # rest
    play_steps: int = Field(1, ge=1, description="steps of play per ReST round")
    sft_steps: int = Field(1, ge=1, description="supervised steps per ReST round")
    sft_batch_size: int = Field(64, ge=1, description="pool samples per supervised step")
    prover_threshold: float = Field(
        0.5, ge=0, le=1, description="keep a prover context whose success rate is above this"
    )
    helpful_threshold: float = Field(
        0.75, ge=0, le=1, description="keep a helpful critique whose flip rate is above this"
    )
    misleading_threshold: float = Field(
        0.5, ge=0, le=1, description="keep a misleading critique whose flip rate is above this"
    )
    max_pool_per_role: int = Field(10_000, ge=1, description="kept samples accumulated per role across rounds")
    restart_each_round: bool = Field(
        True,
        description="each round's fine-tuning starts from the initial model (the "
        "paper); false: from the current policy",
    )


# ---- the method, as pure functions ---------------------------------------------------------
def prover_reward(solution_ok: bool, final_ok: bool, eta: float) -> float:
    """R = 1[z ok] * (1[z' ok] + eta) + (1 - 1[z ok]) * 1[z' ok]."""
    z, zp = float(solution_ok), float(final_ok)
    return z * (zp + eta) + (1.0 - z) * zp


def flip_rate(role: str, finals_ok: Sequence[bool]) -> float:
    """A critic's reward: P(wrong -> right) for the helpful critic (it saw a wrong z),
    P(right -> wrong) for the misleading critic (it saw a correct z), over repeated finals."""
    ok = np.asarray(finals_ok, dtype=np.float64)
    if role == "helpful":
        return float(ok.mean())
    if role == "misleading":
        return float(1.0 - ok.mean())
    raise ValueError(f"unknown critic role {role!r} (helpful, misleading)")


def role_models(models: str) -> dict[str, str]:
    """The model that plays each role: one policy ("shared"), a prover and a critic model
    ("prover_critic"), or one per role ("per_role"). Names are the controller's policy names."""
    if models == "shared":
        return {r: "policy" for r in ROLES}
    if models == "prover_critic":
        return {"prover": "prover", "helpful": "critic", "misleading": "critic"}
    if models == "per_role":
        return {r: r for r in ROLES}
    raise ValueError(f"unknown CDG models setting {models!r} (shared, prover_critic, per_role)")


def rows_per_model(roles: Sequence[str], models: dict[str, str]) -> dict[str, list[int]]:
    """Row indices by the model their role's tokens train (only models with rows appear)."""
    out: dict[str, list[int]] = {}
    for i, role in enumerate(roles):
        out.setdefault(models[role], []).append(i)
    return out


def rest_keep(role: str, rate: float, final_ok: bool, thresholds: dict[str, float]) -> bool:
    """ReST filter: a sample is kept when its success rate is strictly above its role's
    threshold; a prover sample also needs its own final answer right (the SFT target)."""
    return rate > thresholds[role] and (role != "prover" or final_ok)


def game_rows(
    games: Sequence[Game], templates: Templates, eta: float, policy_version: int, phase: str, round_: int = 0
) -> list[dict]:
    """Experience rows of played games: one per critique (critic row) and one per final answer
    (prover transcript). `meta.rate` is the sample's success rate by repeated play: the flip
    rate for a critique, P(z' ok) from the same (z, critique) context for a prover transcript."""
    rows = []
    for g in games:
        for j, c in enumerate(g.critiques):
            flip = flip_rate(g.role, c.finals_ok)
            base = dict(
                game=f"{g.problem_uid}/{g.solution_index}",
                solution_ok=g.solution_ok,
                critic=g.role,
                phase=phase,
                round=round_,
            )
            rows.append(
                dict(
                    uid=new_uid(),
                    group=f"{g.problem_uid}/{g.solution_index}/critic",
                    prompt_ids=critic_context(templates, g.role, g.problem_ids, g.solution.ids),
                    response_ids=c.turn.ids,
                    logprobs=c.turn.logprobs,
                    reward=flip,
                    policy_version=policy_version,
                    meta={**base, "role": g.role, "rate": flip, "final_ok": None},
                )
            )
            success = float(np.mean(c.finals_ok))
            for final, ok in zip(c.finals, c.finals_ok):
                ids, logprobs, mask = prover_transcript(templates, g.problem_ids, g.solution, c.turn, final)
                rows.append(
                    dict(
                        uid=new_uid(),
                        group=f"{g.problem_uid}/prover",
                        prompt_ids=g.problem_ids,
                        response_ids=ids,
                        logprobs=logprobs,
                        loss_mask=mask,
                        reward=prover_reward(g.solution_ok, ok, eta),
                        policy_version=policy_version,
                        meta={
                            **base,
                            "role": "prover",
                            "rate": success,
                            "final_ok": ok,
                            "critique": j,
                            "solution_len": len(g.solution.ids),
                            "final_len": len(final.ids),
                        },
                    )
                )
    return rows


def sft_sample(row: dict) -> dict:
    """A kept row as a supervised sample: critics train on their critique; a prover on z'
    (and on z too when z was right: a wrong first answer is never imitated)."""
    meta = row["meta"]
    mask = [1] * len(row["response_ids"])
    if meta["role"] == "prover":
        n, m = meta["solution_len"], meta["final_len"]
        mask = final_only_mask(n, len(row["response_ids"]) - n - m, m, keep_solution=meta["solution_ok"])
    return dict(
        role=meta["role"],
        group=row["group"],
        prompt_ids=list(row["prompt_ids"]),
        response_ids=list(row["response_ids"]),
        loss_mask=mask,
        rate=meta["rate"],
    )


def add_to_pool(pool: dict[str, list], samples: Sequence[dict], cap: int) -> int:
    """Accumulate samples per role up to `cap` each (later ones are dropped). Returns how many were added."""
    added = 0
    for s in samples:
        if len(pool[s["role"]]) < cap:
            pool[s["role"]].append(s)
            added += 1
    return added


# ---- the plug-in ----------------------------------------------------------------------------
@register("cdg")
class CDG(
    Algorithm,
    Stateful,
    TrainsSeveralPolicies,
    HasWarmupTask,
    RestartsPolicy,
    ReportsPrepareMetrics,
    SkipsRowsWithoutGradient,
):
    Config = CDGConfig

    def __init__(self, config: CDGConfig | None = None):
        self.config = config or self.Config()
        self.round, self.phase, self.phase_step = 0, ("play" if self.config.mode == "rest" else "online"), 0
        self.pool: dict[str, list] = {r: [] for r in ROLES}
        self.models = role_models(self.config.models)

    @property
    def needs_value_head(self) -> bool:
        return self.config.mode == "online" and self.config.advantage == "gae"

    @property
    def policy_names(self) -> tuple[str, ...]:
        """The models this run trains, the prover's first (the run's policy)."""
        return tuple(dict.fromkeys(self.models[r] for r in ROLES))

    def split_by_policy(self, table: pa.Table) -> dict[str, pa.Table]:
        """Each model's rows: the turns of the roles it plays."""
        rows = rows_per_model([m["role"] for m in meta_of(table)], self.models)
        return {name: table.take(rows[name]) for name in self.policy_names if name in rows}

    @property
    def _thresholds(self) -> dict[str, float]:
        c = self.config
        return {"prover": c.prover_threshold, "helpful": c.helpful_threshold, "misleading": c.misleading_threshold}

    def warmup_task(self, task, tokenizer):
        """The task the supervised warm-up trains on: the task, or with `warmup_revision` the task
        plus revision-turn rows in the game's format (`RevisionWarmupTask`)."""
        c = self.config
        if not c.warmup_revision:
            return task
        return RevisionWarmupTask(task, c.critique_open, c.revise_open, tokenizer.eos_token, c.restate_problem)

    def rollout(self, ctx, prompts) -> pa.Table:
        table = self._sft_table(ctx) if self.phase == "sft" else self._play(ctx, prompts)
        self._advance()
        return table

    def _play(self, ctx, prompts) -> pa.Table:
        c = self.config
        templates = Templates.from_text(
            ctx.tokenizer, c.helpful_prompt, c.misleading_prompt, c.critique_open, c.revise_open, c.restate_problem
        )
        tokens = ctx.sampling().max_new_tokens
        problems = [(p.uid, p.meta, list(p.prompt_ids)) for p in prompts]
        games = play_games(
            problems,
            sampler(ctx, self.models),
            checker(ctx),
            templates,
            c.solutions,
            c.critiques,
            c.finals,
            tokens,
            c.critique_tokens or tokens,
            tokens,
        )
        rows = game_rows(games, templates, c.eta, ctx.policy_version, self.phase, self.round)
        if self.phase == "play":
            kept = [
                r
                for r in rows
                if rest_keep(r["meta"]["role"], r["meta"]["rate"], r["meta"]["final_ok"], self._thresholds)
            ]
            added = add_to_pool(self.pool, [sft_sample(r) for r in kept], c.max_pool_per_role)
            for r in rows:
                r["meta"]["pool_added"] = added
        table = make_experience(rows)
        if self.phase == "online" and (c.kl_coef > 0 or self.needs_value_head):
            table = set_token_column(table, "ref_logprobs", ctx.ref_logprobs(table))
        if self.phase == "online" and self.needs_value_head:
            table = set_token_column(table, "values", self._values_by_model(ctx, table))
        return table

    def _values_by_model(self, ctx, table: pa.Table) -> list:
        """Each row's value estimates from the value head of the model that plays its role."""
        out = [None] * table.num_rows
        for name, rows in rows_per_model([m["role"] for m in meta_of(table)], self.models).items():
            for i, v in zip(rows, ctx.values(table.take(rows), policy=name)):
                out[i] = v
        return out

    def _sft_table(self, ctx) -> pa.Table:
        """`sft_batch_size` samples drawn uniformly from the pool (all roles), as current-version rows."""
        samples = [s for role in ROLES for s in self.pool[role]]
        rng = np.random.default_rng(ctx.next_seed())
        pick = rng.choice(len(samples), size=min(self.config.sft_batch_size, len(samples)), replace=False)
        rows = [
            dict(
                uid=new_uid(),
                group=s["group"],
                prompt_ids=s["prompt_ids"],
                response_ids=s["response_ids"],
                logprobs=[0.0] * len(s["response_ids"]),
                loss_mask=s["loss_mask"],
                reward=s["rate"],
                policy_version=ctx.policy_version,
                meta={
                    "role": s["role"],
                    "phase": "sft",
                    "rate": s["rate"],
                    "round": self.round,
                    "phase_step": self.phase_step,
                },
            )
            for s in (samples[i] for i in sorted(pick))
        ]
        return make_experience(rows)

    def _advance(self) -> None:
        """rest: play for play_steps steps (longer while the pool is empty), then sft_steps steps of SFT, next round."""
        if self.phase == "online":
            return
        self.phase_step += 1
        if self.phase == "play" and self.phase_step >= self.config.play_steps and any(self.pool.values()):
            self.phase, self.phase_step = "sft", 0
        elif self.phase == "sft" and self.phase_step >= self.config.sft_steps:
            self.round, self.phase, self.phase_step = self.round + 1, "play", 0

    def restarts_policy(self, table: pa.Table) -> bool:
        """True for the first fine-tuning step of a ReST round: the learner starts it from the initial model."""
        meta = json.loads(table.column("meta")[0].as_py())
        return self.config.restart_each_round and meta["phase"] == "sft" and meta["phase_step"] == 0

    def prepare(self, table: pa.Table) -> TrainBatch | None:
        """None for a ReST play step (games only gather samples; the weights stay as they are)."""
        phase = table_phase(table)
        if phase == "play":
            return None
        batch = collate(table)
        if phase == "sft":
            batch.extras["sft"] = torch.ones(len(batch))
            return batch
        if self.needs_value_head:
            return ppo_prepare(batch, self.config)
        per_sequence = torch.tensor(
            grpo_advantages(rewards_of(table), table.column("group").to_pylist(), self.config.std_normalize),
            dtype=torch.float32,
        )
        batch.advantages = broadcast_to_tokens(per_sequence, batch.response_mask)
        return batch

    def prepare_metrics(self, table: pa.Table) -> dict[str, float]:
        metas, rewards = meta_of(table), rewards_of(table)
        out = {"cdg/round": float(metas[0]["round"]), "cdg/phase_sft": float(table_phase(table) == "sft")}
        out.update({f"cdg/pool_{r}": float(len(self.pool[r])) for r in ROLES if self.config.mode == "rest"})
        by_role = {r: [i for i, m in enumerate(metas) if m["role"] == r] for r in ROLES}
        if table_phase(table) == "sft":
            out.update({f"cdg/sft_{r}": float(len(ix)) for r, ix in by_role.items()})
            return out
        prover = by_role["prover"]
        out["cdg/prover_reward"] = float(rewards[prover].mean())
        out["cdg/solution_acc"] = float(np.mean([metas[i]["solution_ok"] for i in prover]))
        out["cdg/final_acc"] = float(np.mean([metas[i]["final_ok"] for i in prover]))
        for role in ("helpful", "misleading"):
            ix = by_role[role]
            out[f"cdg/{role}_critiques"] = float(len(ix))
            if ix:
                out[f"cdg/{role}_flip_rate"] = float(rewards[ix].mean())
        if table_phase(table) == "play":
            out["cdg/pool_added"] = float(metas[0].get("pool_added", 0))
        else:
            out.update(group_stats(rewards.tolist(), table.column("group").to_pylist()))
        return out

    def gradient_rows(self, batch: TrainBatch) -> torch.Tensor:
        """Every row of a supervised (ReST) batch or of an online gae batch (each trains the value
        head); in online GRPO, the rows with a nonzero advantage or a KL term."""
        if "sft" in batch.extras or self.needs_value_head:  # gae: every row trains the value head
            return torch.ones(len(batch), dtype=torch.bool)
        return rows_with_gradient(batch, self.config.kl_coef)

    def loss(self, outputs: ModelOutputs, batch: TrainBatch):
        mask = batch.response_mask
        if "sft" in batch.extras:
            loss = sft_loss(outputs.logprobs, mask)
            return loss, {"loss/sft": loss.item()}
        if self.needs_value_head:
            return ppo_loss(outputs, batch, self.config)
        return clipped_policy_loss_with_kl(outputs.logprobs, batch, self.config.clip_eps, self.config.kl_coef)

    def state(self) -> dict:
        return {
            "mode": self.config.mode,
            "round": self.round,
            "phase": self.phase,
            "phase_step": self.phase_step,
            "pool": self.pool,
        }

    def load_state(self, state: dict) -> None:
        if state["mode"] != self.config.mode:
            raise ValueError(
                f"checkpoint was written in CDG mode {state['mode']!r}, the config says {self.config.mode!r}"
            )
        self.round, self.phase, self.phase_step = state["round"], state["phase"], state["phase_step"]
        self.pool = {r: list(state["pool"][r]) for r in ROLES}


def table_phase(table: pa.Table) -> str:
    """online / play / sft: what the rows of a CDG table were made for (one phase per table)."""
    return json.loads(table.column("meta")[0].as_py())["phase"]


def sampler(ctx, models: dict[str, str]):
    """The game's Sampler on the rollout workers: n turns per context at the rollout settings,
    each context sampled by the model of the role playing it (the models side by side)."""

    def sample(contexts, n: int, max_new_tokens: int, roles) -> list[list[Turn]]:
        params = ctx.sampling(n=n, seed=ctx.next_seed(), max_new_tokens=max_new_tokens)
        out: list[list[Turn]] = [[] for _ in contexts]
        per_model = rows_per_model(roles, models)
        gens = ctx.generate_each(
            {model: [GenerationRequest(list(contexts[i]), params) for i in ix] for model, ix in per_model.items()}
        )
        for model, ix in per_model.items():
            for g in gens[model]:
                out[ix[g.request_index]].append(Turn(list(g.response_ids), list(g.logprobs), g.finish_reason))
        return out

    return sample


def checker(ctx):
    """The task's `is_correct` on decoded response tokens."""
    return lambda row, ids: ctx.task.is_correct(row, ctx.tokenizer.decode(ids, skip_special_tokens=True))
