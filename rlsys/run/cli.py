"""`rlsys` command line: run, and the side modules' commands.

Errors a user can fix (config, dataset, missing files) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from envs.datasets import DatasetError
from rlsys.checkpoint import CheckpointError
from rlsys.config import ConfigError, config_reference, load_config
from rlsys.errors import RunFailed, Stopped


def _resume(args) -> int:
    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").exists():
        raise ConfigError(f"config error: {run_dir} is not a run directory (no config.yaml)")
    args.config, args.resume = str(run_dir / "config.yaml"), True
    args.overrides = [f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}", *args.overrides]
    return _run(args)


def _run(args) -> int:
    from rlsys.cluster import init_ray  # lazy: ray, only for the commands that start a run

    cfg = load_config(args.config, args.overrides)
    from algorithms.base import build_algorithm  # lazy: torch and the algorithms, only where a config is built

    algorithm = build_algorithm(cfg)  # its keys and the rules across sections, checked before any actor starts
    from envs.reward_runner import build_scorer  # lazy: the reward functions, only where a run uses one

    build_scorer(cfg.reward, sandbox_cfg=cfg.sandbox)  # a reward function that cannot load fails before the warm-up
    init_ray(cfg.ray.address, cfg.ray.num_cpus)  # before anything imports ray
    from rlsys.run.controller import Controller  # lazy: after init_ray (ray, deepspeed, the actors)

    controller = Controller(
        cfg, Path(cfg.run.output_dir) / cfg.run.name, progress=not args.no_progress, algorithm=algorithm
    )
    run_dir = controller.run_dir
    summary = controller.run(resume=args.resume)
    print(
        f"run {summary['run']} ({summary['algorithm']}) finished {summary['steps']} steps in "
        f"{summary['seconds']:.0f} s: held-out accuracy {summary['eval_accuracy_before_rl']:.3f} after warm-up -> "
        f"{summary['eval_accuracy_after_rl']:.3f} after RL; run dir {summary['run_dir']}"
    )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


def _submit(args) -> int:
    from algorithms.base import build_algorithm  # lazy: torch and the algorithms, only where a config is built
    from rlsys import jobs  # lazy: ray's job client, only for the job commands

    cfg = load_config(args.config, [f"run.output_dir={Path.cwd() / 'runs'}", *args.overrides])  # as jobs.submit does
    build_algorithm(cfg)  # a bad config fails here, not on the cluster
    run_dir = Path.cwd() / cfg.run.output_dir / cfg.run.name  # `rlsys eval attach JOB` finds cluster.json there
    py_modules, reward_overrides = jobs.reward_file_shipping(cfg.reward.function)  # a reward file travels too
    print(
        jobs.submit(
            args.address,
            args.config,
            [*args.overrides, *reward_overrides],
            metadata={"rlsys_run_dir": str(run_dir)},
            py_modules=py_modules,
        )
    )
    return 0


def _reward_check(args) -> int:
    """Score the train split's reference answers (or `--response`) with the configured reward, without Ray or a
    model: one JSON line per row (row, response, reward, metrics, error), then one with the mean."""
    import tempfile

    from envs.registry import make_task  # lazy: the tasks and reward functions, only for the commands that use them
    from envs.reward_functions import reference_response  # as above
    from envs.reward_runner import Outcome, RewardScorer, TaskRunner, answer_key, build_scorer  # as above

    cfg = load_config(args.config, args.overrides)
    r = cfg.reward
    if r.source not in ("rule", "http"):
        raise ConfigError(f"config error: rlsys reward check scores reward.source rule or http, not '{r.source}'")
    with tempfile.TemporaryDirectory() as tmp:
        task = make_task(cfg.task, Path(tmp) / "data", cfg.run.seed)
        rows = task.rows("train")
        if args.row is not None and not 0 <= args.row < len(rows):
            raise ConfigError(f"reward check: --row {args.row} is out of range (the train split has {len(rows)} rows)")
        picked = [args.row] if args.row is not None else list(range(len(rows)))[: args.limit or None]
        responses, outcomes = {}, {}
        for i in picked:
            try:
                given = args.response
                responses[i] = (
                    given if given is not None else reference_response(r.function, rows[i], answer_key(r, task))
                )
            except KeyError as e:
                outcomes[i] = Outcome(None, {}, f"no reference answer: {e.args[0]}; give a --response")
        scorer = build_scorer(r, task, cfg.sandbox) or RewardScorer(TaskRunner(task), f"task '{cfg.task.name}'")
        try:
            prompts = [task.prompt_text(rows[i]) for i in responses]
            found = scorer.run(prompts, list(responses.values()), [rows[i] for i in responses])
        finally:
            scorer.close()
    outcomes |= dict(zip(responses, found))
    rewards = [r.on_error if outcomes[i].error else outcomes[i].reward for i in picked]
    for i, reward in zip(picked, rewards):
        response = responses.get(i, "")
        line = {
            "row": i,
            "response": response if len(response) <= 200 else response[:200] + "...",
            "reward": reward,
            "metrics": outcomes[i].metrics,
            "error": outcomes[i].error,
        }
        print(json.dumps(line, default=str))
    errors = sum(outcomes[i].error is not None for i in picked)
    print(json.dumps({"mean": sum(rewards) / max(len(rewards), 1), "rows": len(picked), "errors": errors}))
    return 0


def _config_doc(args) -> int:
    from algorithms.base import available, get_algorithm  # lazy: torch and the algorithms

    text = config_reference({name: get_algorithm(name) for name in available()})
    if args.output is None:
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        print(f"wrote {args.output} ({text.count(chr(10))} lines)")
    return 0


def _job_command(args) -> int:
    from rlsys import jobs  # lazy: ray's job client, only for the job commands

    if args.command == "status":
        print(jobs.status(args.address, args.job))
    elif args.command == "logs":
        jobs.logs(args.address, args.job, follow=args.follow)
    elif args.command == "stop":
        print("stopped" if jobs.stop(args.address, args.job) else "not running")
    return 0


SPEC_FLAGS = (
    "name",
    "split",
    "dataset",
    "metric",
    "reward_model",
    "judge",
    "temperature",
    "n",
    "max_new_tokens",
    "limit",
    "every",
    "seed",
)


def _eval(args) -> int:
    from rlsys import evaluators  # lazy: ray, only for the eval commands

    if args.action == "attach":
        spec = evaluators.load_spec(args.spec, {k: getattr(args, k) for k in SPEC_FLAGS})
        print(evaluators.attach(args.target, spec, args.address))
    elif args.action == "list":
        for spec in evaluators.list_specs(args.target, args.address):
            print(json.dumps(spec))
    elif not evaluators.detach(args.target, args.name, args.address):
        print(f"evaluator error: no evaluator named {args.name} is attached", file=sys.stderr)
        return 2
    else:
        print(f"detached evaluator {args.name}")
    return 0


def _eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help="evaluators attached to a running run or job").add_subparsers(
        dest="action", required=True
    )
    for action, text in (
        ("attach", "attach an evaluator (YAML spec and/or flags)"),
        ("list", "attached evaluators"),
        ("detach", "detach an evaluator by name"),
    ):
        a = ev.add_parser(action, help=text)
        a.add_argument("target", metavar="RUN_OR_JOB", help="a run dir (runs/<name>) or a job id with --address")
        a.add_argument("--address", default=None, help="dashboard address, for a job id")
        a.set_defaults(func=_eval)
        if action == "detach":
            a.add_argument("name")
        if action != "attach":
            continue
        a.add_argument("spec", nargs="?", help="YAML spec: name, split|dataset, metric, temperature, n, every, ...")
        kind = {"temperature": float, "n": int, "max_new_tokens": int, "limit": int, "every": int, "seed": int}
        for flag in SPEC_FLAGS:
            a.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=kind.get(flag, str), default=None)


def _delegate(module: str, prefix: list[str]):
    def call(args) -> int:
        import importlib

        return importlib.import_module(module).main(prefix + args.rest)

    return call


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlsys", description="Ray-based RL post-training for language models")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a training job (embedded local Ray unless ray.address is set)")
    run.add_argument("config")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algorithm.kl_coef=0.02")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument("--resume", action="store_true", help="continue from the run dir's latest checkpoint")
    run.set_defaults(func=_run)
    resume = sub.add_parser("resume", help="continue a run from its latest readable checkpoint")
    resume.add_argument("run_dir")
    resume.add_argument("overrides", nargs="*", help="e.g. trainer.steps=100 to train further")
    resume.add_argument("--no-progress", action="store_true")
    resume.set_defaults(func=_resume)
    default_address = os.environ.get("RAY_DASHBOARD_ADDRESS", "http://127.0.0.1:8265")
    submit = sub.add_parser("submit", help="submit a run to a Ray cluster (Ray Jobs API)")
    submit.add_argument("config")
    submit.add_argument("overrides", nargs="*")
    submit.add_argument("--address", default=default_address)
    submit.set_defaults(func=_submit)
    for name, text in (("status", "a job's status"), ("logs", "a job's logs"), ("stop", "stop a job")):
        j = sub.add_parser(name, help=text)
        j.add_argument("job")
        j.add_argument("--address", default=default_address)
        if name == "logs":
            j.add_argument("--follow", "-f", action="store_true")
        j.set_defaults(func=_job_command)
    _eval_parser(sub)
    reward = sub.add_parser("reward", help="reward functions").add_subparsers(dest="action", required=True)
    check = reward.add_parser(
        "check",
        help="score the train split's reference answers (or --response) with the configured reward, without Ray or "
        "a model: one JSON line per row, then the mean",
    )
    check.add_argument("config")
    check.add_argument("overrides", nargs="*", help="dotted overrides, e.g. reward.function=math")
    check.add_argument("--response", default=None, help="score this response on every row instead of the reference")
    check.add_argument("--row", type=int, default=None, help="only this row (a 0-based index into the train split)")
    check.add_argument("--limit", type=int, default=20, help="the first K rows (default 20; 0: all)")
    check.set_defaults(func=_reward_check)
    config = sub.add_parser("config", help="the configuration reference").add_subparsers(dest="action", required=True)
    doc = config.add_parser("doc", help="every config key, its type, default and description, as markdown")
    doc.add_argument(
        "--output", "-o", default=None, help="write it here (the repo keeps docs/configuration.md); default: stdout"
    )
    doc.set_defaults(func=_config_doc)
    for name, module, prefix in (
        ("sandbox", "sandbox.cli", []),
        ("quantize", "rlsys.quantize.cli", []),
        ("rm", "rlsys.reward_model", []),
        ("privacy", "rlsys.privacy.cli", []),
    ):
        s = sub.add_parser(name, help=f"{name} commands", add_help=False)
        s.add_argument("rest", nargs=argparse.REMAINDER)
        s.set_defaults(func=_delegate(module, prefix))
    return p


def stop_ray() -> None:
    """Disconnect from Ray if this process connected (its actors end with the driver)."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DatasetError, CheckpointError) as e:
        print(str(e), file=sys.stderr)
        return 2
    except Stopped as e:  # a signal, at a step boundary
        print(f"rlsys: {e}", file=sys.stderr)
        return 128 + e.signum
    except RunFailed as e:
        if argv is None:  # the program (not a caller in-process, whose Ray session goes on)
            stop_ray()  # its log stream (a lost node's workers' dumps) would follow the one line
        # raised in a Ray actor: Ray's wrapper carries the traceback, its cause the one line
        cause = getattr(e, "cause", None)
        print(f"rlsys: {cause if isinstance(cause, RunFailed) else e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
