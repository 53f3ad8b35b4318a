"""Evaluators attached to a running job: a spec, its own Ray actor, a named registry.

`rlsys eval attach RUN_OR_JOB SPEC.yaml` finds the run's cluster through
`runs/<name>/cluster.json` (written by the controller at start-up) and adds the spec to the
run's `EvalRegistry`, a named actor `rlsys-evals-<run name>` in the `rlsys` namespace. The
controller polls the registry at each step boundary (`AttachedEvaluators.poll`): each spec
gets an `EvaluatorWorker` actor with its own copy of the policy; at every `every`-th step it
is handed the newest synced weights ref and the step, without waiting; results are
collected at later boundaries and logged to evals.jsonl / TensorBoard `eval/<name>/...`
with the policy version they were computed on.

In a multi-turn run (`env.name`) an evaluator plays the run's episodes (`EvalEpisodes`: its env
section and token budget; its own env instances and, for the python tool, its own one-worker
sandbox pool): `n` episodes per prompt, each final answer (or, for an env that grades itself, its
last turn) scored by the spec's metric, with the episodes' `episode/*` and `tools/*` rates beside.

No `import ray` at module level: the CLI sets Ray's auth environment first.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rlsys import jobs
from rlsys.config import ConfigError
from rlsys.generation import GenerationRequest, SamplingParams

NAMESPACE = "rlsys"
MODEL_METRICS = ("reward_model", "judge")  # scored by a model: mean reward-model score, mean judge score in [0, 1]
MAX_PENDING = 4  # evaluations in flight per evaluator; one further behind skips steps rather than queue


class EvaluatorSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    split: Literal["train", "eval"] = "eval"
    dataset: Optional[str] = Field(None, description="jsonl/parquet of {prompt, answer}; replaces split")
    metric: str = Field(
        "accuracy", description="'accuracy', 'reward_model', 'judge' or 'module:function' (row, response_text) -> float"
    )
    reward_model: Optional[str] = Field(
        None, validate_default=True, description="reward model dir, metric reward_model"
    )
    judge: Optional[str] = Field(None, validate_default=True, description="judge model dir, metric judge (pointwise)")
    temperature: float = Field(0.0, ge=0, description="0 is greedy")
    n: int = Field(1, ge=1, le=64, description="samples per prompt")
    max_new_tokens: Optional[int] = Field(None, ge=1, le=4096)
    limit: Optional[int] = Field(None, ge=1, description="first N prompts only")
    every: int = Field(1, ge=1, description="evaluate every N steps")
    seed: int = 0

    @field_validator("name")
    @classmethod
    def _not_builtin(cls, v):
        if v == "heldout":
            raise ValueError("is the built-in evaluator's name; pick another")
        return v

    @field_validator("dataset")
    @classmethod
    def _dataset_file(cls, v):
        if v is not None and not Path(v).is_file():
            raise ValueError("no such file")
        if v is not None and Path(v).suffix not in (".jsonl", ".json", ".parquet"):
            raise ValueError("must be .jsonl or .parquet")
        return v

    @field_validator("metric")
    @classmethod
    def _metric_importable(cls, v):
        if v not in MODEL_METRICS and v != "accuracy":
            resolve_metric(v)
        return v

    @field_validator("reward_model", "judge")
    @classmethod
    def _model_dir(cls, v, info):
        if info.data.get("metric") == info.field_name and v is None:
            raise ValueError(f"is required by metric '{info.field_name}' (a model directory)")
        if v is not None and info.data.get("metric") != info.field_name:
            raise ValueError(f"is used by metric '{info.field_name}' only")
        if v is not None and not (Path(v) / "config.json").is_file():
            raise ValueError("is not a model directory (no config.json)")
        return v

    @property
    def metric_key(self) -> str:
        return self.metric if self.metric == "accuracy" or self.metric in MODEL_METRICS else self.metric.split(":")[1]


def resolve_metric(path: str):
    """`module:function` -> the function; ValueError (one line) otherwise."""
    module, _, fn = path.partition(":")
    if not module or not fn.isidentifier():
        raise ValueError("must be 'accuracy' or an import path 'module:function' (or 'reward_model', 'judge')")
    try:
        obj = getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import ({type(e).__name__}: {e})") from None
    if not callable(obj):
        raise ValueError("is not callable")
    return obj


def parse_spec(data: dict) -> EvaluatorSpec:
    try:
        return EvaluatorSpec.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            raise ConfigError(f"evaluator error: unknown key '{key}'") from None
        if err["type"] == "missing":
            raise ConfigError(f"evaluator error: '{key}' is required") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise ConfigError(f"evaluator error: {key} = {err.get('input')!r}: {msg}") from None


def load_spec(path: str | None = None, flags: dict | None = None) -> EvaluatorSpec:
    """A spec from a YAML file, CLI flags (set ones override the file), or both."""
    data: dict = {}
    if path:
        if not Path(path).is_file():
            raise ConfigError(f"evaluator error: file {path} does not exist")
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError:
            raise ConfigError(f"evaluator error: {path} is not valid YAML") from None
        if not isinstance(data, dict):
            raise ConfigError(f"evaluator error: {path} must hold a mapping of spec keys")
    data.update({k: v for k, v in (flags or {}).items() if v is not None})
    return parse_spec(data)


# ---- actors -------------------------------------------------------------------------------
class EvalRegistry:
    """The run's attached specs (name -> spec dict); a named actor the CLI talks to."""

    def __init__(self, specs: list[dict], owner_pid: int = 0):
        self.specs = {s["name"]: s for s in specs}
        self.owner_pid = owner_pid  # the controller's process

    def owner(self) -> int:
        return self.owner_pid

    def attach(self, spec: dict) -> bool:
        replaced = spec["name"] in self.specs
        self.specs[spec["name"]] = spec
        return replaced

    def detach(self, name: str) -> bool:
        return self.specs.pop(name, None) is not None

    def list(self) -> list[dict]:
        return list(self.specs.values())

    def restore(self, specs: list[dict]) -> None:
        """A resumed run's checkpointed specs; one attached meanwhile under the same name wins."""
        for spec in specs:
            self.specs.setdefault(spec["name"], spec)


