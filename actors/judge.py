"""Generative judge, EvalPlanner style (../shared/papers/judge.md).

A judge model (any causal LM, served by the rollout backends: `make_backend`) works in
two generation passes:
  1. plan      - written from the instruction alone (`plan_prompt`: no response is shown);
  2. execution - the plan applied to the response(s) (`pairwise_prompt` / `pointwise_prompt`,
                 sections Plan, Execution, Verdict in that order), ending in a fixed final
                 line: `Verdict: A` / `Verdict: B` / `Verdict: tie`, or pointwise `Score: N`.
A pair is judged in both orders, (A,B) and (B,A), on the same plan. A preference counts
only when both orders agree; a disagreement is a tie and is counted. A final line that is
not a verdict makes the judgement "unparsable": reported, never a silent preference.

As a reward source (`score(table)`, the RewardWorker's call): pointwise scores mapped to
[0, 1], or pairwise win rates within each group (round robin; a tie, a disagreement or an
unparsable pair is worth 1/2 to both sides), so a two-row group gets (1, 0), (0, 1) or
(1/2, 1/2) and PILAF's `labels: max` turns the last into no preference.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import pyarrow as pa

from rlsys.generation import GenerationRequest, SamplingParams

VERDICTS = ("A", "B", "tie")
UNPARSABLE = "unparsable"
SECTIONS = ("Plan", "Execution", "Verdict")

_VERDICT_LINE = re.compile(r"^\s*verdict\s*:\s*(a|b|tie)\s*\.?\s*$", re.IGNORECASE)
_SCORE_LINE = re.compile(r"^\s*score\s*:\s*([+-]?\d+)\s*\.?\s*$", re.IGNORECASE)


# ---- prompts ---------------------------------------------------------------------------------
def plan_prompt(instruction: str) -> str:
    """Pass 1: the evaluation plan, from the instruction alone."""
    return (
        "Write a short step-by-step plan for judging answers to the instruction below. "
        "Do not answer it.\n\n"
        f"Instruction:\n{instruction}\n\nPlan:\n"
    )


def pairwise_prompt(instruction: str, plan: str, response_a: str, response_b: str) -> str:
    """Pass 2 for a pair: the plan, then the execution the model writes, ending in the verdict line."""
    return (
        "Judge which response follows the instruction better. Write the sections in this order: "
        "Plan (given), Execution (apply each step of the plan to both responses), "
        "Verdict (one final line: 'Verdict: A', 'Verdict: B' or 'Verdict: tie').\n\n"
        f"Instruction:\n{instruction}\n\nResponse A:\n{response_a}\n\nResponse B:\n{response_b}\n\n"
        f"Plan:\n{plan.strip()}\n\nExecution:\n"
    )


def pointwise_prompt(instruction: str, plan: str, response: str, min_score: int, max_score: int) -> str:
    """Pass 2 for one response: the plan, then the execution, ending in `Score: N`."""
    return (
        "Judge how well the response follows the instruction. Write the sections in this order: "
        "Plan (given), Execution (apply each step of the plan to the response), "
        f"Verdict (one final line: 'Score: N' with N an integer from {min_score} to {max_score}).\n\n"
        f"Instruction:\n{instruction}\n\nResponse:\n{response}\n\n"
        f"Plan:\n{plan.strip()}\n\nExecution:\n"
    )


# ---- parsing ---------------------------------------------------------------------------------
def fit_to_context(ids: list[int], budget: int) -> list[int]:
    """A prompt's token ids cut to `budget` by dropping its middle (the responses): the head
    keeps the instruction and plan, the tail the closing instructions the verdict follows."""
    if budget < 2:
        raise ValueError(f"a judge context budget of {budget} tokens leaves no room for a prompt")
    if len(ids) <= budget:
        return ids
    head = budget // 2
    return ids[:head] + ids[len(ids) - (budget - head) :]


def final_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def parse_verdict(text: str) -> str:
    """'A', 'B' or 'tie' from the fixed final line `Verdict: X`; anything else is 'unparsable'."""
    m = _VERDICT_LINE.match(final_line(text))
    if not m:
        return UNPARSABLE
    v = m.group(1)
    return "tie" if v.lower() == "tie" else v.upper()


def parse_score(text: str, min_score: int, max_score: int) -> Optional[int]:
    """N from the final line `Score: N` when min_score <= N <= max_score, else None (unparsable)."""
    m = _SCORE_LINE.match(final_line(text))
    if not m:
        return None
    n = int(m.group(1))
    return n if min_score <= n <= max_score else None


# ---- combining the two orders ----------------------------------------------------------------
def swap_verdict(verdict: str) -> str:
    """A verdict given on (B, A) in the frame of (A, B)."""
    return {"A": "B", "B": "A"}.get(verdict, verdict)


@dataclass
class PairJudgement:
    """`verdict`: 'A', 'B', 'tie' or 'unparsable', in the frame of the pair as given.
    `orders`: the parsed verdict of each pass in its own frame, (A,B) then (B,A).
    `disagreement`: both passes parsed, and they differ once the swap is undone (-> tie)."""

    verdict: str
    orders: tuple[str, str]
    disagreement: bool
    plan: str = ""
    executions: tuple[str, str] = ("", "")


def combine_orders(verdict_ab: str, verdict_ba: str) -> tuple[str, bool]:
    """(combined verdict, disagreement) from the (A,B) pass and the (B,A) pass (in its own frame).
    Unparsable in either pass -> unparsable; agreement -> that verdict; else a tie."""
    if UNPARSABLE in (verdict_ab, verdict_ba):
        return UNPARSABLE, False
    back = swap_verdict(verdict_ba)
    if back == verdict_ab:
        return verdict_ab, False
    return "tie", True


@dataclass
class PointJudgement:
    score: Optional[int]  # None: unparsable
    plan: str = ""
    execution: str = ""


# ---- rewards and metrics from judgements ------------------------------------------------------
def round_robin(n: int) -> list[tuple[int, int]]:
    """Every unordered pair (i, j), i < j, of a group of n."""
    return list(itertools.combinations(range(n), 2))


def win_rates(n: int, outcomes: dict[tuple[int, int], str]) -> list[float]:
    """Mean points of each of n responses over its pairs: 1 for a win, 1/2 for a tie, a
    disagreement or an unparsable pair (no preference), 0 for a loss. A lone response gets 1/2."""
    points, games = np.zeros(n), np.zeros(n)
    for (i, j), verdict in outcomes.items():
        a = {"A": 1.0, "B": 0.0}.get(verdict, 0.5)
        points[i] += a
        points[j] += 1.0 - a
        games[i] += 1
        games[j] += 1
    return [float(p / g) if g else 0.5 for p, g in zip(points, games)]


def score_reward(score: Optional[int], min_score: int, max_score: int, unparsable_reward: float) -> float:
    """A pointwise score mapped to [0, 1]; an unparsable one gets `unparsable_reward`."""
    if score is None:
        return unparsable_reward
    return (score - min_score) / (max_score - min_score)


def judgement_metrics(pairs: Sequence[PairJudgement] = (), points: Sequence[PointJudgement] = ()) -> dict[str, float]:
    out: dict[str, float] = {}
    if pairs:
        n = len(pairs)
        out["judge/pairs"] = float(n)
        for v in (*VERDICTS, UNPARSABLE):
            out[f"judge/{v.lower()}"] = sum(p.verdict == v for p in pairs) / n
        out["judge/order_disagreements"] = sum(p.disagreement for p in pairs) / n
    if points:
        scores = [p.score for p in points if p.score is not None]
        out["judge/points"] = float(len(points))
        out["judge/unparsable_scores"] = 1.0 - len(scores) / len(points)
        if scores:
            out["judge/score_mean"] = float(np.mean(scores))
    return out


# ---- the actor -------------------------------------------------------------------------------
@dataclass
class JudgeOptions:
    """What the config's `reward.judge` section sets (rlsys/config.py JudgeConfig)."""

    mode: str = "pointwise"  # how `score(table)` judges: pointwise scores or pairwise win rates
    max_plan_tokens: int = 64
    max_execution_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    min_score: int = 1
    max_score: int = 10
    unparsable_reward: float = 0.0
    seed: int = 0


