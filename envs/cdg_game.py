"""The Critic-Discernment Game (../shared/papers/cdg.md) over any verifiable task (`is_correct`).

One game, played by three roles (role prompts on one policy, or one model per role: the
sampler is told which role plays each context):

1. the prover answers the task's prompt: solution z (rationale + answer);
2. a critic critiques z. Which critic is decided by z's correctness (`critic_role`): a wrong z
   goes only to the helpful critic (point at the real error), a correct z only to the
   misleading critic (argue for an invented error);
3. the prover sees the critique, not who wrote it, and gives a final answer z'.

Everything is at the token level, so a stored transcript is exactly the token sequence each
role was conditioned on (its sampler logprobs stay valid):

    critic context   = role prefix + problem + z + critique_open
    revision context =               problem + z + critique_open + c + revise_open [+ problem]

(`restate_problem`: the problem asked again at the end, so a model trained on the task's prompt
format answers in the same format.)

The critic's role prefix is the only place its intent appears; the prover's context never
holds it. `play_games` plays a batch of games with three batched sampling calls; the
transcript helpers lay out one row per role turn with each role's tokens masked for the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from envs.base import TrainSplitView

ROLES = ("prover", "helpful", "misleading")


@dataclass(frozen=True)
class Turn:
    """One sampled turn: token ids (with the stop token when it stopped) and their sampler logprobs."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str = "stop"


@dataclass(frozen=True)
class Templates:
    """Token ids of the role prompts and of the glue between turns."""

    helpful: list[int]
    misleading: list[int]
    critique_open: list[int]
    revise_open: list[int]
    restate_problem: bool = True  # the revision context ends with the problem again (asks it anew)

    @classmethod
    def from_text(
        cls,
        tokenizer,
        helpful: str,
        misleading: str,
        critique_open: str,
        revise_open: str,
        restate_problem: bool = True,
    ) -> "Templates":
        ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
        return cls(ids(helpful), ids(misleading), ids(critique_open), ids(revise_open), restate_problem)

    def prefix(self, role: str) -> list[int]:
        if role == "helpful":
            return self.helpful
        if role == "misleading":
            return self.misleading
        raise ValueError(f"unknown critic role {role!r} (helpful, misleading)")


@dataclass
class Critique:
    turn: Turn
    finals: list[Turn] = field(default_factory=list)  # the prover's z', repeated play from one context
    finals_ok: list[bool] = field(default_factory=list)


@dataclass
class Game:
    """One solution z of one problem, the critiques it got and the prover's final answers."""

    problem_uid: str
    row: dict  # the task row (answer, ...)
    problem_ids: list[int]
    solution_index: int
    solution: Turn
    solution_ok: bool
    role: str  # the critic that saw z: "helpful" (z wrong) or "misleading" (z correct)
    critiques: list[Critique] = field(default_factory=list)


# (contexts, n, max_new_tokens, role playing each context) -> n sampled turns per context, in context order
Sampler = Callable[[Sequence[list[int]], int, int, Sequence[str]], list[list[Turn]]]
# (task row, response token ids) -> is the answer right
Checker = Callable[[dict, list[int]], bool]


def critic_role(solution_ok: bool) -> str:
    """Helpful critics see only wrong solutions, misleading critics only correct ones."""
    return "misleading" if solution_ok else "helpful"


def critic_context(
    templates: Templates, role: str, problem_ids: Sequence[int], solution_ids: Sequence[int]
) -> list[int]:
    return [*templates.prefix(role), *problem_ids, *solution_ids, *templates.critique_open]


def revision_context(
    templates: Templates, problem_ids: Sequence[int], solution_ids: Sequence[int], critique_ids: Sequence[int]
) -> list[int]:
    """What the prover sees before z': the problem, its z and the critique, without the critic's role."""
    return [*problem_ids, *solution_ids, *revision_glue(templates, problem_ids, critique_ids)]


def revision_glue(templates: Templates, problem_ids: Sequence[int], critique_ids: Sequence[int]) -> list[int]:
    """The tokens between z and z' in the prover's transcript (none of them the prover's)."""
    return [
        *templates.critique_open,
        *critique_ids,
        *templates.revise_open,
        *(problem_ids if templates.restate_problem else []),
    ]