@dataclass(frozen=True)
class EvalEpisodes:
    """How an evaluator plays a multi-turn run's episodes in its own process: the run's `env`
    section (rlsys.config.EnvConfig) and the episode token budget the run uses, or an `algorithm`
    that plays its own (HasOwnEpisodes: RLEF); and when the episodes run code, the run's sandbox
    backend and limits (sandbox.types.Limits; None otherwise)."""

    env: Any = None
    max_tokens: int = 0
    sandbox_backend: str | None = None
    limits: Any = None
    algorithm: Any = None


class EvaluatorWorker:
    """One evaluator: its own policy copy (hf backend), the prompts (the run's: `prompt_ids`), the
    metric, in a multi-turn run the episodes' settings (`episodes`), and `run_reward`: the run's
    reward worker when it scores with a reward function or server (what `accuracy` then counts)."""

    def __init__(
        self,
        policy_dir: str,
        spec: dict,
        task,
        max_new_tokens: int,
        episodes: EvalEpisodes | None = None,
        run_reward=None,
    ):
        import torch

        from actors.rollout import RolloutWorker  # actor code (torch): only the evaluator worker loads it
        from envs.datasets import read_rows  # task data (pyarrow): only the worker reads rows
        from rlsys.models import load_tokenizer  # torch: as above
        from rlsys.prompts import prompt_ids  # tokenizers: as above

        torch.set_num_threads(1)
        self.spec, self.task = EvaluatorSpec.model_validate(spec), task
        self.worker = RolloutWorker(policy_dir, "hf")
        self.tokenizer = load_tokenizer(policy_dir)
        s = self.spec
        rows = read_rows(s.dataset, required=("prompt", "answer")) if s.dataset else task.rows(s.split)
        self.rows = rows[: s.limit]
        self.prompt_ids = [prompt_ids(task, self.tokenizer, r)[0] for r in self.rows]  # as the run's prompts
        self.sandbox, self.episodes, self.run_reward = None, None, run_reward
        if episodes is not None:
            self.episodes = self._episode_settings(episodes)
        self.score = (
            task.is_correct
            if s.metric == "accuracy"
            else None
            if s.metric in MODEL_METRICS
            else resolve_metric(s.metric)
        )
        if s.metric == "reward_model":
            from actors.reward import RewardModel  # actor code: only the evaluator worker loads it

            self.reward_model = RewardModel(s.reward_model, tokenizer=self.tokenizer)
        elif s.metric == "judge":
            from actors.judge import JudgeWorker  # actor code: only the evaluator worker loads it

            self.judge = JudgeWorker(s.judge, options={"seed": s.seed})
        self.max_new_tokens = s.max_new_tokens or max_new_tokens

    def _episode_settings(self, episodes: EvalEpisodes):
        """The run's episodes over this worker's own envs (and sandbox pool, made at the first run):
        `env.name`'s, or those of an algorithm that plays its own."""
        from algorithms.episodes import EpisodeSettings  # actor code: only the evaluator worker loads it
        from envs.registry import make_env_factory  # the env classes and tools: only a multi-turn evaluator

        self.sandbox_backend = episodes.sandbox_backend
        if episodes.algorithm is not None:
            return episodes.algorithm.episode_settings(
                self.tokenizer, self.task, self._run_sandboxed, episodes.max_tokens
            )
        factory = make_env_factory(episodes.env, self.task, run=self._run_sandboxed, limits=episodes.limits)
        env = episodes.env
        return EpisodeSettings.for_tokenizer(
            self.tokenizer,
            factory.make,
            env.max_turns,
            episodes.max_tokens,
            factory.tool_schemas,
            lockstep=env.lockstep,
        )

    def _run_sandboxed(self, requests):
        """The python tool's runs, in this evaluator's own one-worker sandbox pool."""
        if self.sandbox is None:
            from sandbox.pool import SandboxPool  # actor code: only an evaluator whose env runs code

            self.sandbox = SandboxPool(self.sandbox_backend, workers=1)
        return self.sandbox.run_many(list(requests))

    def generate(self, requests):
        """The policy's generations (what the multi-turn rollout asks of its context)."""
        return self.worker.generate(requests)

    def evaluate(self, version: int, weights) -> dict:
        import numpy as np

        if weights is not None and version != self.worker.version:
            self.worker.load_weights(version, weights)
        s = self.spec
        params = SamplingParams(
            n=s.n,
            max_new_tokens=self.max_new_tokens,
            temperature=s.temperature,
            seed=s.seed,
            stop_token_ids=(self.tokenizer.eos_token_id,),
        )
        episodes = None
        if self.episodes is not None:
            episodes, row_index, texts, env_correct = self._play(params)
        else:
            gens = self.worker.generate([GenerationRequest(p, params) for p in self.prompt_ids])
            row_index = [g.request_index for g in gens]
            texts = self.tokenizer.batch_decode([g.response_ids for g in gens], skip_special_tokens=True)
            env_correct = [None] * len(texts)
        if s.metric in MODEL_METRICS:
            out = self.model_metric(row_index, texts)
        else:
            scores, out = self._scores(row_index, texts)
            scores = np.array([x if graded is None else float(graded) for x, graded in zip(scores, env_correct)])
            out = {s.metric_key: float(scores.mean()), **out, "n": float(len(self.rows))}
            if s.n > 1:  # a prompt passes when any of its n samples scores 1
                passed = {i for i, x in zip(row_index, scores) if x >= 1.0}
                out[f"pass@{s.n}"] = len(passed) / len(self.rows)
            for e, x in zip(episodes or [], scores):  # the episodes' correct share follows the metric
                e.correct = x >= 1.0
        if episodes is not None:
            from algorithms.episodes import summary_metrics  # actor code: only the evaluator worker loads it

            out |= summary_metrics([e.summary() for e in episodes])
        return {"policy_version": self.worker.version, "metrics": out}

    def _scores(self, row_index: list[int], texts: list[str]):
        """(score per response, extra metrics) by the spec's metric: `accuracy` is the run's reward
        >= 1 where the run scores with a reward function or server (its reward worker's held-out
        rewards, their mean beside), as the run's own held-out evaluation counts it, else the task's
        `is_correct`; a metric function's value otherwise."""
        import numpy as np

        rows = [self.rows[i] for i in row_index]
        if self.spec.metric == "accuracy" and self.run_reward is not None:
            call = self.run_reward.heldout_rewards
            if hasattr(call, "remote"):  # the run's reward actor (in-process: the worker itself)
                import ray

                rewards = np.asarray(ray.get(call.remote(texts, rows)), dtype=np.float64)
            else:
                rewards = np.asarray(call(texts, rows), dtype=np.float64)
            return (rewards >= 1.0).astype(np.float64), {"reward": float(rewards.mean())}
        return np.array([float(self.score(r, t)) for r, t in zip(rows, texts)]), {}

    def _play(self, params: SamplingParams) -> tuple[list, list[int], list[str], list]:
        """n episodes per prompt: (the episodes, the row of each, the text its metric scores: the
        final answer, or the last policy turn where the env grades itself, and the env's verdict
        there: None where the metric decides)."""
        from algorithms.episodes import play_episodes  # actor code: only the evaluator worker loads it
        from rlsys.contract import Prompt  # torch and pyarrow: only the evaluator worker

        prompts = [
            Prompt(f"{self.spec.name}-{i}", ids, "", r) for i, (ids, r) in enumerate(zip(self.prompt_ids, self.rows))
        ]
        episodes = play_episodes(self, prompts, self.spec.n, params)
        texts, env_correct = [], []
        for e in episodes:
            if isinstance(e.answer, str):
                texts.append(e.answer)
                env_correct.append(None)
            else:
                start, end = e.conversation.policy_turns[-1]
                texts.append(self.tokenizer.decode(e.conversation.ids[start:end], skip_special_tokens=True))
                env_correct.append(None if e.correct is None else bool(e.correct))
        return episodes, [i for i in range(len(prompts)) for _ in range(self.spec.n)], texts, env_correct

    def model_metric(self, row_index: list[int], texts: list[str]) -> dict:
        """Mean reward-model score, or mean pointwise judge score in [0, 1] over the parsable
        verdicts with the unparsable share beside it (absent when none parsed: no silent score)."""
        import numpy as np

        from actors.judge import score_reward  # actor code: only the evaluator worker loads it

        prompts = [self.task.prompt_text(self.rows[i]) for i in row_index]
        out = {"n": float(len(self.rows))}
        if self.spec.metric == "reward_model":
            out["reward_model"] = float(np.mean(self.reward_model.score_texts(prompts, texts)))
            return out
        o = self.judge.options
        judged = self.judge.pointwise(list(zip(prompts, texts)))
        parsed = [score_reward(j.score, o.min_score, o.max_score, 0.0) for j in judged if j.score is not None]
        out["judge_unparsable"] = 1.0 - len(parsed) / len(judged)
        if parsed:
            out["judge"] = float(np.mean(parsed))
        return out


