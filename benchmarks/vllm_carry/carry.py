"""The wheel set that carries vllm 0.26.0 to the GPU machine, and the steps of prepare.sh.

The GPU image has torch 2.11.0+cu130 and no vllm; vllm 0.20-0.26 pin exactly that torch and are
built for CUDA 13.0 (../shared/notes/vllm-on-the-gpu-machine.md has the measurements). One
device command carries 64 MiB, so the set is cut to what a dense model on Hopper needs and split
into chunks of at most 60 MiB:

    pin REPORT          wheels.txt from pip's resolver report for the GPU platform: every wheel
                        of vllm's closure that the image lacks (IMAGE_PACKAGES), less OPTIONAL,
                        as `name==version --hash=sha256:...` (pip checks the hashes on download)
    verify DIR          DIR holds exactly the pinned wheels, each with its pinned hash
    trim WHEEL          drops TRIMMED_MEMBERS from the vllm wheel (and their RECORD lines)
    pack DIR OUT        DIR's wheels as one tar (sorted, zero times and owners: the same bytes for
                        the same wheels), split into OUT/part-NN of CHUNK_BYTES, and OUT/lean.sha256

Standard library only: prepare.sh runs it with the system python3.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import re
import sys
import tarfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PINNED = HERE / "wheels.txt"
CHUNK_BYTES = 60 * 2**20  # a device command carries 64 MiB, the repository's files included
TAR_NAME = "lean.tar"

# the GPU image's packages ('cuda', read 2026-11-17; /work/.library/device/KINDS.md)
IMAGE_PACKAGES = (HERE / "image_packages.txt").read_text().split()

# optional for a dense model on Hopper: imported inside functions or try blocks, or only by MoE/FP8/
# Blackwell kernels, video decoding and JIT compilers (the note's "Lean set" has the evidence)
OPTIONAL = {
    "cuda-python",
    "humming-kernels",
    "kernels",
    "nvidia-cuda-cccl",
    "nvidia-cuda-crt",
    "nvidia-cuda-nvcc",
    "nvidia-cuda-nvdisasm",
    "nvidia-cutlass-dsl",
    "nvidia-cutlass-dsl-libs-base",
    "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12",
    "nvidia-cutlass-dsl-libs-cu13",
    "nvidia-nvvm",
    "pynvvideocodec",
    "quack-kernels",
    "tilelang",
    "tokenspeed-mla",
    "tokenspeed-triton",
    "torchcodec",
    "z3-solver",
}

# members of the vllm wheel a Hopper run never loads: FlashAttention-2 (FA3 is picked for
# compute capability 9.x; its import is guarded) and the Rust front end (VLLM_RUST_FRONTEND_PATH only)
TRIMMED_MEMBERS = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs")


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pin(report: dict) -> list[str]:
    """wheels.txt's lines from a `pip install --dry-run --report` of vllm for the GPU platform."""
    image = {canonical(n) for n in IMAGE_PACKAGES}
    lines = []
    for item in sorted(report["install"], key=lambda i: canonical(i["metadata"]["name"])):
        name = canonical(item["metadata"]["name"])
        if name in image or name in OPTIONAL:
            continue
        url = item["download_info"]["url"]
        sha = item["download_info"]["archive_info"]["hashes"]["sha256"]
        lines.append(f"{name}=={item['metadata']['version']} --hash=sha256:{sha}  # {url.rsplit('/', 1)[-1]}")
    return lines


def pinned(path: Path = PINNED) -> dict[str, tuple[str, str]]:
    """wheel file name -> (distribution, sha256) of the pinned list."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            spec, _, filename = line.partition("  # ")
            out[filename.strip()] = (spec.split("==")[0], spec.split("--hash=sha256:")[1].strip())
    return out


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(directory: Path, wheels: dict[str, tuple[str, str]]) -> list[str]:
    """What differs between `directory` and the pinned `wheels`: missing, extra, wrong hash ([] when equal)."""
    present = {p.name for p in Path(directory).glob("*.whl")}
    problems = [f"missing {name}" for name in sorted(set(wheels) - present)]
    problems += [f"not pinned {name}" for name in sorted(present - set(wheels))]
    for name in sorted(present & set(wheels)):
        if sha256(Path(directory) / name) != wheels[name][1]:
            problems.append(f"hash differs {name}")
    return problems


def trim(wheel: Path, members: tuple[str, ...] = TRIMMED_MEMBERS) -> int:
    """Rewrite `wheel` without `members` (a name ending in `/` or naming a folder drops what is in
    it) and without their RECORD lines; returns the bytes saved."""
    before = wheel.stat().st_size
    dropped = lambda name: any(name == m or name.startswith(m.rstrip("/") + "/") for m in members)
    buffer = io.BytesIO()
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if dropped(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [line for line in data.decode().splitlines() if not dropped(line.split(",")[0])]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data, compress_type=info.compress_type)
    wheel.write_bytes(buffer.getvalue())
    return before - wheel.stat().st_size


def pack(directory: Path, out: Path, chunk_bytes: int = CHUNK_BYTES) -> tuple[list[Path], str]:
    """`directory`'s wheels as one reproducible tar cut into `out`/part-NN; writes `out`/lean.sha256
    (`sha256sum -c` form, for the tar reassembled from the parts). Returns the parts and the digest."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("part-*"):
        old.unlink()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(Path(directory).glob("*.whl")):
            info = tarfile.TarInfo(path.name)
            info.size, info.mtime, info.mode = path.stat().st_size, 0, 0o644
            with open(path, "rb") as f:
                tar.addfile(info, f)
    data = buffer.getvalue()
    parts = []
    for i in range(0, len(data), chunk_bytes):
        parts.append(out / f"part-{i // chunk_bytes:02d}")
        parts[-1].write_bytes(data[i : i + chunk_bytes])
    digest = hashlib.sha256(data).hexdigest()
    (out / "lean.sha256").write_text(f"{digest}  {TAR_NAME}\n")
    return parts, digest


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pin").add_argument("report", type=Path)
    sub.add_parser("verify").add_argument("directory", type=Path)
    sub.add_parser("trim").add_argument("wheel", type=Path)
    p = sub.add_parser("pack")
    p.add_argument("directory", type=Path)
    p.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "pin":
        lines = pin(json.loads(args.report.read_text()))
        header = "# vllm 0.26.0 for the GPU image (Python 3.12, manylinux x86_64): written by carry.py pin\n"
        PINNED.write_text(header + "\n".join(lines) + "\n")
        print(f"carry: pinned {len(lines)} wheels to {PINNED}")
    elif args.command == "verify":
        problems = verify(args.directory, pinned())
        print(
            f"carry: {args.directory}: " + ("; ".join(problems) if problems else f"the {len(pinned())} pinned wheels")
        )
        return 1 if problems else 0
    elif args.command == "trim":
        print(f"carry: {args.wheel.name} is {trim(args.wheel) / 2**20:.1f} MiB smaller")
    else:
        parts, digest = pack(args.directory, args.out)
        sizes = ", ".join(f"{p.name} {p.stat().st_size / 2**20:.1f} MiB" for p in parts)
        print(f"carry: {len(parts)} parts ({sizes}); sha256 {digest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
