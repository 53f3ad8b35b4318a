"""Weight sync through shared memory, for rollout workers on learner rank 0's node
(`trainer.weight_sync: shared_memory`, and what `auto` picks there).

Learner rank 0 keeps a file in /dev/shm holding two copies ("slots") of the policy's
state dict, each tensor in the learner's dtype (bf16 too, which numpy lacks: such entries are
read as torch views) at a 64-byte aligned offset. After an optimizer step it copies its
weights into slot `version % 2`; a worker maps the file and points its model's parameters
at the slot's arrays (no copy, as with the object store's read-only buffers). Only a
version number and the slot travel through Ray, so a sync costs one memory copy on the
learner and two small actor calls, not a serialization into the object store and back.

Each slot has its checksums after the slots (an xxh3-64 per tensor, written after the tensors):
a worker verifies the slot against them before it loads it (`verify`).

Two slots let the workers serve version v from one while the learner writes v + 1 into
the other (`trainer.mode: overlap`); the learner writes v + 2 over v's slot once every worker's
load of v + 1 has finished (`SharedMemorySync.train_slot` in rlsys/run/weight_sync.py hands it
those loads). A file outlives a killed learner: the next
learner on the node removes files whose owner process is gone (`remove_stale`), and the
controller removes its own at shutdown.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlsys.weight_digest import first_mismatch, tensor_hash

SHM_DIR = Path("/dev/shm")
SLOTS = 2
ALIGN = 64
BF16 = "bfloat16"  # a layout's dtype string for bf16 (every other dtype: numpy's, e.g. "<f4")
BF16_BITS = np.int16  # numpy has no bfloat16: its 2-byte values travel and are mapped as these
_NAME = re.compile(r"^rlsys-weights-(\d+)-")


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy()


def bf16_from_bits(bits: np.ndarray) -> torch.Tensor:
    """The bf16 tensor whose 2-byte values `bits` holds (a view, no copy)."""
    return torch.from_numpy(bits).view(torch.bfloat16)


def layout_dtype(t: torch.Tensor | np.ndarray) -> str:
    if isinstance(t, np.ndarray):
        return t.dtype.str
    return BF16 if t.dtype == torch.bfloat16 else torch.empty(0, dtype=t.dtype).numpy().dtype.str


@dataclass(frozen=True)
class SharedLayout:
    """Where each tensor of one slot lies in the file: (name, shape, dtype string, byte offset).
    Names given the same object (tied weights, as `tied_state_dict` and `state_dict_numpy`
    give them) share one offset: the tensor is stored and written once."""

    path: str
    slot_bytes: int
    entries: tuple[tuple[str, tuple[int, ...], str, int], ...]

    @classmethod
    def of(cls, path: str | Path, tensors: dict[str, torch.Tensor | np.ndarray]) -> "SharedLayout":
        entries, placed, offset = [], {}, 0  # placed: id of an object already given an offset -> that offset
        for name, t in tensors.items():
            if id(t) in placed:
                entries.append((name, tuple(t.shape), layout_dtype(t), placed[id(t)]))
                continue
            entries.append((name, tuple(t.shape), layout_dtype(t), offset))
            placed[id(t)] = offset
            offset += -(-t.nbytes // ALIGN) * ALIGN
        return cls(str(path), max(offset, ALIGN), tuple(entries))

    @property
    def digest_bytes(self) -> int:
        """Bytes of one slot's checksums: an xxh3-64 per entry (rlsys/weight_digest.py)."""
        return -(-8 * len(self.entries) // ALIGN) * ALIGN

    @property
    def file_bytes(self) -> int:
        return SLOTS * (self.slot_bytes + self.digest_bytes)


def shm_path(policy: str) -> Path:
    """This process's file for `policy`: the pid in the name lets `remove_stale` find files of dead owners."""
    return SHM_DIR / f"rlsys-weights-{os.getpid()}-{re.sub(r'[^A-Za-z0-9_.-]', '_', policy)}"


def shm_free_bytes() -> int:
    """Bytes free in /dev/shm (0 where there is none)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def remove_stale(directory: Path = SHM_DIR) -> list[Path]:
    """Delete weight files whose owner process no longer exists (a learner killed without its
    controller's shutdown); returns what was removed."""
    removed = []
    for path in directory.glob("rlsys-weights-*"):
        m = _NAME.match(path.name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # the owner is alive (or another user's: PermissionError below)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    return removed


class SharedWeights:
    """One process's mapping of a weights file: the learner creates and writes it, workers read it."""

    def __init__(self, layout: SharedLayout, create: bool = False):
        self.layout = layout
        if create:
            with open(layout.path, "wb") as f:
                f.truncate(layout.file_bytes)
        elif os.path.getsize(layout.path) != layout.file_bytes:
            raise ValueError(
                f"shared weights file {layout.path} is {os.path.getsize(layout.path)} bytes, "
                f"the layout needs {layout.file_bytes}"
            )
        self.buffer = np.memmap(layout.path, dtype=np.uint8, mode="r+", shape=(layout.file_bytes,))
        self._views: dict[int, dict[str, np.ndarray]] = {}

    def arrays(self, slot: int) -> dict[str, np.ndarray | torch.Tensor]:
        """The slot's tensors as views of the mapping (valid while this object lives): numpy
        arrays, bf16 entries as torch tensors."""
        if not 0 <= slot < SLOTS:
            raise ValueError(f"slot {slot} (the file has {SLOTS})")
        if slot not in self._views:
            self._views[slot] = self._slot_views(slot)
        return self._views[slot]

    def _slot_views(self, slot: int) -> dict[str, np.ndarray | torch.Tensor]:
        base = slot * self.layout.slot_bytes
        out = {}
        for name, shape, dtype, offset in self.layout.entries:
            dt = np.dtype(BF16_BITS if dtype == BF16 else dtype)
            count = int(np.prod(shape, dtype=np.int64))
            start = base + offset
            view = self.buffer[start : start + count * dt.itemsize].view(dt).reshape(shape)
            out[name] = bf16_from_bits(view) if dtype == BF16 else view
        return out

    def _stored_digest(self, slot: int) -> np.ndarray:
        """The slot's checksums (uint64 per entry), a view of the mapping after the slots."""
        start = SLOTS * self.layout.slot_bytes + slot * self.layout.digest_bytes
        return self.buffer[start : start + 8 * len(self.layout.entries)].view(np.uint64)

    def verify(self, slot: int) -> str | None:
        """The first tensor of `slot` whose bytes differ from the checksum its writer stored, or None."""
        stored = dict(zip((name for name, *_ in self.layout.entries), self._stored_digest(slot).tolist()))
        return first_mismatch(stored, self.arrays(slot))

    def write(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copy `tensors` (by layout name; any device, cast to the layout's dtype) into `slot`,
        then the checksums of what the slot now holds."""
        views = self.arrays(slot)
        missing = [name for name in views if name not in tensors]
        if missing:
            raise KeyError(f"shared weights: no tensor for {missing[:3]} ({len(missing)} missing)")
        written = set()
        with torch.no_grad():
            for name, _, _, offset in self.layout.entries:
                if offset not in written:  # a tied name's tensor is already there
                    view = views[name] if isinstance(views[name], torch.Tensor) else torch.from_numpy(views[name])
                    view.copy_(tensors[name].detach().reshape(view.shape))
                    written.add(offset)
        self._stored_digest(slot)[:] = [tensor_hash(views[name]) for name, *_ in self.layout.entries]

    def close(self, unlink: bool = False) -> None:
        self.buffer, self._views = None, {}
        if unlink:
            Path(self.layout.path).unlink(missing_ok=True)
