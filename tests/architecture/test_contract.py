"""The algorithm contract (rlsys/contract.py), checked on every registered algorithm.

Static: each class subclasses `Algorithm`; it defines every member of each protocol on its
class line (subclassing a Protocol inherits its `...` stubs, so a missing hook would silently
return None); it has no public method that none of them names (a misspelt hook is never
called, an undeclared capability is never tested for); `isinstance` against each capability
agrees with the class line.
Dynamic: each algorithm runs one step, rollout -> prepare -> loss -> backward, in-process (no
Ray) on a `FakeContext` served by real 2-layer models through the workers' own code.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
from pathlib import Path
from typing import Generic, Protocol

import pytest
import torch

from algorithms.base import available, build_algorithm, get_algorithm
from rlsys.contract import (
    CAPABILITIES,
    Algorithm,
    AlgorithmConfig,
    EvaluatesItself,
    ModelOutputs,
    Prompt,
    ReportsPrepareMetrics,
    RestartsPolicy,
    RolloutContext,
    SkipsRowsWithoutGradient,
    Stateful,
    TrainsSeveralPolicies,
    UnpackedOnly,
    loss_denominator,
    policy_names,
)
from rlsys.models import TinyModelSpec, build_tiny_model, save_model_dir, train_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROTOCOLS = (Algorithm, *CAPABILITIES)
ALGORITHMS = available()


# ---- static: what a class declares, defines and exposes ------------------------------------
def is_protocol(k: type) -> bool:
    return k in (Protocol, Generic, object) or bool(vars(k).get("_is_protocol", False))


def annotated(proto: type) -> set[str]:
    """A protocol's data members (`name`, `Config`, `policy_names`, ...)."""
    return {n for k in proto.__mro__ if is_protocol(k) for n in vars(k).get("__annotations__", {})}


def members(proto: type) -> set[str]:
    """Every name a protocol requires; a marker class (TrainsOnStaleRows) requires none."""
    if not is_protocol(proto):
        return set()
    methods = {n for k in proto.__mro__ if is_protocol(k) and k not in (Protocol, Generic, object) for n in vars(k)}
    return {n for n in methods | annotated(proto) if not n.startswith("_")}


def declared(cls: type) -> list[type]:
    """The protocols (and markers) on the class line, directly or through a base."""
    return [p for p in PROTOCOLS if p in cls.__mro__]


def implementing(cls: type) -> list[type]:
    """The classes of `cls`'s MRO whose bodies count as definitions: not protocols, not object."""
    return [k for k in cls.__mro__ if not is_protocol(k)]


def is_method(value) -> bool:
    if isinstance(value, (property, functools.cached_property, staticmethod, classmethod)):
        return True
    return callable(value) and not isinstance(value, type)  # a nested class (Config) is data


def undefined_members(cls: type, instance=None) -> list[str]:
    """Members of a declared protocol that no implementing class defines (data members may
    also be set on the instance)."""
    problems = [] if Algorithm in cls.__mro__ else [f"{cls.__name__} does not subclass Algorithm"]
    for proto in declared(cls):
        for name in sorted(members(proto)):
            defined = any(name in vars(k) for k in implementing(cls))
            on_instance = name in annotated(proto) and instance is not None and name in vars(instance)
            if not (defined or on_instance):
                problems.append(
                    f"{cls.__name__} declares {proto.__name__} but does not define `{name}` "
                    f"(the protocol's stub would run instead)"
                )
    return problems


def unnamed_public_members(cls: type) -> list[str]:
    """Public methods and properties that no protocol on the class line names."""
    mine = declared(cls)
    named = set().union(*map(members, mine))
    owner = {name: p for p in PROTOCOLS for name in members(p)}
    problems = []
    for k in implementing(cls):
        for name, value in vars(k).items():
            if name.startswith("_") or name in named or not is_method(value):
                continue
            close = difflib.get_close_matches(name, owner, n=1)
            hint = (
                f"it is {owner[name].__name__}'s: declare that capability"
                if name in owner
                else f"a misspelt {close[0]!r}?"
                if close
                else "a helper: give it a leading '_'"
            )
            problems.append(
                f"{cls.__name__}.{name} is public but no protocol it declares names it "
                f"(declared: {', '.join(p.__name__ for p in mine)}): {hint}"
            )
    return problems


