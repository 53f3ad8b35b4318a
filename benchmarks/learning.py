"""Does RL learn, and how fast is each phase? Runs a config's job in-process (embedded
local Ray) and prints held-out accuracy after the warm-up and after RL, greedy and at the
rollout temperature (pass@1), then samples/s of every phase of a step.

    .venv/bin/python benchmarks/learning.py                       # configs/quickstart.yaml
    .venv/bin/python benchmarks/learning.py configs/quickstart.yaml algorithm.name=rloo
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.cluster import init_ray  # noqa: E402  (before anything imports ray)


def main(argv: list[str]) -> None:
    config = argv[0] if argv and "=" not in argv[0] else "configs/quickstart.yaml"
    overrides = [a for a in argv if "=" in a]
    init_ray()
    from rlsys.config import load_config
    from rlsys.run.controller import Controller

    out = Path(tempfile.mkdtemp(prefix="rlsys-bench-learning-"))
    cfg = load_config(config, [*overrides, f"run.output_dir={out}", "run.name=learning"])
    c = Controller(cfg, out / "learning", progress=False)
    t0 = time.perf_counter()
    c.start_actors(c.prepare_policy())
    warmup_s = time.perf_counter() - t0
    before = {"greedy": c.evaluate(greedy=True)["accuracy"], "sampled": c.evaluate(greedy=False)["accuracy"]}
    phase_s, samples, t1 = defaultdict(float), 0, time.perf_counter()
    for _ in range(cfg.trainer.steps):
        m = c.train_step()
        samples += int(m["samples"])
        for k, v in m.items():
            if k.startswith("time/") and k != "time/step":
                phase_s[k[5:]] += v
    rl_s = time.perf_counter() - t1
    after = {"greedy": c.evaluate(greedy=True)["accuracy"], "sampled": c.evaluate(greedy=False)["accuracy"]}

    print(
        f"{config} {' '.join(overrides)}: {cfg.algorithm.name}, {cfg.trainer.steps} steps, "
        f"{cfg.trainer.prompts_per_step} prompts/step, warm-up + actor start {warmup_s:.0f} s, RL {rl_s:.0f} s"
    )
    print(f"{'held-out accuracy':<28}{'after warm-up':>14}{'after RL':>10}{'change':>9}")
    for k in ("greedy", "sampled"):
        label = "greedy" if k == "greedy" else f"pass@1 at T={cfg.rollout.temperature:g}"
        print(f"{label:<28}{before[k]:>14.3f}{after[k]:>10.3f}{after[k] - before[k]:>+9.3f}")
    print(f"{'phase':<28}{'seconds':>14}{'samples/s':>10}{'share':>9}")
    for phase, s in sorted(phase_s.items(), key=lambda kv: -kv[1]):
        print(f"{phase:<28}{s:>14.1f}{samples / max(s, 1e-9):>10.0f}{s / rl_s:>9.0%}")
    print(f"{'whole step':<28}{rl_s:>14.1f}{samples / rl_s:>10.0f}{1:>9.0%}")


if __name__ == "__main__":
    main(sys.argv[1:])
