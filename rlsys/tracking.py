"""Run logging: metrics, evaluations and rollout samples, fanned out to the loggers in
`run.loggers`: jsonl files in the run dir (always: resume reads them), TensorBoard, and the
optional wandb and mlflow extras, each imported only where it is named.

A logger is anything with the four methods of `Logger`; `Tracker` writes the jsonl files itself
and hands every row to the others.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Protocol

import numpy as np

from rlsys.config import ConfigError, JobConfig


class Logger(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def log_eval(self, step: int, name: str, metrics: dict[str, float], policy_version: int) -> None: ...
    def log_samples(self, step: int, samples: list[dict]) -> None: ...
    def log_histograms(self, step: int, values: dict[str, np.ndarray]) -> None: ...
    def close(self, failed: bool) -> None: ...


class Tracker:
    """metrics.jsonl, evals.jsonl and samples.jsonl in the run dir, and every other logger `cfg`
    names (`run.loggers`; no cfg: TensorBoard beside the jsonl files)."""

    def __init__(self, run_dir: Path, cfg: JobConfig | None = None):
        cfg = cfg or JobConfig()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.evals_path = self.run_dir / "evals.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        self.loggers: list[Logger] = [
            make_logger(name, self.run_dir, cfg) for name in cfg.run.loggers if name != "jsonl"
        ]
        self.closed = False

    def _append(self, path: Path, row: dict) -> None:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._append(self.metrics_path, {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}})
        finite = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
        for logger in self.loggers:
            logger.log(step, finite)

    def log_eval(self, step: int, name: str, metrics: dict[str, float], policy_version: int) -> None:
        self._append(self.evals_path, {"step": step, "evaluator": name, "policy_version": policy_version, **metrics})
        numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        for logger in self.loggers:
            logger.log_eval(step, name, numbers, policy_version)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Rollout rows a person can read (`rollout_samples`): one json line each, and one table
        per step in the other loggers."""
        for sample in samples:
            self._append(self.samples_path, {"step": step, **sample})
        if samples:
            for logger in self.loggers:
                logger.log_samples(step, samples)

    def log_histograms(self, step: int, values: dict[str, np.ndarray]) -> None:
        """Distributions of a step (each token's staleness, ...) in the loggers that draw them; the
        jsonl files keep the scalars the step logs of them (`staleness/mean`, `staleness/max`)."""
        for logger in self.loggers:
            logger.log_histograms(step, values)

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after `step` (a resumed run logs them again)."""
        for path in (self.metrics_path, self.evals_path, self.samples_path):
            rows = [r for r in read_jsonl(path) if r["step"] <= step]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def close(self, failed: bool = False) -> None:
        """Ends every logger's run (`failed`: marked failed where the logger has the notion); once."""
        if not self.closed:
            self.closed = True
            for logger in self.loggers:
                logger.close(failed)


def make_logger(name: str, run_dir: Path, cfg: JobConfig) -> Logger:
    if name == "tensorboard":
        return TensorBoardLogger(run_dir)
    if name == "wandb":
        return WandbLogger(run_dir, cfg)
    if name == "mlflow":
        return MlflowLogger(run_dir, cfg)
    raise ConfigError(f"run.loggers: unknown logger {name!r}")