def isinstance_disagreements(instance) -> list[str]:
    """Protocols that `isinstance` (what the controller and learner test) answers differently
    from the class line: an undeclared capability that happens to match structurally included."""
    cls, mine = type(instance), declared(type(instance))
    return [
        f"{cls.__name__}: isinstance(algorithm, {p.__name__}) is {isinstance(instance, p)}, but the class line "
        f"{'declares' if p in mine else 'does not declare'} it"
        for p in PROTOCOLS
        if is_protocol(p) and isinstance(instance, p) != (p in mine)
    ]


def contract_problems(cls: type) -> list[str]:
    instance = cls(cls.Config())
    return undefined_members(cls, instance) + unnamed_public_members(cls) + isinstance_disagreements(instance)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_the_class_line_declares_what_the_class_defines(name):
    problems = contract_problems(get_algorithm(name))
    assert not problems, "\n".join(problems)


# ---- planted violations: the checks above report each --------------------------------------
class Planted(Algorithm):
    """A minimal correct algorithm the planted ones extend (no implementation inheritance
    between real algorithms; here it only keeps each plant to its one fault)."""

    name, Config, needs_value_head = "planted", AlgorithmConfig, False

    def __init__(self, config=None):
        self.config = config

    def rollout(self, ctx, prompts):
        raise NotImplementedError

    def prepare(self, table):
        raise NotImplementedError

    def loss(self, outputs, batch):
        raise NotImplementedError


class MisspeltHook(Planted, ReportsPrepareMetrics):
    def prepare_metric(self, table):  # prepare_metrics: never called
        return {}


class UndeclaredCapability(Planted):
    def gradient_rows(self, batch):  # SkipsRowsWithoutGradient not on the class line
        return torch.ones(len(batch), dtype=torch.bool)


class HalfStateful(Planted, Stateful):
    def state(self):
        return {}


class DuckTyped:  # every required member, but Algorithm not on the class line
    name, Config, needs_value_head = "duck", AlgorithmConfig, False

    def __init__(self, config=None):
        pass

    def rollout(self, ctx, prompts):
        raise NotImplementedError

    def prepare(self, table):
        raise NotImplementedError

    def loss(self, outputs, batch):
        raise NotImplementedError


class NoLoss(Algorithm):
    name, Config, needs_value_head = "no_loss", AlgorithmConfig, False

    def __init__(self, config=None):
        pass

    def rollout(self, ctx, prompts):
        raise NotImplementedError

    def prepare(self, table):
        raise NotImplementedError


@pytest.mark.parametrize(
    "cls, expected",
    [
        (Planted, []),
        (
            MisspeltHook,
            [
                "declares ReportsPrepareMetrics but does not define `prepare_metrics`",
                "MisspeltHook.prepare_metric is public",
                "a misspelt 'prepare_metrics'?",
            ],
        ),
        (
            UndeclaredCapability,
            [
                "UndeclaredCapability.gradient_rows is public",
                "declared: Algorithm",
                "SkipsRowsWithoutGradient's: declare that capability",
                "isinstance(algorithm, SkipsRowsWithoutGradient) is True, but the class line does not",
            ],
        ),
        (HalfStateful, ["declares Stateful but does not define `load_state`"]),
        (NoLoss, ["declares Algorithm but does not define `loss`"]),
        (
            DuckTyped,
            [
                "DuckTyped does not subclass Algorithm",
                "isinstance(algorithm, Algorithm) is True, but the class line does not declare it",
            ],
        ),
    ],
)
def test_a_planted_violation_is_reported(cls, expected):
    report = "\n".join(contract_problems(cls))
    assert bool(report) == bool(expected), report
    for words in expected:
        assert words in report, report


