"""Dataset readers: jsonl and parquet rows, checked against the fields a task needs.

A bad row fails with one line naming the file, the row number and the problem.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq


class DatasetError(ValueError):
    pass


def read_rows(path: str | Path, required: Sequence[str] = ()) -> list[dict]:
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {path} does not exist")
    if path.suffix == ".parquet":
        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowInvalid, OSError) as e:
            raise DatasetError(f"dataset {path} is not a readable parquet file ({e})") from None
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"dataset {path} line {i}: not valid JSON ({e.msg})") from None
            rows.append(row)
    else:
        raise DatasetError(f"dataset {path}: unsupported format '{path.suffix}' (use .jsonl or .parquet)")
    for i, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DatasetError(f"dataset {path} row {i}: expected an object, got {type(row).__name__}")
        for key in required:
            if key not in row or row[key] is None:
                raise DatasetError(f"dataset {path} row {i}: missing field '{key}'")
    if not rows:
        raise DatasetError(f"dataset {path} has no rows")
    return rows


def write_rows(rows: Iterable[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = list(rows)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
