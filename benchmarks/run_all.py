"""`make bench`: the speed figures (benchmarks/perf.py --quick), then the learning check
(benchmarks/learning.py on configs/quickstart.yaml), one after the other.

    .venv/bin/python benchmarks/run_all.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = (["benchmarks/perf.py", "--quick"], ["benchmarks/learning.py"])


def main() -> int:
    for step in STEPS:
        print(f"$ {Path(sys.executable).name} {' '.join(step)}", flush=True)
        rc = subprocess.call([sys.executable, *step], cwd=ROOT)
        if rc:
            print(f"{step[0]} failed (exit {rc})", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
