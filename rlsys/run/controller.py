"""The controller: builds a run (task, initial policy, actors, weight sync, rollout source) and
runs `loop.train` on it, top to bottom.

    prompts -> Algorithm.rollout (rollout workers, reward, reference) -> ExperienceBuffer
            -> Algorithm.prepare -> Learner.train_step (all ranks) -> weight sync -> log/eval
"""

from __future__ import annotations

import json
import sys
import time
import weakref
from math import comb
from pathlib import Path

import numpy as np
import ray

from actors.reference import ReferenceWorker
from algorithms.base import build_algorithm
from algorithms.episodes import EpisodeSettings, final_answers, play_episodes, summary_metrics
from algorithms.sft import warmup
from envs.dataset_task import fit_to_model
from envs.registry import make_env_factory, make_task
from envs.rewards import build_shaping
from rlsys.checkpoint import CheckpointError, candidates
from rlsys.config import ConfigError, JobConfig, dump_config
from rlsys.contract import Algorithm, EvaluatesItself, HasOwnEpisodes, HasTeacher, HasWarmupTask, Prompt
from rlsys.errors import LearnerFailed, RunFailed, WeightSyncTimeout  # noqa: F401  (re-exported for tests and users)
from rlsys.evaluators import AttachedEvaluators, EvalEpisodes, write_cluster_info
from rlsys.generation import GenerationRequest
from rlsys.models import (
    TinyModelSpec,
    build_tiny_model,
    load_model,
    load_policy_tokenizer,
    load_tokenizer,
    save_model_dir,
    train_tokenizer,
)
from rlsys.placement import placement_report, release_placement_groups, service_options
from rlsys.prompts import context_length, prompt_ids
from rlsys.run import checkpointing, loop
from rlsys.run.actors import Learners, start_actors
from rlsys.run.context import ActorContext
from rlsys.run.rollouts import AsyncRollouts, PromptStream, RolloutSource
from rlsys.run.stop import StopSignals
from rlsys.run.weight_sync import make_weight_sync
from rlsys.tracking import Tracker, read_jsonl
from sandbox.base import unavailable
from sandbox.pool import SandboxPool
from sandbox.types import Limits


