"""Run logging: metrics.jsonl, evals.jsonl and TensorBoard event files in the run dir."""

from __future__ import annotations

import json
import math
from pathlib import Path


class Tracker:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.evals_path = self.run_dir / "evals.jsonl"

    def _append(self, path: Path, row: dict) -> None:
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        self._append(self.metrics_path, row)
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_eval(self, step: int, name: str, metrics: dict[str, float], policy_version: int) -> None:
        self._append(self.evals_path, {"step": step, "evaluator": name, "policy_version": policy_version, **metrics})
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                self.writer.add_scalar(f"eval/{name}/{k}", v, step)
        self.writer.flush()

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after `step` (a resumed run logs them again)."""
        for path in (self.metrics_path, self.evals_path):
            rows = [r for r in read_jsonl(path) if r["step"] <= step]
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def close(self) -> None:
        self.writer.close()


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


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