def _drop_stale_registry(name: str, run_name: str) -> None:
    """A registry left by an earlier run of this process (one that raised) is replaced; one of
    another live controller is an error: two runs of one name would share a registry."""
    import time

    import ray

    try:
        stale = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return
    if ray.get(stale.owner.remote()) != os.getpid():
        raise ConfigError(f"evaluator error: a run named {run_name} is already live on this cluster ({name})")
    ray.kill(stale)
    for _ in range(100):  # the name is released shortly after the kill
        try:
            ray.get_actor(name, namespace=NAMESPACE)
            time.sleep(0.05)
        except ValueError:
            return


def registry_name(run_name: str) -> str:
    return f"rlsys-evals-{run_name}"


class AttachedEvaluators:
    """The controller's side: the registry actor, one EvaluatorWorker per attached spec and
    the evaluations in flight. `poll` is the bounded hand-off done at each step boundary."""

    def __init__(self, run_name: str, resources: dict | None = None):
        """The registry, up from start-up on, so specs can be attached while the run warms up.
        `resources`: the custom Ray resources the evaluators ask for (placement.services)."""
        import ray

        name = registry_name(run_name)
        _drop_stale_registry(name, run_name)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.pinned = {"resources": resources} if resources else {}
        beside_driver = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.registry = (  # bookkeeping only: on the controller's node, which the run cannot outlive anyway
            ray.remote(EvalRegistry)
            .options(name=name, namespace=NAMESPACE, num_cpus=0, scheduling_strategy=beside_driver)
            .remote([], os.getpid())
        )
        self.active: dict[str, tuple[dict, object]] = {}  # name -> (spec, worker actor)
        self.pending: list[tuple[str, int, object]] = []  # (name, step, future)

    def start(
        self,
        policy_dir: Path,
        task,
        max_new_tokens: int,
        restored: list[dict] = (),
        episodes: EvalEpisodes | None = None,
        run_reward=None,
    ) -> None:
        """Once the policy and task exist; `restored`: the specs of the checkpoint resumed from;
        `episodes`: a multi-turn run's, which its evaluators play; `run_reward`: the run's reward
        actor where it scores with a reward function or server (`accuracy` follows it)."""
        import ray

        self.policy_dir, self.task, self.max_new_tokens = str(policy_dir), task, max_new_tokens
        self.episodes, self.run_reward = episodes, run_reward
        ray.get(self.registry.restore.remote(list(restored)))

    def specs(self) -> list[dict]:
        return [spec for spec, _ in self.active.values()]

    def _sync(self, wanted: list[dict]) -> None:
        import ray

        wanted_by_name = {s["name"]: s for s in wanted}
        for name, (spec, actor) in list(self.active.items()):
            if wanted_by_name.get(name) != spec:  # detached or replaced: its results stop here
                ray.kill(actor)
                del self.active[name]
                self.pending = [p for p in self.pending if p[0] != name]
        for name, spec in wanted_by_name.items():
            if name not in self.active:
                actor = (
                    ray.remote(EvaluatorWorker)
                    .options(num_cpus=0.25, **self.pinned)
                    .remote(self.policy_dir, spec, self.task, self.max_new_tokens, self.episodes, self.run_reward)
                )
                self.active[name] = (spec, actor)

    def _collect(self, timeout: float) -> list[tuple]:
        """(step, name, metrics, policy version) of the evaluations finished within `timeout`."""
        import ray

        if not self.pending:
            return []
        futures = [f for _, _, f in self.pending]
        done, _ = ray.wait(futures, num_returns=len(futures), timeout=timeout)
        done = set(done)
        rows, keep = [], []
        for name, step, fut in self.pending:
            if fut not in done:
                keep.append((name, step, fut))
                continue
            try:
                result = ray.get(fut)
                rows.append((step, name, result["metrics"], result["policy_version"]))
            except Exception as e:  # a broken evaluator must not stop training
                print(
                    f"rlsys: evaluator {name} failed at step {step}: {str(e).strip().splitlines()[-1][:300]}",
                    file=sys.stderr,
                )
        self.pending = keep
        return rows

    def due(self, step: int) -> bool:
        """Whether an attached evaluator evaluates at `step` (as known before this step's `poll`)."""
        return any(step % spec["every"] == 0 for spec, _ in self.active.values())

    def poll(self, step: int, version: int, weights, timeout: float = 5.0) -> list[tuple]:
        """Pick up attach/detach, collect finished results, hand off this step's evaluations.
        `weights()`: the policy's weights (an object ref), asked for only when an evaluation is due;
        None: this step's weights are not to be had (the learner trains the next step, queued while no
        evaluator was due), so an evaluator attached in this poll is handed its first evaluation later."""
        import ray

        try:
            self._sync(ray.get(self.registry.list.remote(), timeout=timeout))
        except ray.exceptions.GetTimeoutError:  # a busy machine: keep the evaluators as they are
            print(f"rlsys: evaluator registry did not answer within {timeout:.0f} s at step {step}", file=sys.stderr)
        rows = self._collect(timeout=0)
        weights_ref = None
        for name, (spec, actor) in self.active.items():
            if step % spec["every"] or weights is None:
                continue
            if sum(p[0] == name for p in self.pending) >= MAX_PENDING:
                print(f"rlsys: evaluator {name} is behind; skipping step {step}", file=sys.stderr)
                continue
            weights_ref = weights() if weights_ref is None else weights_ref
            self.pending.append((name, step, actor.evaluate.remote(version, weights_ref)))
        return rows

    def drain(self, timeout: float = 600.0) -> list[tuple]:
        """Wait for the evaluations in flight (before a checkpoint, at the end of a run)."""
        return self._collect(timeout)

    def close(self) -> None:
        import ray

        for _, actor in self.active.values():
            ray.kill(actor)
        ray.kill(self.registry)
        self.active, self.pending = {}, []


