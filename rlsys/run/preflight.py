"""The first command of a submitted job (`rlsys submit`'s entrypoint): the cluster runs a job's
entrypoint with the `python` on its PATH (the shell `ray start` ran in), which need not be the
environment rlsys is installed in. Checked here, with the standard library only, so the job ends
in one line naming that Python instead of an ImportError deep in its log."""

from __future__ import annotations

import importlib.util
import platform
import sys

NEEDED = ("ray", "torch", "deepspeed", "transformers", "pyarrow", "pydantic", "yaml")


def missing() -> list[str]:
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def main() -> int:
    lacking = missing()
    if lacking:
        print(
            f"rlsys: the cluster runs this job with {sys.executable} (Python {platform.python_version()}), which "
            f"cannot import {', '.join(lacking)}: start the cluster from the environment rlsys is installed in "
            f"(`source .venv/bin/activate && ray start --head`, so that its python comes first on PATH)",
            file=sys.stderr,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
