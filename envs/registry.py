"""Tasks by name (the config's `task.name` picks one) and the envs of multi-turn episodes (`env.name`)."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

from envs.arithmetic import ArithmeticTask
from envs.dataset_task import DatasetTask
from envs.rewards import with_shaping
from rlsys.config import ConfigError

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


# ---- environments of multi-turn episodes (env.name) --------------------------------------------
@dataclass
class EnvFactory:
    """Makes the env of each episode of `env.name` (`make()`, a fresh one per episode);
    `tool_schemas`: the function schemas the chat template lists (None: no tools);
    `uses_sandbox`: a tool runs code in the run's sandbox pool."""

    make: Callable[[], Any]
    tool_schemas: list[dict] | None = None
    uses_sandbox: bool = False


def make_env_factory(env_cfg, task, run=None, limits=None) -> EnvFactory | None:
    """The factory of `env_cfg.name`'s envs over `task` (None: single-turn, no env). `tools`:
    ToolEnv with the tools of `env_cfg.tools` (`run`/`limits`: the sandbox the python tool runs
    in), its answers graded by the rollout with the run's reward; a class path: the user's class,
    made as ClassName(task) per episode (and once here, to check it and read its optional
    `tool_schemas()`). ConfigError (one line) for a tool or class that cannot be loaded."""
    if env_cfg.name is None:
        return None
    if env_cfg.name == "tools":
        from envs.tool_env import ToolEnv  # brings in jsonschema and transformers' schema reader: tool runs only
        from envs.tools import load_tools, tool_schemas  # the same

        try:
            tools = load_tools(env_cfg.tools, run, limits)
        except ValueError as e:
            raise ConfigError(f"config error: env.tools = {env_cfg.tools}: {e}") from None
        options = dict(max_turns=env_cfg.max_turns, timeout_s=env_cfg.timeout_s, call_penalty=env_cfg.call_penalty)
        make = partial(ToolEnv, task, tools, grade_answers=False, **options)
        return EnvFactory(make, tool_schemas(tools), uses_sandbox="python" in env_cfg.tools)
    cls = load_env_class(env_cfg.name)
    try:
        probe = cls(task)
        schemas = probe.tool_schemas() if callable(getattr(probe, "tool_schemas", None)) else None
    except Exception as e:  # noqa: BLE001 - the user's constructor failed: say how, in one line
        why = f"{cls.__name__}(task) failed: {one_line(e)}"
        raise ConfigError(f"config error: env.name = {env_cfg.name!r}: {why}") from None
    for method in ("reset", "step"):
        if not callable(getattr(probe, method, None)):
            raise ConfigError(f"config error: env.name = {env_cfg.name!r}: {cls.__name__} has no {method}() method")
    return EnvFactory(partial(cls, task), list(schemas) if schemas else None)


def load_env_class(spec: str) -> type:
    """The class of `path/to/file.py:ClassName` (the path as rlsys/config.py located it) or
    `package.module:ClassName`; ConfigError (one line) when it cannot be loaded."""
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            module_name = "rlsys_env_" + re.sub(r"\W", "_", path.stem) + f"_{zlib.crc32(str(path).encode()):08x}"
            module = sys.modules.get(module_name)
            if module is None:
                if not path.is_file():
                    raise ConfigError(f"config error: env.name = {spec!r}: no file {path}")
                if str(path.parent) not in sys.path:
                    sys.path.append(str(path.parent))  # an env file may import the modules beside it
                module_spec = importlib.util.spec_from_file_location(module_name, path)
                module = importlib.util.module_from_spec(module_spec)
                module_spec.loader.exec_module(module)
                sys.modules[module_name] = module
        else:
            module = importlib.import_module(target)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module failed to import: say how, in one line
        raise ConfigError(f"config error: env.name = {spec!r}: importing it failed: {one_line(e)}") from None
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        what = "is not a class" if cls is not None else "is not defined there"
        raise ConfigError(f"config error: env.name = {spec!r}: '{name}' {what}")
    return cls


def one_line(e: BaseException) -> str:
    """`Type: message`, the message's first line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