# ---- reaching a run from the CLI ------------------------------------------------------------
def write_cluster_info(run_dir: Path, run_name: str) -> Path:
    """runs/<name>/cluster.json: how `rlsys eval` reaches this run's cluster and registry."""
    import ray

    gcs = ray.get_runtime_context().gcs_address
    host, _, port = gcs.rpartition(":")
    local = host == ray.util.get_node_ip_address()  # the GCS on this machine: reach it on loopback
    info = {
        "address": f"127.0.0.1:{port}" if local else gcs,
        "gcs_address": gcs,
        "namespace": NAMESPACE,
        "registry": registry_name(run_name),
        "pid": os.getpid(),
        "auth_mode": os.environ.get("RAY_AUTH_MODE"),
        "auth_token_path": os.environ.get("RAY_AUTH_TOKEN_PATH"),
    }
    path = Path(run_dir) / "cluster.json"
    path.write_text(json.dumps(info, indent=1))
    return path


def cluster_info(target: str, address: str | None = None) -> dict:
    """A run dir's cluster.json, or (a job id and a dashboard address) that of the job's run dir."""
    run_dir = Path(target)
    if not run_dir.is_dir():
        if not address:
            raise ConfigError(f"evaluator error: {target} is neither a run directory nor a job id with --address")
        try:
            meta = jobs.client(address).get_job_info(target).metadata or {}
        except Exception as e:
            raise ConfigError(
                f"evaluator error: job {target} at {address}: {str(e).strip().splitlines()[-1][:200]}"
            ) from None
        if "rlsys_run_dir" not in meta:
            raise ConfigError(
                f"evaluator error: job {target} was not submitted by `rlsys submit` (no run dir recorded)"
            )
        run_dir = Path(meta["rlsys_run_dir"])
    path = run_dir / "cluster.json"
    if not path.exists():
        raise ConfigError(f"evaluator error: {run_dir} has no cluster.json (has the run started?)")
    return json.loads(path.read_text())


