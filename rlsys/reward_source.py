"""The reward actor a run's `reward` section asks for (rlsys/config.py RewardConfig).

    source: rule   RewardWorker with the task's rule reward (the default), or with reward.function
    source: http   RewardWorker asking a reward server (reward.url)
    source: model  RewardWorker with a sequence-classification reward model (reward.model_dir)
    source: judge  JudgeWorker (actors/judge.py) on reward.judge_dir, or on the initial policy

A reward function or server is a scorer (envs/reward_runner.py) built and checked here, before
the actor starts: a function that cannot be loaded is a config error now, not a failed row per
step.

All answer `score(table) -> list[float]`, the call `RolloutContext.score` makes, `take_metrics()`
(the step's own metrics: reward/errors, a judge's verdict rates), and
`state()` / `load_state(state)` for checkpoints (a sampling judge's seed counter), so
every algorithm takes rewards from any of them unchanged (PILAF labels its pairs from the
scores; with `judge.mode: pairwise` a pair's scores are the judge's both-order verdict).
"""

from __future__ import annotations

from pathlib import Path


def judge_options(reward_cfg, seed: int) -> dict:
    j = reward_cfg.judge
    return dict(
        mode=j.mode,
        max_plan_tokens=j.max_plan_tokens,
        max_execution_tokens=j.max_execution_tokens,
        temperature=j.temperature,
        min_score=j.min_score,
        max_score=j.max_score,
        unparsable_reward=j.unparsable_reward,
        seed=seed,
    )


def start_reward_actor(reward_cfg, policy_dir: Path, task, seed: int = 0, sandbox_cfg=None, resources=None):
    """The Ray actor behind `ctx.score`. `sandbox_cfg`: where reward.function `code` runs the tests
    (None: the task's sandbox settings, else the defaults); `resources`: the custom Ray resources
    it asks for (placement.services)."""
    import ray

    from actors.reward import RewardWorker  # floor module: actor code loads only where the actor starts

    pinned = {"resources": resources} if resources else {}

    if reward_cfg.source in ("rule", "http"):
        from envs.reward_runner import build_scorer  # as above: the reward functions load only where they run

        scorer = build_scorer(reward_cfg, task, sandbox_cfg)
        return (
            ray.remote(RewardWorker).options(num_cpus=0.1, **pinned).remote(str(policy_dir), task=task, scorer=scorer)
        )
    if reward_cfg.source == "model":
        return (
            ray.remote(RewardWorker)
            .options(num_cpus=0.1, **pinned)
            .remote(str(policy_dir), reward_model_dir=str(reward_cfg.model_dir))
        )
    from actors.judge import JudgeWorker  # as above

    return (
        ray.remote(JudgeWorker)
        .options(num_cpus=0.25, **pinned)
        .remote(
            str(reward_cfg.judge_dir or policy_dir),
            tokenizer_dir=str(policy_dir),
            backend=reward_cfg.judge.backend,
            batch_size=reward_cfg.judge.batch_size,
            options=judge_options(reward_cfg, seed),
        )
    )
