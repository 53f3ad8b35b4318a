"""The reward actor a run's `reward` section asks for (rlsys/config.py RewardConfig).

    source: rule   RewardWorker with the task's rule reward (the default)
    source: model  RewardWorker with a sequence-classification reward model (reward.model_dir)
    source: judge  JudgeWorker (actors/judge.py) on reward.judge_dir, or on the initial policy

All three answer `score(table) -> list[float]`, the call `RolloutContext.score` makes, and
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


def start_reward_actor(reward_cfg, policy_dir: Path, task, seed: int = 0):
    """The Ray actor behind `ctx.score`."""
    import ray

    from actors.reward import RewardWorker  # floor module: actor code loads only where the actor starts

    if reward_cfg.source == "rule":
        return ray.remote(RewardWorker).options(num_cpus=0.1).remote(str(policy_dir), task=task)
    if reward_cfg.source == "model":
        return (
            ray.remote(RewardWorker)
            .options(num_cpus=0.1)
            .remote(str(policy_dir), reward_model_dir=str(reward_cfg.model_dir))
        )
    from actors.judge import JudgeWorker  # as above

    return (
        ray.remote(JudgeWorker)
        .options(num_cpus=0.25)
        .remote(
            str(reward_cfg.judge_dir or policy_dir),
            tokenizer_dir=str(policy_dir),
            backend=reward_cfg.judge.backend,
            batch_size=reward_cfg.judge.batch_size,
            options=judge_options(reward_cfg, seed),
        )
    )
