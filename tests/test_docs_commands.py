"""Every `tandem` command written in the README and docs/ resolves as written: its flags exist and its values
validate (`--dry-run`, or `--help` as shown). The commands that start work run for real in the journey tests
beside the features they document (tests/trainer/test_example.py, tests/eval/test_docs_journeys.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tandem.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = re.compile(r"<[^>]+>")
"""`outputs/<eval run>`: a name the reader fills in; the journey tests run those commands on real runs."""


def logical_lines(block: str, first_line: int) -> list[tuple[int, str]]:
    """(line number, text) of each shell line of a block, a backslash-continued command joined into one."""
    lines, start, pending = [], first_line, ""
    for number, line in enumerate(block.splitlines(), start=first_line):
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append((start, pending + line))
        pending = ""
    return lines


def documented_commands() -> list[tuple[str, str]]:
    """(page:line, command) for every `tandem ...` command in a page's ```bash blocks."""
    commands = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"```bash\n(.*?)```", text, flags=re.S):
            for number, line in logical_lines(match.group(1), text.count("\n", 0, match.start()) + 2):
                for part in line.split("&&"):
                    words = shlex.split(part, comments=True)
                    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
                        words = words[1:]  # environment assignments: CUDA_VISIBLE_DEVICES=0,1 tandem ...
                    if words[:1] == ["tandem"]:
                        commands.append((f"{page.relative_to(ROOT)}:{number}", shlex.join(words[1:])))
    return commands


COMMANDS = documented_commands()


def test_the_docs_have_commands():
    assert len(COMMANDS) > 20
    assert any(command.startswith("eval ") for _, command in COMMANDS)


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_documented_command_resolves(where, command, tmp_path, monkeypatch, capsys):
    if PLACEHOLDER.search(command):
        pytest.skip(f"{where} names a placeholder; its journey test runs it on a real run")
    argv = shlex.split(command)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for index, word in enumerate(argv[:-1]):
        if word == "@" and not (tmp_path / argv[index + 1]).exists():
            (tmp_path / argv[index + 1]).write_text("")  # the reader's own file (`@ run.toml`): defaults suffice
    if "--help" not in argv and "--dry-run" not in argv:
        argv.append("--dry-run")
    assert main(argv) == 0, f"{where}: `tandem {command}` failed: {capsys.readouterr().err}"
