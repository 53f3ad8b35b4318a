"""Atomic checkpoints: `runs/<name>/checkpoints/step_<N>/` and a `latest` pointer.

A checkpoint is written into a hidden temporary folder, every file fsynced, a manifest
(relative path -> size) written last, then the folder renamed into place; only then does
`latest` move (itself replaced atomically). Loading checks the manifest first, so a
checkpoint cut short or damaged is reported in one line and the previous one is used.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    pass


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for d in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def staging_dir(ckpt_root: Path, step: int) -> Path:
    tmp = ckpt_root / f".tmp_step_{step}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(ckpt_root: Path, tmp: Path, step: int, keep: int) -> Path:
    """Manifest, fsync, rename into place, move `latest`, prune to the newest `keep`."""
    files = {str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
    _fsync_tree(tmp)
    final = ckpt_root / f"step_{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = ckpt_root / ".latest.tmp"
    pointer.write_text(final.name)
    with open(pointer, "rb") as f:
        os.fsync(f.fileno())
    os.replace(pointer, ckpt_root / "latest")
    for old in list_checkpoints(ckpt_root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Committed checkpoint folders, oldest first."""
    if not ckpt_root.exists():
        return []
    dirs = [p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[5:]))


def verify(path: Path) -> dict:
    """The manifest of a complete checkpoint; CheckpointError naming the first problem."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        raise CheckpointError(f"checkpoint {path.name} is incomplete (no {MANIFEST})")
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"checkpoint {path.name} has an unreadable {MANIFEST}") from None
    for rel, size in manifest["files"].items():
        f = path / rel
        if not f.exists():
            raise CheckpointError(f"checkpoint {path.name} is missing {rel}")
        if f.stat().st_size != size:
            raise CheckpointError(f"checkpoint {path.name}: {rel} is {f.stat().st_size} bytes, expected {size}")
    return manifest


def candidates(ckpt_root: Path) -> list[Path]:
    """Checkpoints to try, newest first: the one `latest` names, then older ones."""
    found = list_checkpoints(ckpt_root)
    pointer = ckpt_root / "latest"
    latest = ckpt_root / pointer.read_text().strip() if pointer.exists() else None
    ordered = sorted(found, key=lambda p: int(p.name[5:]), reverse=True)
    if latest is not None and latest in ordered:
        ordered.remove(latest)
        ordered.insert(0, latest)
    return ordered