# ---- dynamic: one step of every algorithm on real tiny models ------------------------------
SPEC = TinyModelSpec(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=1024,
)  # 1024: HumanEval prompts
SMALL = ["task.num_train=24", "task.num_eval=4", "rollout.max_new_tokens=4"]
CASES = {  # each algorithm's own config, shrunk so one step takes about a second
    "grpo": ("configs/quickstart.yaml", [*SMALL, "algorithm.group_size=2"]),
    "ppo": ("configs/quickstart.yaml", [*SMALL, "algorithm.name=ppo", "algorithm.group_size=2"]),
    "gspo": ("configs/quickstart.yaml", [*SMALL, "algorithm.name=gspo", "algorithm.group_size=2"]),
    "cispo": ("configs/quickstart.yaml", [*SMALL, "algorithm.name=cispo", "algorithm.group_size=2"]),
    "rloo": ("configs/quickstart.yaml", [*SMALL, "algorithm.name=rloo", "algorithm.group_size=2"]),
    "rloo_clipped": ("configs/quickstart.yaml", [*SMALL, "algorithm.name=rloo_clipped", "algorithm.group_size=2"]),
    "reinforce_pp": ("configs/quickstart.yaml", [*SMALL, "algorithm.name=reinforce_pp", "algorithm.group_size=2"]),
    "dapo": ("configs/quickstart.yaml", [*SMALL, "algorithm.name=dapo", "algorithm.group_size=2"]),
    "vineppo": ("configs/vineppo.yaml", [*SMALL, "algorithm.group_size=2", "algorithm.mc_rollouts=2"]),
    "pilaf": ("configs/pilaf.yaml", [*SMALL, "algorithm.interpolated_fraction=1.0"]),  # the interpolated sampler
    "ampo": ("configs/ampo.yaml", [*SMALL, "algorithm.num_samples=3", "algorithm.subset_size=2"]),
    "distill": ("configs/distill.yaml", [*SMALL]),
    "opd": ("configs/opd.yaml", [*SMALL, "algorithm.group_size=2"]),
    "cdg": (
        "configs/cdg.yaml",
        [
            *SMALL,
            "algorithm.models=prover_critic",  # two trained policies
            "algorithm.solutions=2",
            "algorithm.critiques=1",
            "algorithm.finals=1",
        ],
    ),
    "brite": (
        "configs/brite.yaml",
        [*SMALL, "algorithm.group_size=2", "algorithm.rationale_tokens=3", "algorithm.answer_tokens=2"],
    ),
    "rlef": (
        "configs/rlef.yaml",
        ["rollout.max_new_tokens=8", "algorithm.samples_per_prompt=1", "algorithm.max_turns=2"],
    ),
}


