"""Dataset readers: jsonl and parquet rows, checked against the fields a task needs.

`read_rows`: the built-in tasks' files, read with pyarrow and json. `load_rows`: a user's
dataset (task.name=dataset), read with the `datasets` library from a .jsonl, .json or .parquet
file or a directory written by `Dataset.save_to_disk`, never from the network.
A bad row fails with one line naming the file, the row number and the problem.
"""

from __future__ import annotations

import json
import os
import tempfile
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


DATASET_FORMATS = (".jsonl", ".json", ".parquet")


def load_rows(path: str | Path) -> list[dict]:
    """Every row of a .jsonl/.json/.parquet file or a `save_to_disk` directory, as dicts."""
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset {path} does not exist")
    if not path.is_dir() and path.suffix not in DATASET_FORMATS:
        raise DatasetError(
            f"dataset {path}: unsupported format '{path.suffix}' "
            f"(use {', '.join(DATASET_FORMATS)} or a directory written by Dataset.save_to_disk)"
        )
    try:
        rows = _hf_read(path)
    except DatasetError:
        raise
    except Exception as e:  # the datasets library's and pyarrow's errors: name the row where we can
        raise DatasetError(json_problem(path) or f"dataset {path} is not readable ({one_line(e)})") from None
    if not rows:
        raise DatasetError(f"dataset {path} has no rows")
    return rows


def _hf_read(path: Path) -> list[dict]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # read before `datasets` is first imported
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import datasets  # ~1 s to import (pandas): only a dataset task pays it

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if path.is_dir():
        if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
            raise DatasetError(f"dataset {path} is not a directory written by Dataset.save_to_disk")
        data = datasets.load_from_disk(str(path), keep_in_memory=True)
        if isinstance(data, datasets.DatasetDict):
            raise DatasetError(
                f"dataset {path} holds several splits ({', '.join(data)}): point at one of them, "
                f"e.g. {path / next(iter(data))}"
            )
        return data.to_list()
    builder = "parquet" if path.suffix == ".parquet" else "json"
    with tempfile.TemporaryDirectory(prefix="rlsys-datasets-") as cache:  # nothing left in ~/.cache
        data = datasets.load_dataset(builder, data_files=str(path), split="train", keep_in_memory=True, cache_dir=cache)
        return data.to_list()


def json_problem(path: Path) -> str | None:
    """The first unparsable line (.jsonl) or the parse error (.json) of a JSON dataset, or a row
    that is not an object, as one line; None when the file parses (or is not JSON)."""
    if path.suffix not in (".jsonl", ".json"):
        return None
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            return f"dataset {path} line {e.lineno}: not valid JSON ({e.msg})"
        items = data if isinstance(data, list) else [data]
    else:
        items = []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as e:
                return f"dataset {path} line {i}: not valid JSON ({e.msg})"
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict):
            return f"dataset {path} row {i}: expected an object, got {type(item).__name__}"
    return None


def one_line(error: Exception) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."
