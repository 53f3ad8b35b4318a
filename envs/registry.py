"""Tasks by name: the config's `task.name` picks one."""

from __future__ import annotations

from pathlib import Path

from envs.arithmetic import ArithmeticTask
from envs.dataset_task import DatasetTask
from envs.rewards import with_shaping

TASKS = ("arithmetic", "code", "humaneval", "dataset")


def make_task(task_cfg, data_dir: Path, seed: int):
    """Build the configured task; user data (train_path/eval_path) replaces generated rows."""
    if task_cfg.name not in TASKS:
        raise ValueError(f"unknown task '{task_cfg.name}' (available: {', '.join(TASKS)})")
    if task_cfg.name in ("code", "humaneval"):  # multi-turn code (RLEF): user rows, else HumanEval
        from envs.code import CodeTask  # brings in the sandbox package: only code tasks load it

        task = (
            CodeTask(Path(task_cfg.train_path), Path(task_cfg.eval_path or task_cfg.train_path))
            if task_cfg.train_path
            else CodeTask.humaneval(data_dir, task_cfg.num_train, task_cfg.num_eval)
        )
    elif task_cfg.name == "dataset":  # a user's rows, prompts and answers (envs/dataset_task.py)
        task = DatasetTask.from_config(task_cfg)
    elif task_cfg.train_path:
        task = ArithmeticTask(Path(task_cfg.train_path), Path(task_cfg.eval_path or task_cfg.train_path))
    else:
        task = ArithmeticTask.create(
            data_dir,
            task_cfg.num_train,
            task_cfg.num_eval,
            task_cfg.min_value,
            task_cfg.max_value,
            task_cfg.operations,
            seed,
        )
    task.rows("train"), task.rows("eval")  # fail now, with the row, if the data is bad
    return with_shaping(task, task_cfg.shaping)