class JudgeWorker:
    """A judge model on a rollout backend. `tokenizer_dir`: the policy's tokenizer, used to
    decode experience rows in `score(table)` (the judge re-encodes text with its own)."""

    def __init__(
        self,
        judge_dir: str,
        tokenizer_dir: str | None = None,
        backend: str = "hf",
        batch_size: int = 32,
        threads: int = 1,
        options: JudgeOptions | dict | None = None,
    ):
        import torch

        from actors.rollout import make_backend  # torch: loaded by the judge worker, not the torch-free parsing here
        from rlsys.models import load_tokenizer  # torch, as above

        torch.set_num_threads(threads)
        self.options = options if isinstance(options, JudgeOptions) else JudgeOptions(**(options or {}))
        if self.options.min_score >= self.options.max_score:
            raise ValueError(
                f"judge min_score {self.options.min_score} must be below max_score {self.options.max_score}"
            )
        self.backend = make_backend(backend, judge_dir, batch_size)
        self.tokenizer = load_tokenizer(judge_dir)
        self.policy_tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else self.tokenizer
        config = json.loads((Path(judge_dir) / "config.json").read_text())
        self.context_length = config.get("max_position_embeddings")  # prompts are cut to fit (fit_to_context)
        self.calls = self.truncated = 0
        self._pairs: list[PairJudgement] = []
        self._points: list[PointJudgement] = []

    def complete(self, texts: Sequence[str], max_new_tokens: int) -> list[str]:
        """The judge model's continuation of each text."""
        if not texts:
            return []
        o = self.options
        self.calls += 1
        params = SamplingParams(
            n=1,
            max_new_tokens=max_new_tokens,
            temperature=o.temperature,
            seed=o.seed + self.calls,
            stop_token_ids=(self.tokenizer.eos_token_id,),
        )
        prompts = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        if self.context_length:
            budget = self.context_length - max_new_tokens
            self.truncated += sum(len(p) > budget for p in prompts)
            prompts = [fit_to_context(p, budget) for p in prompts]
        requests = [GenerationRequest(p, params) for p in prompts]
        gens = sorted(self.backend.generate(requests), key=lambda g: g.request_index)
        return self.tokenizer.batch_decode([g.response_ids for g in gens], skip_special_tokens=True)

    def plans(self, instructions: Sequence[str]) -> list[str]:
        """One plan per distinct instruction, written without seeing any response."""
        distinct = list(dict.fromkeys(instructions))
        written = dict(zip(distinct, self.complete([plan_prompt(i) for i in distinct], self.options.max_plan_tokens)))
        return [written[i] for i in instructions]

    def pairwise(self, items: Sequence[tuple[str, str, str]]) -> list[PairJudgement]:
        """(instruction, response_a, response_b) -> a judgement from both orders on one plan."""
        plans = self.plans([i for i, _, _ in items])
        texts = [pairwise_prompt(i, plan, a, b) for (i, a, b), plan in zip(items, plans)]
        texts += [pairwise_prompt(i, plan, b, a) for (i, a, b), plan in zip(items, plans)]
        executions = self.complete(texts, self.options.max_execution_tokens)
        out = []
        for k, plan in enumerate(plans):
            ab, ba = executions[k], executions[len(items) + k]
            orders = (parse_verdict(ab), parse_verdict(ba))
            verdict, disagreement = combine_orders(*orders)
            out.append(PairJudgement(verdict, orders, disagreement, plan, (ab, ba)))
        self._pairs += out
        return out

    def pointwise(self, items: Sequence[tuple[str, str]]) -> list[PointJudgement]:
        """(instruction, response) -> a score from the fixed final line, or unparsable (None)."""
        o = self.options
        plans = self.plans([i for i, _ in items])
        texts = [pointwise_prompt(i, plan, r, o.min_score, o.max_score) for (i, r), plan in zip(items, plans)]
        executions = self.complete(texts, o.max_execution_tokens)
        out = [PointJudgement(parse_score(e, o.min_score, o.max_score), plan, e) for e, plan in zip(executions, plans)]
        self._points += out
        return out

    def judge(self, prompt: str, responses: Sequence[str]):
        """The judge call of docs/architecture.md: two responses -> a PairJudgement, one -> a PointJudgement."""
        if len(responses) == 2:
            return self.pairwise([(prompt, responses[0], responses[1])])[0]
        if len(responses) == 1:
            return self.pointwise([(prompt, responses[0])])[0]
        raise ValueError(f"judge takes one response (pointwise) or two (pairwise), got {len(responses)}")

    # ---- reward source -----------------------------------------------------------------------
    def score(self, table: pa.Table) -> list[float]:
        """A reward per experience row: pointwise scores in [0, 1], or pairwise win rates
        within each `group` (judge.mode)."""
        decode = lambda col: self.policy_tokenizer.batch_decode(table.column(col).to_pylist(), skip_special_tokens=True)
        prompts, responses = decode("prompt_ids"), decode("response_ids")
        o = self.options
        if o.mode == "pointwise":
            judged = self.pointwise(list(zip(prompts, responses)))
            return [score_reward(j.score, o.min_score, o.max_score, o.unparsable_reward) for j in judged]
        members: dict[str, list[int]] = {}
        for k, g in enumerate(table.column("group").to_pylist()):
            members.setdefault(g, []).append(k)
        games = [(rows, pair) for rows in members.values() for pair in round_robin(len(rows))]
        judged = self.pairwise([(prompts[rows[i]], responses[rows[i]], responses[rows[j]]) for rows, (i, j) in games])
        rewards = [0.5] * table.num_rows
        outcomes: dict[tuple, dict] = {}
        for (rows, pair), j in zip(games, judged):
            outcomes.setdefault(tuple(rows), {})[pair] = j.verdict
        for rows in members.values():
            for k, r in zip(rows, win_rates(len(rows), outcomes.get(tuple(rows), {}))):
                rewards[k] = r
        return rewards

    def state(self) -> dict:
        """What a checkpoint keeps: the call count that seeds the next sampling call (a resumed
        sampling judge draws what the uninterrupted run would have)."""
        return {"calls": self.calls}

    def load_state(self, state: dict) -> None:
        self.calls = int(state.get("calls", 0))

    def take_metrics(self) -> dict[str, float]:
        """judge/* rates over the judgements since the last call (the controller logs them per step)."""
        out = judgement_metrics(self._pairs, self._points)
        if out or self.truncated:
            out["judge/truncated_prompts"] = float(self.truncated)
        self._pairs, self._points, self.truncated = [], [], 0
        return out
