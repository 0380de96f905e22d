"""No module imports a private name (`_name`, or a name from a `_module`) from another of tandem's units.

A leading underscore says "this unit's business": a unit that needs such a name from another is coupled to that
unit's insides, and a rename there breaks it silently. What a unit needs from another is that unit's public API.
Units are the top-level packages and root modules of src/tandem, as in tests/test_layering.py; inside one unit,
private names are free to cross modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tandem

SOURCE = Path(tandem.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(root: Path) -> list[str]:
    """`path:line: statement` of every `from tandem.<unit>... import` in the package at `root` that reaches a
    private name or module of a unit other than its own (relative imports resolved)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        package = ("tandem", *relative.with_suffix("").parts[:-1])
        unit = relative.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = (*base, *node.module.split(".")) if node.module else base
            if module[:1] != ("tandem",):
                continue
            reached = [(*module, alias.name) for alias in node.names]
            for name in reached:
                target = name[1] if len(name) > 1 else "__init__"
                if target != unit and any(_private(part) for part in name[1:]):
                    found.append(f"{relative}:{node.lineno}: `{ast.unparse(node)}`")
                    break
    return found


def test_no_unit_imports_a_private_name_of_another():
    found = private_imports(SOURCE)
    assert not found, "private names imported across units (make them public API of their unit):\n" + "\n".join(found)


def test_a_private_import_across_units_is_reported_and_one_inside_a_unit_is_not(tmp_path):
    for package in ("models", "trainer"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "models" / "decoder.py").write_text("from .logprobs import _kept_mask\n")
    (tmp_path / "trainer" / "loss.py").write_text(
        "from tandem.models.logprobs import IGNORE_INDEX\nfrom tandem.models.logprobs import LOGP_FLOOR, _kept_mask\n"
    )
    (tmp_path / "trainer" / "rl.py").write_text("from tandem.models._impl import thing\nfrom .loss import _x\n")
    assert private_imports(tmp_path) == [
        "trainer/loss.py:2: `from tandem.models.logprobs import LOGP_FLOOR, _kept_mask`",
        "trainer/rl.py:1: `from tandem.models._impl import thing`",
    ]
