"""A reward function that fails must not stop or freeze a run. Runs the same short job twice in
one command, side by side: with a clean user reward function, and with one that raises on 30%
of rows and hangs past `reward.timeout_s` on 5%. Prints each run's steps, wall time, reward
errors and timeouts, and the faulty run's time against the clean run's plus the timeouts it
waited out (timeouts / reward.workers x reward.timeout_s).

    .venv/bin/python benchmarks/reward_faults.py                 # configs/quickstart.yaml, 10 steps
    .venv/bin/python benchmarks/reward_faults.py trainer.steps=20
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAIL, HANG = 0.30, 0.05  # shares of rows whose reward raises / hangs


def exact(prompt: str, response: str, row: dict) -> float:
    """The arithmetic task's exact-answer reward, as a user would write it."""
    return float(response.strip() == str(row["answer"]))


def flaky(prompt: str, response: str, row: dict) -> float:
    """`exact`, except that a fixed share of (prompt, response) pairs raise or hang."""
    u = zlib.crc32(f"{prompt}\x00{response}".encode()) / 2**32
    if u < FAIL:
        raise ValueError(f"cannot parse {response!r}")
    if u < FAIL + HANG:
        time.sleep(3600)
    return exact(prompt, response, row)


def run(name: str, function: str, overrides: list[str], out: Path) -> dict:
    args = [sys.executable, "-m", "rlsys.run.cli", "run", "configs/quickstart.yaml",
            f"run.output_dir={out}", f"run.name={name}", f"reward.function={function}", "trainer.steps=10",
            "trainer.eval_every=0", "sft.steps=300", "reward.timeout_s=2", "reward.max_error_rate=1.0", *overrides,
            "--no-progress"]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1]}")
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return {
        "steps": len(rows),
        "seconds": seconds,
        "rl_seconds": sum(r["time/step"] for r in rows),
        "errors": sum(r.get("reward/errors", 0) for r in rows),
        "timeouts": sum(r.get("reward/timeouts", 0) for r in rows),
        "rows": sum(r["samples"] for r in rows),
    }


def main(overrides: list[str]) -> None:
    from rlsys.config import load_config

    cfg = load_config(str(ROOT / "configs/quickstart.yaml"), ["reward.timeout_s=2", *overrides])
    out = Path(tempfile.mkdtemp(prefix="rlsys-reward-faults-"))
    here = Path(__file__).resolve()
    clean = run("clean", f"{here}:exact", overrides, out)
    faulty = run("faulty", f"{here}:flaky", overrides, out)
    waited = faulty["timeouts"] / cfg.reward.workers * cfg.reward.timeout_s
    print(
        f"reward faults: {FAIL:.0%} of rows raise, {HANG:.0%} hang past reward.timeout_s={cfg.reward.timeout_s:g} s "
        f"(reward.workers={cfg.reward.workers}); configs/quickstart.yaml, 10 steps x 256 rows"
    )
    for name, r in (("clean", clean), ("faulty", faulty)):
        print(
            f"  {name:6s}: {r['steps']} steps, {r['rows']:.0f} rows, RL steps {r['rl_seconds']:.1f} s "
            f"(whole run {r['seconds']:.0f} s), reward/errors {r['errors']:.0f}, reward/timeouts {r['timeouts']:.0f}"
        )
    print(
        f"  faulty RL time / (clean + timeouts waited, {waited:.1f} s): "
        f"{faulty['rl_seconds'] / (clean['rl_seconds'] + waited):.2f}x"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