def connect(target: str, address: str | None = None):
    """The run's EvalRegistry actor handle (joins the run's cluster unless Ray is up)."""
    info = cluster_info(target, address)
    if "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
        for key, env in (("auth_mode", "RAY_AUTH_MODE"), ("auth_token_path", "RAY_AUTH_TOKEN_PATH")):
            if info.get(key):
                os.environ[env] = info[key]
        import ray

        try:
            ray.init(address=info["address"], namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
        except Exception as e:
            raise ConfigError(
                f"evaluator error: cannot reach the run's cluster at {info['address']} "
                f"({str(e).strip().splitlines()[-1][:200]}); is it still running?"
            ) from None
    import ray

    try:
        return ray.get_actor(info["registry"], namespace=info["namespace"])
    except ValueError:
        raise ConfigError(
            f"evaluator error: run {target} is not running (no {info['registry']} on {info['address']})"
        ) from None


def _call(target: str, address: str | None, method: str, *args):
    registry = connect(target, address)  # before `import ray`: it sets Ray's auth environment
    import ray

    return ray.get(getattr(registry, method).remote(*args))


def attach(target: str, spec: EvaluatorSpec, address: str | None = None) -> str:
    replaced = _call(target, address, "attach", spec.model_dump())
    return (
        f"{'replaced' if replaced else 'attached'} evaluator {spec.name}: "
        f"from the next step boundary, every {spec.every} steps"
    )


def detach(target: str, name: str, address: str | None = None) -> bool:
    return _call(target, address, "detach", name)


def list_specs(target: str, address: str | None = None) -> list[dict]:
    return _call(target, address, "list")


def first_char_match(row: dict, response_text: str) -> float:
    """An example user metric (`metric: rlsys.evaluators:first_char_match`): partial credit,
    1.0 when the response starts with the answer's first character."""
    answer, text = str(row["answer"]).strip(), response_text.strip()
    return float(bool(answer) and text[:1] == answer[:1])
