"""Which of tandem's packages may import which, checked over the source with `ast`.

The rule: a package imports downward only, so each process's package can be read without opening the
others. `models`, `kernels` and `config` import nothing else of tandem (`config`: the standard library,
pydantic and its own models only). The utilities every process may import (`UTILITIES`: root modules, and the
`wire` package, the contract both ends of an HTTP hop speak) import only what their row names. `envs` and
`transport` build on `config`. `trainer` and `inference` share `models` and `kernels`, and `model_kernels`, which
picks the kernels the models run (and `transport` between them); `orchestrator` and `eval` share `envs` and the
root `client`. Only `cli` and the launcher modules it owns (`launch`, `shared_gpu`, `view`) know every package.

No two units import each other, directly or through others. Units are the top-level packages and root
modules of src/tandem (`__init__` is the package root itself).
Every import counts, whether at the top of a module, inside a function or under `TYPE_CHECKING`: each is a
dependency. An edge the rule does not grant but the code still has is listed in `EXCEPTIONS` with the reason
it stays; an exception the code no longer needs fails the test, so the list only shrinks.

docs/architecture.md's "Layering" section is this table in prose; a test fails when the two disagree.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

import tandem

UTILITIES = ("checkpoints", "files", "images", "jsonl", "net", "packing", "run", "wire")
"""What every process may import: run directories, atomic files, image references, record files, hosts, checkpoint
lookup, packing, and the `wire` package (the bodies, kept ids and msgpack both ends of an HTTP hop speak)."""
EVERYTHING = "*"

ALLOWED: dict[str, tuple[str, ...] | str] = {
    # the bottom: nothing else of tandem
    "models": (),
    "kernels": (),
    "config": (),
    # root utility modules
    "files": (),
    "images": (),
    "checkpoints": (),
    "packing": (),
    "wire": (),  # the contract between the processes: pydantic and msgpack only
    "hub": ("config",),
    "net": ("config",),  # a port that cannot be bound is the user's ConfigError
    "jsonl": ("files",),
    "run": ("config", "files"),
    "client": ("config", "wire"),
    # what the processes build on
    "model_kernels": ("models", "kernels", "config"),  # the Triton kernels the models run, chosen and registered
    "envs": ("config",),
    "transport": ("config", *UTILITIES),
    # the processes
    "trainer": ("models", "kernels", "model_kernels", "config", "transport", *UTILITIES),
    "inference": ("models", "kernels", "model_kernels", "config", "transport", *UTILITIES),
    "orchestrator": ("envs", "client", "config", "transport", *UTILITIES),
    "eval": ("envs", "client", "config", *UTILITIES),
    "dashboard": ("config", *UTILITIES),
    "testing": ("config", "envs", *UTILITIES),
    # the top: the command line and the launcher modules it owns
    "cli": EVERYTHING,
    "launch": EVERYTHING,
    "shared_gpu": EVERYTHING,
    "view": EVERYTHING,
    "merge": ("models", "config", "hub", "run"),  # `tandem merge-lora`
    "__main__": ("cli",),
    "__init__": (),
}

EXCEPTIONS: dict[tuple[str, str], str] = {
    ("inference", "envs"): "the OpenAI routes parse tool calls with envs.tool_parsers, the one parser per model family",
    ("orchestrator", "eval"): "online evals run eval's runner and summary as they are, the same code as `tandem eval`",
    ("dashboard", "eval"): "eval results are shown through eval's own trace reader and summary",
}

SOURCE = Path(tandem.__file__).parent
ARCHITECTURE = Path(__file__).parents[1] / "docs" / "architecture.md"


class Edge(NamedTuple):
    source: str
    target: str
    where: str
    """`path:line` of the import, relative to src/tandem."""
    statement: str


def units(root: Path) -> set[str]:
    """The top-level packages and root modules of the package at `root`."""
    return {path.stem for path in root.glob("*.py")} | {path.parent.name for path in root.glob("*/__init__.py")}


def _unit(parts: tuple[str, ...], root: Path) -> str:
    """The unit a dotted name below `tandem` belongs to; a name that is no module of the root is the root's."""
    if parts and ((root / parts[0] / "__init__.py").is_file() or (root / f"{parts[0]}.py").is_file()):
        return parts[0]
    return "__init__"