class FakeContext:
    """The full RolloutContext in-process, on real tiny models and the workers' own code: the
    rollout worker's HFBackend per policy, the reward worker (rule rewards from the task), a
    ReferenceWorker for the reference and one for the teacher, the learner's per-token forward
    for policy logprobs and values, and for code tasks the plain subprocess sandbox backend."""

    def __init__(self, cfg, task, tokenizer, modules: dict, model_dirs: dict[str, Path]):
        from actors.reference import ReferenceWorker
        from actors.reward import RewardWorker
        from actors.rollout import HFBackend

        self.cfg, self.task, self.tokenizer, self.policy_version = cfg, task, tokenizer, 0
        self.episodes = None  # single-turn rollouts (multi-turn episodes: tests/algorithms/test_episodes.py)
        self.episode_tokens = cfg.env.max_tokens or cfg.model.max_position_embeddings  # the controller's rule
        self.modules, self.main = modules, next(iter(modules))
        self.temperature = cfg.rollout.temperature or 1.0  # the learner's and the reference's (controller's rule)
        self.reference = ReferenceWorker(str(model_dirs["reference"]), self.temperature)
        self.teacher = ReferenceWorker(str(model_dirs["teacher"]), self.temperature)
        self.reward = RewardWorker(str(model_dirs["reference"]), task)
        self.backends = {
            name: HFBackend(None, model=m.policy, reference=self.reference.model) for name, m in modules.items()
        }
        # The code task's episodes run the policy's code. The policy is an untrained 2-layer
        # model whose text almost never parses as Python; what does parse runs in the plain
        # subprocess backend (NOT a sandbox), as tests/algorithms/test_rlef.py's state-machine tests do.
        self.sandbox = None
        if getattr(task, "needs_sandbox", False):
            from sandbox import make_backend

            self.sandbox = make_backend("subprocess-unsafe")
        self.rng = torch.Generator().manual_seed(0)

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    def sampling(self, **overrides):
        from rlsys.generation import SamplingParams

        r = self.cfg.rollout
        base = SamplingParams(
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            stop_token_ids=(self.tokenizer.eos_token_id,),
        )
        return dataclasses.replace(base, **overrides)

    def next_seed(self) -> int:
        return int(torch.randint(0, 2**31 - 1, (1,), generator=self.rng))

    def more_prompts(self, n: int) -> list[Prompt]:
        """The task's training rows after the ones handed out so far, as the controller's stream does."""
        rows = self.task.rows("train")
        self.handed_out = getattr(self, "handed_out", 2)  # one_step_setup's prompts are the first two
        start, self.handed_out = self.handed_out, self.handed_out + n
        return [prompt_of(self.tokenizer, self.task, f"p{i}", rows[i % len(rows)]) for i in range(start, start + n)]

    def generate(self, requests, policy=None):
        return self.backends[policy or self.main].generate(requests)

    def generate_each(self, requests_by_policy):
        return {policy: self.backends[policy].generate(requests) for policy, requests in requests_by_policy.items()}

    def score(self, table):
        """The task's rule reward, plus a tie-breaker below any reward step (row i gets i % 5
        thousandths): an untrained model's rewards are all equal, and equal rewards give
        group-relative losses (GRPO, RLOO, a DPO pair, an AMPO group) no gradient."""
        return [r + 1e-3 * (i % 5) for i, r in enumerate(self.reward.score(table))]

    def token_rewards(self, table):
        if not getattr(self.task, "shaping", None):
            return None
        return self.reward.take_token_rewards(table.column("uid").to_pylist())

    def ref_logprobs(self, table):
        return self.reference.logprobs(table)

    def score_and_ref_logprobs(self, table):
        return self.score(table), self.ref_logprobs(table)

    def values(self, table, policy=None):
        return self._per_response(self.modules[policy or self.main], table, output=2)

    def policy_logprobs(self, table):
        return self._per_response(self.modules[self.main], table, output=1)

    def anchor_reference(self) -> None:
        from actors.modeling import state_dict_numpy

        self.reference.load_weights(state_dict_numpy(self.modules[self.main].policy))

    def teacher_logprobs(self, table):
        return self.teacher.logprobs(table)

    def teacher_top_logprobs(self, table, k=0):
        return self.teacher.top_logprobs(table, k)

    def execute(self, requests):
        return [self.sandbox.run(r) for r in requests]

    def _per_response(self, module, table, output: int):
        """The learner's `_per_response`: output 1 (logprobs) or 2 (values) of its forward at each response token."""
        from actors.modeling import PolicyWithValueHead, per_response_tokens

        assert output == 1 or isinstance(module, PolicyWithValueHead), "values of a policy without a value head"
        module.eval()
        return per_response_tokens(
            lambda ids, mask, span, packed: module(ids, mask, self.temperature, span, packed)[output], table
        )


class ProtocolView:
    """The context as the algorithm is handed it: RolloutContext's members. A name the protocol
    does not have is still served (so the step runs on) and recorded in `outside`."""

    def __init__(self, ctx: FakeContext):
        self._ctx, self.outside = ctx, set()

    def __getattr__(self, name: str):  # only for names not set on the view itself
        if name not in members(RolloutContext) and not name.startswith("__"):
            self.outside.add(name)
        return getattr(self._ctx, name)


