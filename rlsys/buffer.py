"""ExperienceBuffer: Experience tables held as pyarrow, shared by all algorithms.

Used in-process or as a Ray actor (`ray.remote(ExperienceBuffer)`). Rows older than
`max_staleness` policy versions behind the current one are dropped when taken or
sampled (0 means strictly on-policy: only rows of the current version).

Under `trainer.mode: async` rows come and go as whole batches (`put_batch` / `take_batch`, oldest
first): a batch is one rollout call's rows, whose groups are only whole together.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rlsys.experience import EXPERIENCE_SCHEMA, concat_experience, send_tables_as_ipc, validate_experience


class ExperienceBuffer:
    def __init__(self, capacity: int = 100_000, max_staleness: int | None = None, seed: int = 0):
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.table = EXPERIENCE_SCHEMA.empty_table()
        self.version = 0
        self.rng = np.random.default_rng(seed)
        self.dropped_stale = 0
        self.batch_rows: list[int] = []  # rows of each batch held, oldest first (put_batch)
        self.dropped_batches = 0
        send_tables_as_ipc()  # as a Ray actor, `take` and `sample` send tables back

    def set_policy_version(self, version: int) -> None:
        self.version = version

    def put(self, table: pa.Table) -> int:
        validate_experience(table)
        self.table = concat_experience([self.table, table])
        if self.table.num_rows > self.capacity:  # oldest rows go first
            self.table = self.table.slice(self.table.num_rows - self.capacity)
        return self.table.num_rows

    def put_batch(self, table: pa.Table) -> int:
        """Hold one batch (async mode); the number of batches held."""
        validate_experience(table)
        if table.num_rows == 0:
            raise ValueError("a rollout batch of 0 rows: the algorithm's rollout sampled nothing")
        self.table = concat_experience([self.table, table])
        self.batch_rows.append(table.num_rows)
        return len(self.batch_rows)

    def take_batch(self) -> tuple[pa.Table | None, int]:
        """Remove and return the oldest batch (None when none is left), after dropping the batches
        that hold a row more than `max_staleness` versions behind; with how many it dropped."""
        dropped = 0
        while self.batch_rows:
            n = self.batch_rows.pop(0)
            out, self.table = self.table.slice(0, n), self.table.slice(n)
            oldest = pc.min(out.column("policy_version")).as_py()
            if self.max_staleness is None or oldest is None or oldest >= self.version - self.max_staleness:
                return out, dropped
            dropped += 1
            self.dropped_batches += 1
            self.dropped_stale += n
        return None, dropped

    def batches(self) -> int:
        return len(self.batch_rows)

    def _drop_stale(self) -> None:
        if self.max_staleness is None or self.table.num_rows == 0:
            return
        keep = pc.greater_equal(self.table.column("policy_version"), self.version - self.max_staleness)
        before = self.table.num_rows
        self.table = self.table.filter(keep)
        self.dropped_stale += before - self.table.num_rows

    def take(self, n: int | None = None) -> pa.Table:
        """Remove and return the oldest n rows (all when n is None)."""
        self._drop_stale()
        n = self.table.num_rows if n is None else min(n, self.table.num_rows)
        out, self.table = self.table.slice(0, n), self.table.slice(n)
        return out

    def sample(self, n: int, strategy: str = "uniform") -> pa.Table:
        """Return n rows without removing them: `uniform` (with replacement), or `latest`."""
        self._drop_stale()
        size = self.table.num_rows
        if size == 0:
            return self.table
        if strategy == "uniform":
            return self.table.take(pa.array(self.rng.integers(0, size, n)))
        if strategy == "latest":
            return self.table.slice(max(0, size - n))
        raise ValueError(f"unknown sample strategy '{strategy}' (uniform, latest)")

    def size(self) -> int:
        return self.table.num_rows

    def stats(self) -> dict:
        return {
            "size": self.table.num_rows,
            "batches": len(self.batch_rows),
            "dropped_stale": self.dropped_stale,
            "dropped_batches": self.dropped_batches,
            "version": self.version,
        }

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        counts = {b"batch_rows": self.batch_rows, b"dropped_batches": self.dropped_batches}
        metadata = {**(self.table.schema.metadata or {}), **{k: json.dumps(v).encode() for k, v in counts.items()}}
        pq.write_table(self.table.replace_schema_metadata(metadata), tmp)
        os.replace(tmp, path)

    def load(self, path: str | os.PathLike) -> int:
        table = pq.read_table(path)
        validate_experience(table)
        batch_rows = json.loads((table.schema.metadata or {}).get(b"batch_rows", b"[]"))
        if sum(batch_rows) not in (0, table.num_rows):
            raise ValueError(f"{path}: its batches hold {sum(batch_rows)} rows, the table {table.num_rows}")
        self.table, self.batch_rows = table.replace_schema_metadata(None), batch_rows
        self.dropped_batches = json.loads((table.schema.metadata or {}).get(b"dropped_batches", b"0"))
        return table.num_rows

    def rng_state(self) -> dict:
        return self.rng.bit_generator.state

    def set_rng_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state
