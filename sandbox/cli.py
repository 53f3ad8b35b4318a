"""`sandbox run FILE` and `sandbox image` (the rlsys CLI mounts these as `rlsys sandbox`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .backends import make_backend
from .image import build_rootfs, import_image
from .types import ExecRequest, Limits


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sandbox", description="Run code in the rlsys sandbox.")
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run a Python file; print the ExecResult as one JSON object")
    run.add_argument("file", help="Python source file ('-' for stdin)")
    run.add_argument("--backend", choices=["bwrap", "docker"], default="bwrap")
    run.add_argument("--isolation", choices=["warm", "fresh"], default="warm", help="docker only")
    run.add_argument("--timeout", type=float, default=10.0, help="wall time limit, seconds")
    run.add_argument("--memory", type=int, default=512, help="memory limit, MB")
    run.add_argument("--stdin", help="file whose bytes the program reads on stdin")
    img = sub.add_parser("image", help="build the root filesystem (cached) and import it into the engine")
    img.add_argument("--cache-dir", type=Path, help="default $RLSYS_SANDBOX_CACHE or /var/cache/rlsys-sandbox")
    img.add_argument("--docker-host", help="engine socket, default $DOCKER_HOST")
    img.add_argument("--rootfs-only", action="store_true", help="build the root filesystem, import nothing")
    img.add_argument("--force", action="store_true", help="import even if the image exists")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "image":
        say = lambda msg: print(msg, file=sys.stderr)  # noqa: E731 - stdout carries the result
        rootfs = build_rootfs(args.cache_dir, log=say)
        print(f"RLSYS_SANDBOX_ROOTFS={rootfs}")
        if not args.rootfs_only:
            print(f"RLSYS_SANDBOX_IMAGE={import_image(rootfs, args.docker_host, force=args.force, log=say)}")
        return 0
    try:
        code = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
        stdin = Path(args.stdin).read_bytes() if args.stdin else b""
    except OSError as e:
        print(f"sandbox: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    limits = Limits(wall_time_s=args.timeout, cpu_time_s=args.timeout, memory_mb=args.memory)
    config = {"isolation": args.isolation} if args.backend == "docker" else {}
    try:
        backend = make_backend(args.backend, **config)
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        print(
            f"sandbox: the {args.backend} backend is unusable: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
            file=sys.stderr,
        )
        return 2
    try:
        result = backend.run(ExecRequest(code, stdin=stdin, limits=limits, id=os.path.basename(args.file)))
    finally:
        backend.close()
    print(json.dumps(result.to_dict()))
    return 0 if result.status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
