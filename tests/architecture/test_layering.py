"""The import rules, checked on every import of our own code (module-level and inside functions).

- an actor (actors.*) never imports an algorithm (algorithms.*): a new algorithm needs no actor change;
- an algorithm never imports an actor: what both need (rlsys/logprobs.py, rlsys/contract.py) is in the floor;
- only the roof (rlsys.run.*) imports the roof: rlsys/*.py is the floor every part stands on;
- sandbox.* imports nothing of ours outside sandbox.*: it runs (and is reviewed) on its own;
- no import cycle between files (an import of a package is an edge to its __init__.py);
- an import of our code inside a function carries a one-line reason (a `#` comment on its line,
  its last line, or the line above): why it is lazy.

The checker is a few pure functions over a root folder, so the tests below also plant each
violation in a tiny tree and see it reported.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rlsys", "actors", "algorithms", "envs", "sandbox")


class Import(NamedTuple):
    src: str  # importing module, e.g. "actors.learner" ("actors" for actors/__init__.py)
    dst: str  # imported module of ours (a package means its __init__.py)
    where: str  # "path:line"
    lazy: bool  # inside a function or method
    reason: bool  # a reason comment on its line, its last line or the line above


def modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `packages` under `root`."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is one of our modules (None: not our code)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return None


def _has_reason(comment: str) -> bool:
    """A comment that says something beyond a lint directive (`noqa: F401`, `type: ignore`)."""
    text = re.sub(r"noqa(:\s*[A-Z]+\d+(\s*,\s*[A-Z]+\d+)*)?|type:\s*ignore(\[[^]]*\])?", "", comment)
    return bool(re.search(r"[A-Za-z]{2}", text))


def _comment(line: str) -> str:
    return line.split("#", 1)[1] if "#" in line else ""


def scan(root: Path, packages=PACKAGES) -> list[Import]:
    """Every import of our own code in `packages`, relative imports resolved."""
    known = modules(root, packages)
    found = []
    for mod, path in known.items():
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines), str(path))
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]  # for `from . import`
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                prefix = ".".join(base[: len(base) - node.level + 1] if node.level else [])
                head = ".".join(p for p in (prefix, node.module) if p)
                names = [f"{head}.{a.name}" if f"{head}.{a.name}" in known else head for a in node.names]
            else:
                continue
            up, lazy = node, False
            while up in parents:
                up = parents[up]
                lazy |= isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
            reason = _has_reason(_comment(lines[node.lineno - 1]) + _comment(lines[node.end_lineno - 1])) or (
                above.startswith("#") and _has_reason(above[1:])
            )
            where = f"{path.relative_to(root)}:{node.lineno}"
            for dst in dict.fromkeys(filter(None, (_resolve(n, known) for n in names))):
                if dst != mod:
                    found.append(Import(mod, dst, where, lazy, reason))
    return sorted(found, key=lambda i: (i.where.split(":")[0], int(i.where.split(":")[1])))


def _under(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def _line(imp: Import, why: str) -> str:
    return f"{imp.where}: {imp.src} imports {imp.dst} ({why})"


def actors_import_algorithms(imports: list[Import]) -> list[str]:
    return [
        _line(i, "an actor imports an algorithm")
        for i in imports
        if _under(i.src, "actors") and _under(i.dst, "algorithms")
    ]


def algorithms_import_actors(imports: list[Import]) -> list[str]:
    return [
        _line(i, "an algorithm imports an actor")
        for i in imports
        if _under(i.src, "algorithms") and _under(i.dst, "actors")
    ]


def floor_imports_roof(imports: list[Import]) -> list[str]:
    return [
        _line(i, "only rlsys.run imports the roof rlsys.run")
        for i in imports
        if _under(i.dst, "rlsys.run") and not _under(i.src, "rlsys.run")
    ]


def sandbox_imports_outside(imports: list[Import]) -> list[str]:
    return [
        _line(i, "sandbox imports nothing of ours outside sandbox")
        for i in imports
        if _under(i.src, "sandbox") and not _under(i.dst, "sandbox")
    ]


def lazy_without_reason(imports: list[Import]) -> list[str]:
    return [
        _line(i, "import inside a function without a one-line # reason") for i in imports if i.lazy and not i.reason
    ]


def cycles(imports: list[Import]) -> list[str]:
    """The shortest import cycle through each module on one, as a chain `a -> b -> a` with the
    place of each edge (each cycle once)."""
    edges: dict[str, dict[str, str]] = {}
    for i in imports:
        edges.setdefault(i.src, {}).setdefault(i.dst, i.where)
    out = set()
    for start in edges:
        came_from, frontier = {}, [start]  # breadth first, until back at start
        while frontier and start not in came_from:
            reached = [(a, w) for a in frontier for w in edges.get(a, {}) if w not in came_from]
            for a, w in reached:
                came_from.setdefault(w, a)  # the first way there is a shortest one
            frontier = [w for _, w in reached]
        if start not in came_from:
            continue
        chain = [came_from[start]]
        while chain[-1] != start:
            chain.append(came_from[chain[-1]])
        chain = chain[::-1]  # start -> ... -> the module that imports start
        first = chain.index(min(chain))
        chain = chain[first:] + chain[:first] + [min(chain)]  # the same cycle reads the same way
        places = ", ".join(edges[x][y] for x, y in zip(chain, chain[1:]))
        out.add(f"import cycle: {' -> '.join(chain)} ({places})")
    return sorted(out)


RULES = [
    actors_import_algorithms,
    algorithms_import_actors,
    floor_imports_roof,
    sandbox_imports_outside,
    cycles,
    lazy_without_reason,
]


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    found = scan(ROOT)
    assert len(found) > 200 and sum(i.lazy for i in found) > 20, "the scan found too little"
    return found


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.__name__)
def test_layering(rule, imports):
    violations = rule(imports)
    assert not violations, f"{len(violations)} violation(s) of {rule.__name__}:\n" + "\n".join(violations)


PLANTED = {  # a tiny tree with each violation planted (and imports that are fine)
    "actors/__init__.py": "",
    "actors/modeling.py": "",
    "actors/worker.py": """\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from algorithms import grpo


        def start():
            try:
                from algorithms.grpo import loss  # reasoned, still forbidden
            except ImportError:
                pass
        """,
    "algorithms/__init__.py": "",
    "algorithms/grpo.py": "from rlsys import batch\n\ndef loss(): ...\n",
    "algorithms/sft.py": "from actors.modeling import forward_logprobs\n",
    "rlsys/__init__.py": "",
    "rlsys/batch.py": "from .run import loop\n",  # relative: rlsys.run.loop
    "rlsys/run/__init__.py": "",
    "rlsys/run/loop.py": "from .. import batch\nfrom rlsys.batch import collate\n",  # the roof may import the floor
    "sandbox/__init__.py": "from .base import run\n",
    "sandbox/base.py": "import rlsys.batch\n\ndef run():\n    from . import bwrap  # registers itself\n",
    "sandbox/bwrap.py": "from sandbox import run\n",  # sandbox/__init__.py
    "envs/__init__.py": "",
    "envs/code.py": """\
        import os


        def check():
            # the sandbox is heavy: only a code task runs it
            import sandbox.base
            from sandbox import (
                bwrap,
            )  # noqa: F401 - still a reason
            from envs import util  # noqa: F401


        def other():
            import json  # not our code: no reason needed
            from rlsys import batch
        """,
    "envs/util.py": "from envs.code import check\n",
}


def test_planted_violations_are_reported(tmp_path):
    for name, text in PLANTED.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    imports = scan(tmp_path)
    assert actors_import_algorithms(imports) == [
        "actors/worker.py:4: actors.worker imports algorithms.grpo (an actor imports an algorithm)",
        "actors/worker.py:9: actors.worker imports algorithms.grpo (an actor imports an algorithm)",
    ]
    assert algorithms_import_actors(imports) == [
        "algorithms/sft.py:1: algorithms.sft imports actors.modeling (an algorithm imports an actor)"
    ]
    assert floor_imports_roof(imports) == [
        "rlsys/batch.py:1: rlsys.batch imports rlsys.run.loop (only rlsys.run imports the roof rlsys.run)"
    ]
    assert sandbox_imports_outside(imports) == [
        "sandbox/base.py:1: sandbox.base imports rlsys.batch (sandbox imports nothing of ours outside sandbox)"
    ]
    assert lazy_without_reason(imports) == [
        "envs/code.py:10: envs.code imports envs.util (import inside a function without a one-line # reason)",
        "envs/code.py:15: envs.code imports rlsys.batch (import inside a function without a one-line # reason)",
    ]
    assert cycles(imports) == [
        "import cycle: envs.code -> envs.util -> envs.code (envs/code.py:10, envs/util.py:1)",
        "import cycle: rlsys.batch -> rlsys.run.loop -> rlsys.batch (rlsys/batch.py:1, rlsys/run/loop.py:1)",
        "import cycle: sandbox -> sandbox.base -> sandbox.bwrap -> sandbox "
        "(sandbox/__init__.py:1, sandbox/base.py:4, sandbox/bwrap.py:1)",
    ]