class TensorBoardLogger:
    """run dir/tensorboard: scalars, evaluations as eval/<evaluator>/<key>, samples as a markdown
    table in the text tab."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_eval(self, step: int, name: str, metrics: dict[str, float], policy_version: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(f"eval/{name}/{k}", v, step)
        self.writer.flush()

    def log_samples(self, step: int, samples: list[dict]) -> None:
        keys = _columns(samples)
        table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        table += ["| " + " | ".join(_cell(s.get(k)) for k in keys) + " |" for s in samples]
        self.writer.add_text("samples", "\n".join(table), step)
        self.writer.flush()

    def log_histograms(self, step: int, values: dict[str, np.ndarray]) -> None:
        for name, v in values.items():
            if len(v):
                self.writer.add_histogram(name, np.asarray(v), step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


class WandbLogger:
    """A wandb run in run dir/wandb, under `run.project`, named after the run, with the resolved
    config as its config; offline unless `run.wandb_mode: online`. Its id is kept in run dir/
    wandb_id so that a resumed run continues the same wandb run. Every row carries `step`, the
    x-axis of every chart (a resumed run logs its steps after the checkpoint again)."""

    def __init__(self, run_dir: Path, cfg: JobConfig):
        self.wandb = wandb = import_extra("wandb", "wandb")
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(6)
        id_file.write_text(run_id)
        self.run = wandb.init(
            project=cfg.run.project,
            name=cfg.run.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=cfg.run.wandb_mode,
            config=cfg.model_dump(mode="json"),
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({**metrics, "step": step})

    def log_eval(self, step: int, name: str, metrics: dict[str, float], policy_version: int) -> None:
        self.run.log({**{f"eval/{name}/{k}": v for k, v in metrics.items()}, "step": step})

    def log_samples(self, step: int, samples: list[dict]) -> None:
        keys = _columns(samples)
        rows = [[_scalar(s.get(k)) for k in keys] for s in samples]
        self.run.log({"samples": self.wandb.Table(columns=keys, data=rows), "step": step})

    def log_histograms(self, step: int, values: dict[str, np.ndarray]) -> None:
        self.run.log({**{k: self.wandb.Histogram(np.asarray(v)) for k, v in values.items() if len(v)}, "step": step})

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class MlflowLogger:
    """An mlflow run in experiment `run.project`, named after the run, with the resolved config as
    its parameters (`section.key`) and one samples table artifact per step
    (samples/step_<N>.json). The store: MLFLOW_TRACKING_URI, else a file store in
    run.output_dir/mlruns (`mlflow ui --backend-store-uri runs/mlruns`), where metric names
    have `.` for `/` (`reward.mean`). The run id is kept in
    run dir/mlflow_run_id so that a resumed run continues the same mlflow run."""

    def __init__(self, run_dir: Path, cfg: JobConfig):
        mlflow = import_extra("mlflow", "mlflow")
        from mlflow.entities import Metric, Param, RunStatus

        self.Metric, self.RunStatus = Metric, RunStatus
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir.parent / "mlruns").resolve().as_uri()
        # a file store keeps a metric as a file: `loss` and `loss/policy` cannot both be there
        self.key_separator = "." if uri.startswith("file:") else "/"
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps file stores behind this
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        id_file = run_dir / "mlflow_run_id"
        if id_file.exists():
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(cfg.run.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(cfg.run.project)
        self.run_id = self.client.create_run(experiment_id, run_name=cfg.run.name).info.run_id
        id_file.write_text(self.run_id)
        params = [Param(k, str(v)[:6000]) for k, v in _flatten(cfg.model_dump(mode="json")).items()]
        for i in range(0, len(params), 100):  # mlflow's batch limit
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def _metrics(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        rows = [self.Metric(k.replace("/", self.key_separator), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(rows), 1000):
            self.client.log_batch(self.run_id, metrics=rows[i : i + 1000])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._metrics(step, metrics)

    def log_eval(self, step: int, name: str, metrics: dict[str, float], policy_version: int) -> None:
        self._metrics(step, {f"eval/{name}/{k}": v for k, v in metrics.items()})

    def log_samples(self, step: int, samples: list[dict]) -> None:
        keys = _columns(samples)
        table = {k: [_scalar(s.get(k)) for s in samples] for k in keys}
        self.client.log_table(self.run_id, data=table, artifact_file=f"samples/step_{step:06d}.json")

    def log_histograms(self, step: int, values: dict[str, np.ndarray]) -> None:
        """mlflow has no histograms: the step's scalars of them (`staleness/mean`, `/max`) are logged."""

    def close(self, failed: bool) -> None:
        status = self.RunStatus.to_string(self.RunStatus.FAILED if failed else self.RunStatus.FINISHED)
        self.client.set_terminated(self.run_id, status=status)


def import_extra(module: str, extra: str):
    """An optional dependency, imported where a config names it; one line if it is missing."""
    try:
        return __import__(module)
    except ImportError as e:
        raise ConfigError(
            f"run.loggers names {module} but it cannot be imported ({e}): pip install 'rlsys[{extra}]'"
        ) from None


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a jsonl log; a last line cut short by a kill is ignored."""
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def rollout_samples(table, tokenizer, row_metrics: dict[str, dict] | None = None) -> list[dict]:
    """A step's Experience rows as text: the prompt exactly as the model saw it (special tokens
    and chat template kept), the response, the reward, and what else is known of the reward: the
    row meta's `reward/...` keys and a reward function's extra metrics (`row_metrics`: uid ->
    {`reward/<key>`: value})."""
    samples = []
    for row in table.to_pylist():
        meta = json.loads(row["meta"]) if isinstance(row.get("meta"), str) else (row.get("meta") or {})
        extra = (row_metrics or {}).get(row["uid"], {})
        samples.append(
            {
                "prompt": tokenizer.decode(row["prompt_ids"], skip_special_tokens=False),
                "response": tokenizer.decode(row["response_ids"], skip_special_tokens=False),
                "reward": float(row["reward"]),
                **{k: v for k, v in meta.items() if k.startswith("reward/")},
                **extra,
            }
        )
    return samples


def _columns(samples: list[dict]) -> list[str]:
    """Every key of the samples, in first-seen order (rows may carry different reward metrics)."""
    return list(dict.fromkeys(k for s in samples for k in s))


def _scalar(value):
    """A table cell: numbers and strings as they are, anything else as json."""
    return value if value is None or isinstance(value, (str, int, float, bool)) else json.dumps(value)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def _cell(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|").replace("\n", "<br>")


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