def _targets(node: ast.Import | ast.ImportFrom, package: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The dotted names (as parts) that one import statement in `package` reaches, relative ones resolved."""
    if isinstance(node, ast.Import):
        return [tuple(alias.name.split(".")) for alias in node.names]
    base = package[: len(package) - node.level + 1] if node.level else ()
    module = (*base, *(node.module or "").split(".")) if node.module else base
    if module == ("tandem",):  # `from tandem import x`: x may be a module or a name of the root
        return [(*module, alias.name) for alias in node.names]
    return [module]


def edges(root: Path) -> list[Edge]:
    """Every import from one unit of the package at `root` into another."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        module = ("tandem", *relative.with_suffix("").parts)
        source = module[1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for name in _targets(node, module[:-1]):
                target = _unit(name[1:], root) if name[0] == "tandem" else None
                if target is not None and target != source:
                    found.append(Edge(source, target, f"{relative}:{node.lineno}", ast.unparse(node)))
    return found


def _granted(source: str, target: str) -> bool:
    row = ALLOWED[source]
    return row == EVERYTHING or target in row


def violations(found: list[Edge]) -> list[str]:
    return [
        f"{edge.where}: `{edge.statement}` ({edge.source} -> {edge.target})"
        for edge in found
        if not _granted(edge.source, edge.target) and (edge.source, edge.target) not in EXCEPTIONS
    ]


def test_every_unit_of_the_package_has_a_row():
    found = units(SOURCE)
    assert sorted(found - set(ALLOWED)) == [], "a new package or root module: give it a row in ALLOWED"
    assert sorted(set(ALLOWED) - found) == [], "rows of units that no longer exist: remove them"


def test_imports_follow_the_table():
    problems = violations(edges(SOURCE))
    assert not problems, "imports outside the layering table (tests/test_layering.py):\n" + "\n".join(problems)


def test_each_exception_is_still_needed():
    present = {(edge.source, edge.target) for edge in edges(SOURCE)}
    stale = [f"{s} -> {t}" for s, t in EXCEPTIONS if (s, t) not in present or _granted(s, t)]
    assert not stale, f"exceptions the code no longer needs, remove them from EXCEPTIONS: {stale}"


def test_the_units_import_each_other_in_no_cycle():
    graph: dict[str, set[str]] = {}
    for edge in edges(SOURCE):
        graph.setdefault(edge.source, set()).add(edge.target)
    state: dict[str, str] = {}

    def visit(chain: list[str]) -> None:
        state[chain[-1]] = "open"
        for target in sorted(graph.get(chain[-1], ())):
            cycle = [*chain[chain.index(target) :], target] if state.get(target) == "open" else []
            assert not cycle, f"import cycle: {' -> '.join(cycle)}"
            if target not in state:
                visit([*chain, target])
        state[chain[-1]] = "done"

    for unit in sorted(graph):
        if unit not in state:
            visit([unit])


def test_a_new_upward_import_is_reported_with_its_file_and_statement(tmp_path):
    for package in ("models", "trainer"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "models" / "decoder.py").write_text(
        "from . import layers\n\n\ndef f():\n    from tandem.trainer import loss\n"
    )
    assert violations(edges(tmp_path)) == ["models/decoder.py:5: `from tandem.trainer import loss` (models -> trainer)"]


class Documented(NamedTuple):
    """What docs/architecture.md's "Layering" section says: each unit's row, the utilities, the exceptions."""

    rows: dict[str, frozenset[str] | str]
    utilities: frozenset[str]
    exceptions: frozenset[tuple[str, str]]


def _named(text: str) -> list[str]:
    """The `code` names of a piece of the section, leaving out what parentheses say about them."""
    return re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", text))


def documented(markdown: str) -> Documented:
    """The layering of the `## Layering` section of `markdown`: its table (a row `| units | what they may
    import |`, where "the root utilities", "everything" and "nothing else of tandem" stand for what they say),
    its sentence "The root utilities are ...", and its exceptions, written "`source` → `target`"."""
    assert "\n## Layering\n" in markdown, "docs/architecture.md has no `## Layering` section"
    section = markdown.split("\n## Layering\n", 1)[1].split("\n## ", 1)[0]
    listed = re.search(r"The root utilities are (.*?)\.(\s|$)", section, re.DOTALL)
    utilities = frozenset(_named(listed.group(1))) if listed else frozenset()
    rows: dict[str, frozenset[str] | str] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 2 or cells[0] == "unit" or set(cells[0]) <= set("-: "):
            continue
        grants = cells[1]
        allowed: frozenset[str] | str = frozenset(_named(grants))
        if "the root utilities" in grants:
            allowed |= utilities
        if grants.startswith("everything"):
            allowed = EVERYTHING
        for unit in _named(cells[0]):
            rows[unit] = allowed
    exceptions = frozenset(re.findall(r"`(\w+)` → `(\w+)`", section))
    return Documented(rows, utilities, exceptions)


def disagreements(docs: Documented) -> list[str]:
    """Where the documented layering differs from `ALLOWED`, `UTILITIES` and `EXCEPTIONS`, one line each."""
    problems = []
    for unit in sorted(set(ALLOWED) | set(docs.rows)):
        if unit not in docs.rows or unit not in ALLOWED:
            problems.append(f"{unit}: " + ("no row in the docs" if unit in ALLOWED else "a docs row, no table row"))
            continue
        said, row = docs.rows[unit], ALLOWED[unit]
        if EVERYTHING in (said, row):
            if said != row:
                problems.append(f"{unit}: the docs say {_shown(said)}, the table {_shown(row)}")
            continue
        problems.extend(_differences(unit, said, frozenset(row)))
    problems.extend(_differences("the root utilities", docs.utilities, frozenset(UTILITIES)))
    problems.extend(_differences("the exceptions", docs.exceptions, frozenset(EXCEPTIONS)))
    return problems


def _differences(what: str, said: frozenset, expected: frozenset) -> list[str]:
    missing, extra = sorted(expected - said), sorted(said - expected)
    parts = [f"the docs leave out {_shown(missing)}"] * bool(missing) + [f"the docs add {_shown(extra)}"] * bool(extra)
    return [f"{what}: {'; '.join(parts)}"] if parts else []


def _shown(names: object) -> str:
    if isinstance(names, str):
        return names
    return ", ".join(" → ".join(name) if isinstance(name, tuple) else name for name in names) or "nothing"


def test_the_architecture_doc_states_the_table():
    problems = disagreements(documented(ARCHITECTURE.read_text(encoding="utf-8")))
    assert not problems, "docs/architecture.md's Layering section disagrees with tests/test_layering.py:\n" + "\n".join(
        problems
    )


def test_a_documented_row_that_differs_from_the_table_is_reported():
    doc = ARCHITECTURE.read_text(encoding="utf-8")
    assert not disagreements(documented(doc))
    wrong = doc.replace("| `envs` | `config` |", "| `envs` | `config`, `models` |", 1)
    assert wrong != doc
    assert disagreements(documented(wrong)) == ["envs: the docs add models"]
    dropped = doc.replace("`orchestrator` → `eval`", "`orchestrator` to `eval`", 1)
    assert dropped != doc
    assert disagreements(documented(dropped)) == ["the exceptions: the docs leave out orchestrator → eval"]