def prover_transcript(
    templates: Templates, problem_ids: Sequence[int], solution: Turn, critique: Turn, final: Turn
) -> tuple[list[int], list[float], list[int]]:
    """The prover's row after its problem prompt: z + critique_open + c + revise_open [+ problem] + z'.
    loss_mask is 1 on z and z' (the prover's tokens) and 0 on the critique and the glue;
    logprobs are the sampler's on the prover's tokens and 0 elsewhere."""
    glue_c = revision_glue(templates, problem_ids, critique.ids)
    ids = [*solution.ids, *glue_c, *final.ids]
    logprobs = [*solution.logprobs, *[0.0] * len(glue_c), *final.logprobs]
    mask = [1] * len(solution.ids) + [0] * len(glue_c) + [1] * len(final.ids)
    return ids, logprobs, mask


def final_only_mask(solution_len: int, glue_len: int, final_len: int, keep_solution: bool) -> list[int]:
    """A prover transcript mask on z' alone, or on z and z' when `keep_solution`."""
    return [int(keep_solution)] * solution_len + [0] * glue_len + [1] * final_len


def play_games(
    problems: Sequence[tuple[str, dict, list[int]]],
    sample: Sampler,
    is_correct: Checker,
    templates: Templates,
    solutions: int,
    critiques: int,
    finals: int,
    solution_tokens: int,
    critique_tokens: int,
    final_tokens: int,
) -> list[Game]:
    """Play `solutions` games per problem (uid, row, prompt ids): each z gets `critiques`
    critiques from the critic its correctness selects, and each critique `finals` final
    answers from the prover (the repeated play that estimates flip and success rates)."""
    games: list[Game] = []
    provers = lambda contexts: ["prover"] * len(contexts)
    contexts = [p[2] for p in problems]
    for (uid, row, ids), turns in zip(problems, sample(contexts, solutions, solution_tokens, provers(contexts))):
        for i, z in enumerate(turns):
            ok = bool(is_correct(row, z.ids))
            games.append(Game(uid, row, list(ids), i, z, ok, critic_role(ok)))
    contexts = [critic_context(templates, g.role, g.problem_ids, g.solution.ids) for g in games]
    for g, turns in zip(games, sample(contexts, critiques, critique_tokens, [g.role for g in games])):
        g.critiques = [Critique(c) for c in turns]
    pairs = [(g, c) for g in games for c in g.critiques]
    contexts = [revision_context(templates, g.problem_ids, g.solution.ids, c.turn.ids) for g, c in pairs]
    for (g, c), turns in zip(pairs, sample(contexts, finals, final_tokens, provers(contexts))):
        c.finals = turns
        c.finals_ok = [bool(is_correct(g.row, t.ids)) for t in turns]
    return games


@dataclass
class RevisionWarmupTask(TrainSplitView):
    """The task for the supervised warm-up of a model that has never seen the game (a tiny model
    trained from scratch; the paper starts from an instruct model that follows role prompts):
    every training row once as it is and once as a prover's revision turn (an earlier answer,
    right or wrong at random, a critique of random digits, the problem asked again) with the gold
    answer as target. Other splits and the reward are the task's own."""

    critique_open: str
    revise_open: str
    eos: str  # the tokenizer's stop token as text: a turn ends with it in the game's transcripts
    restate_problem: bool = True
    seed: int = 0

    def train_rows(self, rows: list[dict]) -> list[dict]:
        import random

        rng = random.Random(self.seed)
        eos, out = self.eos, list(rows)
        for row in rows:
            earlier = str(row["answer"]) if rng.random() < 0.5 else str(rng.randint(0, 99))
            critique = "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(1, 3)))
            problem = self.task.prompt_text(row)
            out.append(
                {
                    **row,
                    "revision_prompt": f"{problem}{earlier}{eos}{self.critique_open}{critique}{eos}"
                    f"{self.revise_open}{problem if self.restate_problem else ''}",
                }
            )
        return out

    def prompt_text(self, row: dict) -> str:
        return row.get("revision_prompt") or self.task.prompt_text(row)