class Controller:
    """One run: `run()` prepares the initial policy, starts the actors and trains to the end.
    Its parts, for the loop and for tests: `ctx` (the RolloutContext), `rollouts`, `learner_group`,
    `weights` (the weight-sync strategy), `policies` (each trained policy's actors), `attached`."""

    def __init__(self, cfg: JobConfig, run_dir: Path, progress: bool = True, algorithm: Algorithm | None = None):
        self.cfg, self.run_dir, self.progress = cfg, Path(run_dir), progress
        self.algorithm = algorithm or build_algorithm(cfg)  # config errors surface before anything starts
        build_shaping(cfg.task.shaping)  # and those of task.shaping (make_task builds it again)
        self.step = 0
        self.attached = None  # the run's AttachedEvaluators, opened by run()
        self.weights = None  # the weight-sync strategy, made by start_actors
        self.stop = StopSignals()  # the signals that stop the run, installed by run()
        self.queued = None  # trainer.mode overlap: the next step, sent to the learner behind this one (loop.QueuedStep)
        self.envs = None  # the EnvFactory of env.name (multi-turn episodes), made by prepare_policy

    # the run's policy (the first of `self.policies`): its rollout workers and learner ranks
    @property
    def workers(self) -> list:
        return self.policies[self.ctx.main_policy].workers

    @property
    def learners(self) -> list:
        return self.policies[self.ctx.main_policy].learners

    @learners.setter
    def learners(self, learners: list) -> None:
        self.policies[self.ctx.main_policy].learners = learners

    def prepare_policy(self) -> Path:
        """Tokenizer + initial policy (tiny model from config, or a local HF dir), SFT warm-up,
        saved once to run_dir/policy_init; later calls reuse it."""
        cfg = self.cfg
        self.task = make_task(cfg.task, self.run_dir / "data", cfg.run.seed)
        self._check_sandbox()
        # the envs of multi-turn episodes (env.name; None: single-turn); the python tool runs in the pool
        self.envs = make_env_factory(cfg.env, self.task, run=self._run_sandboxed, limits=self._sandbox_limits())
        init_dir = self.run_dir / "policy_init"
        if (init_dir / "config.json").exists():
            self.tokenizer = load_tokenizer(init_dir)
            fit_to_model(self.task, self.tokenizer, cfg, json.loads((init_dir / "config.json").read_text()))
            return init_dir
        if cfg.model.path:
            model, tokenizer = load_model(cfg.model.path), load_policy_tokenizer(cfg.model.path)
        else:
            tokenizer = train_tokenizer(self.task.corpus(), cfg.model.vocab_size)
            model = build_tiny_model(TinyModelSpec.from_config(cfg.model), tokenizer, seed=cfg.run.seed)
        fit_to_model(self.task, tokenizer, cfg, model.config.to_dict())  # long prompts: before warm-up and actors
        if cfg.sft.steps:
            bar = progress_bar(cfg.sft.steps, "warm-up", self.progress)
            warm = (
                self.algorithm.warmup_task(self.task, tokenizer)
                if isinstance(self.algorithm, HasWarmupTask)
                else self.task
            )
            if cfg.sft.demo_error and getattr(warm, "flawed_demonstration", None) is None:
                raise ConfigError(
                    f"config error: 'sft.demo_error'={cfg.sft.demo_error}: task '{cfg.task.name}' has no "
                    f"flawed demonstrations (allowed: 0; a dataset names them by task.flawed_demonstration_key)"
                )
            warmup(
                model,
                tokenizer,
                warm,
                warm.rows("train"),
                cfg.sft.steps,
                cfg.sft.batch_size,
                cfg.sft.lr,
                cfg.run.seed,
                on_step=lambda s, loss: bar.set_postfix(loss=f"{loss:.3f}", refresh=False) or bar.update(),
                demo_error=cfg.sft.demo_error,
                tools=self.envs.tool_schemas if self.envs else None,  # the episodes' prompts list them
            )
            bar.close()
        save_model_dir(model, tokenizer, init_dir)
        self.tokenizer = tokenizer
        return init_dir

    def start_actors(self, policy_dir: Path) -> None:
        """The actors, the weight sync between them, the context algorithms see and the rollout source."""
        cfg = self.cfg
        self.policy_dir = Path(policy_dir)  # the initial policy (a learner restart goes back to it)
        plays_episodes = self.envs is not None or isinstance(self.algorithm, HasOwnEpisodes)
        episode_tokens = self._episode_tokens() if plays_episodes else None
        episodes = None  # how env.name's episodes are played: checked before any actor starts
        if self.envs is not None:
            episodes = EpisodeSettings.for_tokenizer(
                self.tokenizer,
                self.envs.make,
                cfg.env.max_turns,
                episode_tokens,
                self.envs.tool_schemas,
                lockstep=cfg.env.lockstep,
            )
        teacher_dir = (
            self.algorithm.teacher_dir(self.run_dir, self.task, self.tokenizer, cfg.run.seed)
            if isinstance(self.algorithm, HasTeacher)
            else None
        )  # DA-KD: trained or checked before any actor
        actors = start_actors(cfg, self.algorithm, self.policy_dir, self.task)
        self.release_groups = weakref.finalize(self, release_placement_groups, actors.groups)  # with the last handle
        self.policies, self.reference, self.reward, self.buffer = (
            actors.policies,
            actors.reference,
            actors.reward,
            actors.buffer,
        )
        self.learner_group = Learners(self.policies, self.run_dir, self.algorithm)
        try:
            self.weights = make_weight_sync(cfg, self.policies, self.learner_group.get)
        except Exception:
            self._kill(actors.all())
            self.release_groups()
            raise
        report = placement_report(
            self.policies, actors.services, type(self.weights).__name__
        )  # where each actor landed
        (self.run_dir / "placement.json").write_text(json.dumps(report, indent=1))
        self.learner_group.record_placement(report)
        self.ctx = ActorContext(
            cfg, self.tokenizer, self.task, self.policies, self.reference, self.reward, self.weights, cfg.run.seed
        )
        if teacher_dir:
            temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
            self.ctx.teacher = (
                ray.remote(ReferenceWorker)
                .options(**service_options(cfg, 0.25))
                .remote(
                    str(teacher_dir),
                    temperature,
                    max_tokens_per_batch=cfg.learner.max_tokens_per_microbatch,
                    auto_pack=cfg.learner.auto_pack,
                )
            )
        if self.needs_sandbox:
            self.ctx.sandbox = SandboxPool(cfg.sandbox.backend, workers=cfg.sandbox.workers)
        self.ctx.episodes, self.ctx.episode_tokens = episodes, episode_tokens
        self.stream = PromptStream(
            [self._prompt(f"train-{i}", row) for i, row in enumerate(self.task.rows("train"))], cfg.run.seed
        )
        self.ctx.prompt_stream = self.stream
        self.rollouts = RolloutSource(
            self.algorithm,
            self.ctx,
            self.buffer,
            self.stream,
            cfg.trainer.prompts_per_step,
            cfg.trainer.mode == "overlap",
            cfg.trainer.steps,
        )
        if cfg.trainer.mode == "async":
            t = cfg.trainer
            self.rollouts = AsyncRollouts(self.rollouts, cfg.buffer.max_staleness, t.staleness_policy, t.deterministic)

    def shutdown(self) -> None:
        """Kill the run's actors (tests that start a second controller). Nothing to do before
        they started, or after a failed start (which removed them itself)."""
        if self.weights is None:
            return
        self.rollouts.close()
        self.weights.close()
        self.release_groups()
        self._kill(
            [
                *(a for a in (self.reference, self.reward, self.buffer) if a is not None),
                *(a for p in self.policies.values() for a in [*p.workers, *p.learners]),
            ]
        )

    @staticmethod
    def _kill(actors: list) -> None:
        for actor in actors:
            ray.kill(actor)

    @property
    def needs_sandbox(self) -> bool:
        """The task runs code (task.name code), or an episode's tool does (env.tools: python)."""
        return getattr(self.task, "needs_sandbox", False) or "python" in self.cfg.env.tools

    def _sandbox_limits(self) -> Limits:
        s = self.cfg.sandbox
        return Limits(wall_time_s=s.wall_time_s, cpu_time_s=s.cpu_time_s, memory_mb=s.memory_mb)

    def _run_sandboxed(self, requests):
        """The python tool's runner: the run's sandbox pool, through the context (started with the actors)."""
        return self.ctx.execute(requests)

    def evaluator_episodes(self) -> EvalEpisodes | None:
        """What attached evaluators need to play this run's episodes (None: single-turn)."""
        backend = self.cfg.sandbox.backend
        if isinstance(self.algorithm, HasOwnEpisodes):
            sandbox = backend if self.needs_sandbox else None
            return EvalEpisodes(max_tokens=self.ctx.episode_tokens, sandbox_backend=sandbox, algorithm=self.algorithm)
        if self.envs is None:
            return None
        if not self.envs.uses_sandbox:
            return EvalEpisodes(self.cfg.env, self.ctx.episode_tokens)
        return EvalEpisodes(self.cfg.env, self.ctx.episode_tokens, backend, self._sandbox_limits())

    def _episode_tokens(self) -> int:
        """An episode's token budget: env.max_tokens, at most (and by default) the policy's context."""
        context = context_length(json.loads((self.policy_dir / "config.json").read_text()))
        budget = self.cfg.env.max_tokens or context
        if budget is None:
            raise ConfigError("config error: 'env.max_tokens' is null and the model states no context length: set it")
        if context is not None and budget > context:
            raise ConfigError(
                f"config error: 'env.max_tokens'={budget}: above the model's context of {context} tokens "
                f"(allowed: at most {context}, or null for it)"
            )
        return budget

    def _check_sandbox(self) -> None:
        """A task (or a tool) that runs code gets the configured backend and limits, or the run
        stops here with one line saying why the sandbox engine is unusable."""
        if not self.needs_sandbox:
            return
        s = self.cfg.sandbox
        why = unavailable(s.backend)
        if why:
            what = f"task '{self.cfg.task.name}'" if getattr(self.task, "needs_sandbox", False) else "env.tools' python"
            raise RunFailed(
                f"{what} runs code in the {s.backend} sandbox, which is unavailable "
                f"here: {why} (set up the engines: .ci/setup_sandbox.sh; or set sandbox.backend)"
            )
        if getattr(self.task, "needs_sandbox", False):
            self.task.use_sandbox(s.backend, self._sandbox_limits())

    def _prompt(self, uid: str, row: dict) -> Prompt:
        ids, text = prompt_ids(self.task, self.tokenizer, row)
        return Prompt(uid, ids, text, row)

    # ---- what the loop calls ------------------------------------------------------------
    def train_step(self, queue_next: bool = True) -> dict[str, float]:
        """One policy update (sample -> prepare -> train -> sync): the step's metrics. `queue_next`
        False: the next step is not queued behind this one (trainer.mode overlap), so nothing of the
        run is left working when it returns (a caller timing blocks of steps ends a block so)."""
        return loop.update(self, queue_next)[0]

    def sync_weights(self, version: int, training: dict[str, list] | None = None) -> None:
        """The learners' weights at `version` toward every rollout worker, by the run's strategy;
        `training`: per policy, this step's train calls (a shared-memory load waits on them)."""
        self.rollouts.before_sync(version)  # async, deterministic: the batches the old weights make first
        with self.ctx.timed("sync"):
            self.weights.send(version, training)
        self.ctx.policy_version = version
        self.rollouts.set_policy_version(version)

    def rows_per_policy(self, table) -> dict:
        """The step's rows by the policy they train: all to the run's policy, unless the
        algorithm trains several (CDG's per-role models)."""
        if len(self.policies) == 1:
            return {self.ctx.main_policy: table}
        return self.algorithm.split_by_policy(table)

    def reward_metrics(self) -> dict[str, float]:
        """The reward source's own metrics of this step: a judge's verdict rates and order disagreements, a reward
        function's or server's reward/errors and extra metrics (a reward model has none)."""
        has_metrics = self.cfg.reward.source == "judge" or self.reward_has_scorer
        return ray.get(self.reward.take_metrics.remote()) if has_metrics else {}  # else no call: ~2% of a step

    @property
    def reward_has_scorer(self) -> bool:
        """Rewards come from a reward function or server (envs/reward_runner.py), not the task's rule."""
        r = self.cfg.reward
        return r.source == "http" or (r.source == "rule" and r.function is not None)

    def row_reward_metrics(self, uids: list[str]) -> dict[str, dict[str, float]]:
        """A reward function's extra metrics of these rows (uid -> metrics); {} without one."""
        return ray.get(self.reward.take_row_metrics.remote(uids)) if uids and self.reward_has_scorer else {}

    def evaluate(self, split: str = "eval", greedy: bool | None = None, samples: int = 1) -> dict[str, float]:
        """Accuracy on a split through the rollout workers (current policy version): greedy
        unless `rollout.eval_greedy` is off (or `greedy=False`), then pass@1 at the rollout
        temperature, over `samples` responses per prompt, with `pass@k` for k = 2, 4, ... up to
        `samples` (`pass_at_k`). With a reward function or server, a response is correct where
        its reward is >= 1 (as `accuracy/train`) and the mean reward is reported too; else the
        task's `is_correct` decides. An algorithm with an `evaluate` hook measures it its own way.
        With `env.name` set, each sample is a multi-turn episode (algorithms/episodes.py) whose
        final answer is graded so (an env that grades itself: its `correct`), with the
        episodes' `episode/*` and `tools/*` rates."""
        rows = self.task.rows(split)
        prompts = [self._prompt(f"{split}-{i}", row) for i, row in enumerate(rows)]
        greedy = self.cfg.rollout.eval_greedy if greedy is None else greedy
        temperature = 0.0 if greedy else self.cfg.rollout.temperature
        params = self.ctx.sampling(n=1 if greedy else samples, temperature=temperature, seed=12345)
        if isinstance(self.algorithm, EvaluatesItself):  # its own protocol (RLEF: multi-turn episodes, 1@3)
            return {**self.algorithm.evaluate(self.ctx, prompts, params), "n": float(len(prompts))}
        if self.ctx.episodes is not None:  # multi-turn episodes, n per prompt
            episodes = play_episodes(self.ctx, prompts, params.n, params)
            prompt_index = [i for i in range(len(prompts)) for _ in range(params.n)]
            correct, extra = np.array([bool(e.correct) for e in episodes]), {}
            answered = final_answers(episodes)
            if answered:
                answers = [episodes[i] for i in answered]
                graded, extra = self._graded([e.answer for e in answers], [e.prompt.meta for e in answers])
                correct[answered] = graded
                for e, right in zip(answers, graded):
                    e.correct = bool(right)
            extra |= summary_metrics([e.summary() for e in episodes])
        else:
            gens = self.ctx.generate([GenerationRequest(p.prompt_ids, params) for p in prompts])
            texts = self.tokenizer.batch_decode([g.response_ids for g in gens], skip_special_tokens=True)
            prompt_index = [g.request_index for g in gens]
            correct, extra = self._graded(texts, [prompts[i].meta for i in prompt_index])
        if params.n > 1:
            per_prompt = np.bincount(prompt_index, weights=correct, minlength=len(prompts))
            ks = [2**i for i in range(1, int(np.log2(params.n)) + 1)]
            extra |= {f"pass@{k}": pass_at_k(per_prompt, params.n, k) for k in ks}
        return {"accuracy": float(np.mean(correct)), **extra, "n": float(len(correct))}

    def _graded(self, texts: list[str], metas: list[dict]) -> tuple[np.ndarray, dict[str, float]]:
        """(correct per response, extra metrics) of held-out responses: reward >= 1 with a reward
        function or server (and the mean reward), else the task's `is_correct`."""
        if self.reward_has_scorer:
            rewards = np.asarray(ray.get(self.reward.heldout_rewards.remote(texts, metas)))
            return rewards >= 1.0, {"reward": float(rewards.mean())}
        return np.array([self.task.is_correct(meta, t) for meta, t in zip(metas, texts)], dtype=bool), {}

    def save_checkpoint(self, metrics: dict | None = None) -> Path:
        return checkpointing.save(self, metrics)

    # ---- the whole run -------------------------------------------------------------------
    def run(self, resume: bool = False) -> dict:
        cfg = self.cfg
        if resume and not candidates(self.run_dir / "checkpoints"):
            raise CheckpointError(f"no checkpoint to resume from in {self.run_dir / 'checkpoints'}")
        if not resume and ((self.run_dir / "metrics.jsonl").exists() or (self.run_dir / "checkpoints").exists()):
            raise CheckpointError(
                f"run dir {self.run_dir} already holds a run: resume it (rlsys resume {self.run_dir}) "
                f"or pick another run.name"
            )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        # `rlsys eval attach` finds the evaluators' registry through cluster.json
        self.attached = AttachedEvaluators(cfg.run.name, cfg.placement.services.resources)
        write_cluster_info(self.run_dir, cfg.run.name)
        t0 = time.perf_counter()
        tracker = Tracker(self.run_dir, cfg)  # first: a logger that cannot start fails before any actor
        finished = False
        try:
            self.start_actors(self.prepare_policy())
            first, last_eval, restored = self._begin(resume, tracker)
            self.attached.start(
                self.policy_dir,
                self.task,
                cfg.rollout.max_new_tokens,
                restored,
                self.evaluator_episodes(),
                self.reward if self.reward_has_scorer else None,
            )
            bar = progress_bar(cfg.trainer.steps, cfg.algorithm.name, self.progress, initial=self.step)
            with StopSignals() as self.stop:  # SIGTERM, Ctrl-C: the loop stops at the next step boundary
                last_eval = loop.train(self, tracker, bar, last_eval)
            bar.close()
            self._finish(tracker)
            finished = True
        finally:
            tracker.close(failed=True)  # a no-op after _finish closed it
            if self.weights is not None:
                self.rollouts.close(None if finished else cfg.trainer.sync_timeout_s)  # a failing run: not forever
                self.weights.close()
        return {
            "run": cfg.run.name,
            "algorithm": cfg.algorithm.name,
            "steps": self.step,
            "eval_accuracy_before_rl": first["accuracy"],
            "eval_accuracy_after_rl": last_eval["accuracy"],
            "seconds": time.perf_counter() - t0,
            "run_dir": str(self.run_dir),
        }

    def _begin(self, resume: bool, tracker: Tracker) -> tuple[dict, dict, list[dict]]:
        """(the first held-out evaluation, the last one, the evaluators to attach again): a fresh
        run evaluates the initial policy; a resumed one restores its newest readable checkpoint."""
        if not resume:
            first = self.evaluate()
            tracker.log_eval(self.step, "heldout", first, self.ctx.policy_version)
            return first, first, []
        path, state = checkpointing.restore(self)
        tracker.truncate_after(self.step)
        restored_metrics = state.get("metrics")
        if restored_metrics and not any(r["step"] == self.step for r in read_jsonl(tracker.metrics_path)):
            tracker.log(self.step, restored_metrics)  # killed between the checkpoint and its row
        print(f"rlsys: resumed {self.cfg.run.name} from {path.name} (step {self.step})", file=sys.stderr)
        evals = [r for r in read_jsonl(tracker.evals_path) if r["evaluator"] == "heldout"]  # not attached ones
        first = evals[0] if evals else self.evaluate()
        return first, evals[-1] if evals else first, state.get("evaluators", [])

    def _finish(self, tracker: Tracker) -> None:
        self.ctx.settle_sync()
        for row in self.attached.drain():
            tracker.log_eval(*row)
        self.attached.close()
        if self.ctx.sandbox is not None:
            self.ctx.sandbox.close()
        tracker.close()


def pass_at_k(correct_per_prompt, n: int, k: int) -> float:
    """The unbiased pass@k over prompts with n samples each, c of them correct (Chen et al. 2021):
    mean over prompts of 1 - C(n - c, k) / C(n, k)."""
    return float(np.mean([1.0 - comb(n - int(c), k) / comb(n, k) for c in correct_per_prompt]))


def progress_bar(total: int, desc: str, enabled: bool, initial: int = 0):
    """tqdm on stderr; in a log file (not a terminal) a line every 10 s at most."""
    from tqdm import tqdm  # only where a bar is drawn

    return tqdm(
        total=total,
        desc=desc,
        disable=not enabled,
        file=sys.stderr,
        initial=initial,
        mininterval=1.0 if sys.stderr.isatty() else 10.0,
        dynamic_ncols=True,
    )