def one_step_setup(name: str, tmp_path: Path):
    """(algorithm, context, 2 prompts) for CASES[name]: the task and a tokenizer trained on it
    as the controller builds them, a 2-layer policy (with a value head when the algorithm needs
    one; several trained policies share it), a reference and a teacher of other seeds (so the
    policy differs from its KL anchor, as after a few updates: a KL term has a gradient)."""
    from actors.modeling import PolicyOnly, PolicyWithValueHead
    from envs.registry import make_task
    from rlsys.config import load_config

    path, overrides = CASES[name]
    cfg = load_config(path, overrides)
    algo = build_algorithm(cfg)
    task = make_task(cfg.task, tmp_path / "data", cfg.run.seed)
    tokenizer = train_tokenizer(task.corpus(), cfg.model.vocab_size)
    policy = build_tiny_model(SPEC, tokenizer, seed=0)
    module = PolicyWithValueHead(policy) if algo.needs_value_head else PolicyOnly(policy)
    dirs = {
        role: save_model_dir(build_tiny_model(SPEC, tokenizer, seed=seed), tokenizer, tmp_path / role)
        for role, seed in (("reference", 1), ("teacher", 2))
    }
    ctx = FakeContext(cfg, task, tokenizer, {p: module for p in policy_names(algo)}, dirs)
    prompts = [prompt_of(tokenizer, task, f"p{i}", r) for i, r in enumerate(task.rows("train")[:2])]
    return algo, ctx, prompts


def prompt_of(tokenizer, task, uid: str, row: dict) -> Prompt:
    return Prompt(
        uid, tokenizer(task.prompt_text(row), add_special_tokens=False)["input_ids"], task.prompt_text(row), row
    )


def train_on(algo, module, batch, temperature: float):
    """One minibatch as actors/learner.py trains it: rows without gradient left out, the
    forward (scaled logits, target logprobs [B, L-1], values), the loss, backward."""
    from actors.modeling import PolicyWithValueHead

    mb = batch.trim()
    if isinstance(algo, SkipsRowsWithoutGradient):
        keep = algo.gradient_rows(mb)
        assert keep.dtype == torch.bool and keep.shape == (len(mb),), keep
        assert bool(keep.any()), "gradient_rows keeps no row: the step would train nothing"
        mb = mb.select(keep).trim()
    module.train()
    module.zero_grad(set_to_none=True)
    logits, logprobs, values = module(mb.input_ids, mb.attention_mask, temperature, mb.response_mask)
    assert (values is not None) == isinstance(module, PolicyWithValueHead)
    loss, metrics = algo.loss(ModelOutputs(logits, logprobs, values), mb)
    loss.backward()
    return loss, metrics


def check_prepare_hooks(algo, table) -> None:
    """The hooks the loop calls on a step's rows beside `prepare`."""
    if isinstance(algo, ReportsPrepareMetrics):
        metrics = algo.prepare_metrics(table)
        assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values()), metrics
    if isinstance(algo, RestartsPolicy):
        assert isinstance(algo.restarts_policy(table), bool)


def assert_trains(algo, module, batch, temperature: float, where: str) -> None:
    loss, metrics = train_on(algo, module, batch, temperature)
    assert loss.dim() == 0 and torch.isfinite(loss), f"{where}: loss {loss}"
    assert all(math.isfinite(v) for v in metrics.values()), f"{where}: metrics {metrics}"
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    assert any(bool(g.abs().sum() > 0) for g in grads), f"{where}: no parameter got a gradient"


