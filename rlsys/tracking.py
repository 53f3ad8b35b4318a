"""Run logging: metrics.jsonl, evals.jsonl, samples.jsonl and TensorBoard event files in the run dir."""

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
        self.samples_path = self.run_dir / "samples.jsonl"

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

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Rollout rows a person can read (`rollout_samples`): one json line each, and one
        markdown table per step in TensorBoard's text tab."""
        for sample in samples:
            self._append(self.samples_path, {"step": step, **sample})
        if samples:
            keys = list(samples[0])
            table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            table += ["| " + " | ".join(_cell(s.get(k)) for k in keys) + " |" for s in samples]
            self.writer.add_text("samples", "\n".join(table), step)
            self.writer.flush()

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after `step` (a resumed run logs them again)."""
        for path in (self.metrics_path, self.evals_path, self.samples_path):
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


def rollout_samples(table, tokenizer, n: int) -> list[dict]:
    """The first `n` rows of a step's Experience table as text: the prompt exactly as the model
    saw it (special tokens and chat template kept), the response, the reward, and what else the
    row's meta says of its reward (`reward/...` keys)."""
    rows = table.slice(0, n).to_pylist()
    samples = []
    for row in rows:
        meta = json.loads(row["meta"]) if isinstance(row.get("meta"), str) else (row.get("meta") or {})
        samples.append(
            {
                "prompt": tokenizer.decode(row["prompt_ids"], skip_special_tokens=False),
                "response": tokenizer.decode(row["response_ids"], skip_special_tokens=False),
                "reward": float(row["reward"]),
                **{k: v for k, v in meta.items() if k.startswith("reward/")},
            }
        )
    return samples


def _cell(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text.replace("|", "\\|").replace("\n", "<br>")


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v
