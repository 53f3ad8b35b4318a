"""benchmarks/agents.py's table and counts: the well-formed share of the calls, the ratio over the
one-at-a-time mode, and which episodes wrote different token ids."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

from envs.tools import ToolCounts

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("agents_bench", ROOT / "benchmarks" / "agents.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def episode(ids, turns=2, **statuses):
    counts = ToolCounts()
    counts.counts.update(statuses)
    return SimpleNamespace(conversation=SimpleNamespace(ids=ids), turns=turns, tool_counts=counts)


def test_the_table_has_each_modes_counts_and_the_ratio_over_one_at_a_time():
    assert bench.well_formed_share({"ok": 3, "malformed": 1}) == 0.75
    assert bench.well_formed_share({}) == 0.0
    side = [episode([1, 2], ok=1), episode([1, 3], malformed=1, ok=1)]
    alone = [episode([1, 2], ok=1), episode([1, 4], turns=3, malformed=1, ok=1)]
    rows = [
        bench.mode_row("side by side", side, [True, False], 2.0, {"generate": 0.5, "sandbox": 1.0}, [2, 1, 1]),
        bench.mode_row("one at a time", alone, [True, False], 4.0, {"generate": 1.5, "sandbox": 1.0}, [1] * 5),
    ]
    lines = bench.table(rows).splitlines()
    assert lines[2] == (
        "| side by side | 2 | 2.00 | 1.00 | 3 (1.3) | 0.50 | 1.00 | 4 | 3 (malformed 1, ok 2) | 0.67 | 1/2 | 2.00x |"
    )
    assert lines[3].startswith("| one at a time | 2 | 4.00 | 0.50 | 5 (1.0) | 1.50 | 1.00 | 5 | 3 ")
    assert lines[3].endswith("| 1.00x |")
    assert bench.same_transcripts(side, alone) == (1, [1])
    assert bench.same_transcripts(side, side) == (2, [])