def assert_packs_exactly(algo, module, batch, temperature: float, where: str) -> None:
    """The learner's packed micro-batches (learner.max_tokens_per_microbatch; here each prompt
    group alone), each loss weighted by its `loss_denominator` over the minibatch's, give the
    minibatch's padded loss and gradients: the weighting matches how the loss averages (the first
    row is cut to one response token, so that weighting by tokens would not do for a loss that
    averages over rows or pairs)."""
    from actors.learner import micro_batch_weights
    from rlsys.packing import microbatches

    if isinstance(algo, UnpackedOnly):
        return  # refused with learner.max_tokens_per_microbatch (tests/floor/test_config.py)
    mb = batch.trim()
    mb.response_mask = mb.response_mask.clone()
    first_row = mb.response_mask[0].nonzero().flatten()
    mb.response_mask[0, first_row[1:]] = 0  # the first row one token long: the groups' tokens differ
    parts = microbatches(mb, 1)
    if len(parts) < 2:
        return
    params = [p for p in module.parameters() if p.requires_grad]

    def loss_and_grads(part, packed):
        logits, logprobs, values = module(part.input_ids, part.attention_mask, temperature, part.response_mask, packed)
        loss = algo.loss(ModelOutputs(logits, logprobs, values), part)[0]
        return loss.item(), torch.autograd.grad(loss, params, allow_unused=True)

    module.train()
    whole, want = loss_and_grads(mb, False)
    total, got = 0.0, [torch.zeros_like(p) for p in params]
    for part, weight in zip(parts, micro_batch_weights(parts, functools.partial(loss_denominator, algo), mb)):
        loss, grads = loss_and_grads(part, True)
        total += weight * loss
        for acc, g in zip(got, grads):
            if g is not None:
                acc += weight * g
    assert total == pytest.approx(whole, rel=1e-4, abs=1e-6), f"{where}: packed loss {total} vs {whole}"
    for p, a, b in zip(params, want, got):
        a = torch.zeros_like(p) if a is None else a
        assert torch.allclose(a, b, rtol=1e-3, atol=1e-6), f"{where}: packed gradients differ"


@pytest.mark.parametrize("name", ALGORITHMS)
def test_one_step_in_process(name, tmp_path):
    """rollout -> prepare -> loss -> backward as rlsys/run/loop.py orders them, on real models."""
    assert name in CASES, f"algorithm '{name}' has no small config in tests/architecture/test_contract.py's CASES"
    algo, fake, prompts = one_step_setup(name, tmp_path)
    ctx = ProtocolView(fake)
    assert isinstance(fake, RolloutContext) and isinstance(ctx, RolloutContext)
    try:
        # sample
        table = algo.rollout(ctx, prompts)
        assert table.num_rows > 0
        # prepare: a batch per trained policy (None: no update for it this step)
        per_policy = algo.split_by_policy(table) if isinstance(algo, TrainsSeveralPolicies) else {fake.main: table}
        assert set(per_policy) <= set(fake.modules), f"rows for unknown policies: {sorted(per_policy)}"
        batches = {policy: algo.prepare(rows) for policy, rows in per_policy.items()}
        check_prepare_hooks(algo, table)
        batches = {policy: b for policy, b in batches.items() if b is not None}
        assert batches, f"{name}: the first step trains nothing; give CASES a config whose first step does"
        # train: loss -> backward on each policy's module
        for policy, batch in batches.items():
            assert_trains(algo, fake.modules[policy], batch, fake.temperature, f"{name}/{policy}")
            assert_packs_exactly(algo, fake.modules[policy], batch, fake.temperature, f"{name}/{policy}")
        # the optional parts the controller calls outside a step
        if isinstance(algo, EvaluatesItself):
            metrics = algo.evaluate(ctx, prompts, ctx.sampling(n=1, temperature=0.0, seed=1))
            assert 0.0 <= metrics["accuracy"] <= 1.0, metrics
        if isinstance(algo, Stateful):
            type(algo)(algo.config).load_state(copy.deepcopy(algo.state()))
    finally:
        fake.close()
    assert not ctx.outside, (
        f"{name} uses ctx.{', ctx.'.join(sorted(ctx.outside))}, which RolloutContext (rlsys/contract.py) does not name"
    )
