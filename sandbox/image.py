"""The sandbox root filesystem (debootstrap, cached by its recipe) and the engine image
made from it (imported through the Docker Engine API, so Docker and podman alike)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SUITE, VARIANT = "bookworm", "minbase"
PACKAGES = ("python3-minimal", "python3")
MIRROR = "http://deb.debian.org/debian"
RECIPE_VERSION = 1  # bump when the post-processing below changes
COMPLETE = ".rlsys-rootfs-complete"
IMAGE = "rlsys-sandbox:py3"


def default_cache_dir() -> Path:
    return Path(os.environ.get("RLSYS_SANDBOX_CACHE", "/var/cache/rlsys-sandbox"))


def rootfs_key(mirror: str = MIRROR) -> str:
    recipe = [SUITE, VARIANT, sorted(PACKAGES), mirror, RECIPE_VERSION]
    return hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:12]


def build_rootfs(cache_dir: Path | None = None, mirror: str = MIRROR, log=print) -> Path:
    """The cached root filesystem for this recipe, built with debootstrap if missing.
    Safe against concurrent builders (a lock) and interrupted builds (built aside, then
    renamed into place)."""
    cache = Path(cache_dir or default_cache_dir())
    cache.mkdir(parents=True, exist_ok=True)
    key = rootfs_key(mirror)
    final = cache / f"rootfs-{key}"
    with open(cache / f"rootfs-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / COMPLETE).exists():
            log(f"sandbox rootfs: cached at {final}")
            return final
        build = cache / f"build-{key}"
        shutil.rmtree(build, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        log(f"sandbox rootfs: debootstrap {SUITE} ({VARIANT}, {', '.join(PACKAGES)}) into {build}")
        subprocess.run(
            ["debootstrap", f"--variant={VARIANT}", f"--include={','.join(PACKAGES)}", SUITE, str(build), mirror],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        finish_rootfs(build)
        os.rename(build, final)
    log(f"sandbox rootfs: built at {final}")
    return final


def finish_rootfs(root: Path) -> None:
    """Mount points the backends need, no package caches, a neutral hostname."""
    # 1777: a container's tmpfs on /work copies this mode, and jobs run as nobody.
    (root / "work").mkdir(exist_ok=True)
    os.chmod(root / "work", 0o1777)
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for p in (root / junk).glob("*"):
            if p.is_file():
                p.unlink()
    (root / "etc/hostname").write_text("sandbox\n")
    (root / COMPLETE).write_text(rootfs_key() + "\n")


def import_image(rootfs: Path, base_url: str | None = None, tag: str = IMAGE, force: bool = False, log=print) -> str:
    """Import `rootfs` into the engine as `tag` unless it is there already."""
    import docker

    base_url = base_url or os.environ.get("DOCKER_HOST")
    client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
    try:
        if not force:
            try:
                client.images.get(tag)
                log(f"sandbox image: {tag} already in the engine")
                return tag
            except docker.errors.ImageNotFound:
                pass
        with tempfile.TemporaryDirectory(prefix="rlsys-image-") as tmp:
            tarball = Path(tmp) / "rootfs.tar"
            subprocess.run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
            # The API allows the tag inside `repo`; podman's service ignores a separate `tag`.
            client.api.import_image(src=str(tarball), repository=tag)
        client.images.get(tag)  # raises if the import did not land
        log(f"sandbox image: imported {rootfs} as {tag}")
        return tag
    finally:
        client.close()
