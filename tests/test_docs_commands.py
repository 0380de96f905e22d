"""Every `tandem` command written in the README and docs/ resolves as written: its flags exist and its values
validate (`--dry-run`, or `--help` as shown). The README's eval commands run for real, as written, against
the built-in server on a tiny model; the main SFT example runs in tests/trainer/test_example.py."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from support.paths import GSM8K_TEST, REPO
from tandem.cli import main
from tandem.jsonl import read_records
from tandem.testing.progress import tree_state, wait_for

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
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
                        commands.append((f"{page.relative_to(REPO)}:{number}", shlex.join(words[1:])))
    return commands


COMMANDS = documented_commands()


READERS_OWN = {
    "rl": '[[orchestrator.source]]\nid = "reverse_text"\n',
    "orchestrator": '[[source]]\nid = "reverse_text"\n',
}
"""The reader's own config file (`@ run.toml`): the defaults, and what a run has none for, its training source."""


def test_the_docs_have_commands():
    assert len(COMMANDS) > 20
    assert any(command.startswith("eval ") for _, command in COMMANDS)


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_documented_command_resolves(where, command, tmp_path, monkeypatch, capsys):
    if PLACEHOLDER.search(command):
        pytest.skip(f"{where} names a placeholder; its journey test runs it on a real run")
    argv = shlex.split(command)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    for index, word in enumerate(argv[:-1]):
        if word == "@" and not (tmp_path / argv[index + 1]).exists():
            whole = not argv[index - 1].startswith("--")  # `@ run.toml`, not a section's `--trainer @ file`
            (tmp_path / argv[index + 1]).write_text(READERS_OWN.get(argv[0], "") if whole else "")
    if "--help" not in argv and "--dry-run" not in argv:
        argv.append("--dry-run")
    assert main(argv) == 0, f"{where}: `tandem {command}` failed: {capsys.readouterr().err}"


def readme_eval_commands() -> list[str]:
    """The README's Evaluation block: first a single env, then a TOML of sources, then its resume."""
    return [command for where, command in COMMANDS if where.startswith("README.md") and command.startswith("eval ")]


def shrunk_example(tmp_path: Path) -> Path:
    """examples/eval/gsm8k.toml as written, with its sizes cut for a tiny model on two cores."""
    text = (REPO / "examples" / "eval" / "gsm8k.toml").read_text()
    for old, new in [
        ("limit = 200", "limit = 2"),
        ("num_tasks = 100", "num_tasks = 2"),
        ("max_tokens = 512", "max_tokens = 8"),
        ('"../shared/data/gsm8k/test.jsonl"', f'"{GSM8K_TEST}"'),
    ]:
        assert old in text, f"examples/eval/gsm8k.toml no longer has {old!r}: update this test"
        text = text.replace(old, new)
    path = tmp_path / "gsm8k.toml"
    path.write_text(text)
    return path


@pytest.fixture
def served_tiny_model(tiny_model_dir, tmp_path):
    """docs/inference.md's tiny-model command (`tandem inference --model ./tiny ... --port 0`), running."""
    (command,) = [c for _, c in COMMANDS if c.startswith("inference --model ./tiny")]
    argv = [word.replace("./tiny", str(tiny_model_dir("qwen3"))) for word in shlex.split(command)]
    argv += ["--output-dir", str(tmp_path), "--run-name", "server"]
    process = subprocess.Popen([sys.executable, "-m", "tandem", *argv], stderr=subprocess.DEVNULL, text=True)
    try:
        server_json = tmp_path / "server" / "server.json"
        wait_for(lambda: server_json.is_file() or process.poll() is not None, lambda: tree_state([tmp_path]))
        assert server_json.is_file(), f"the server exited with {process.returncode}; see {tmp_path}/server/logs"
        yield json.loads(server_json.read_text())["url"] + "/v1"
    finally:
        process.terminate()
        process.wait()


@pytest.mark.slow
@pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"the shared GSM8K file is not at {GSM8K_TEST}")
def test_the_readme_eval_commands_run_as_written(served_tiny_model, tmp_path, monkeypatch):
    single, sources, resume = readme_eval_commands()
    monkeypatch.chdir(tmp_path)
    example = shrunk_example(tmp_path)

    def as_run(command: str, run_name: str) -> list[str]:
        for written, here in [
            ("http://127.0.0.1:8000/v1", served_tiny_model),
            ("../shared/data/gsm8k/test.jsonl", str(GSM8K_TEST)),
            ("examples/eval/gsm8k.toml", str(example)),
            (
                "'outputs/<eval' 'run>'",
                str(tmp_path / "sources"),
            ),  # the placeholder's two words, as shlex.join quotes them
        ]:
            command = command.replace(written, here)
        return [*shlex.split(command), "--output-dir", str(tmp_path), "--run-name", run_name]

    assert main([*as_run(single, "single"), "--env.select.limit", "2", "--env.sampling.max-tokens", "8"]) == 0
    assert len(read_records(tmp_path / "single" / "traces.jsonl")) == 2
    assert main(as_run(sources, "sources")) == 0
    traces = tmp_path / "sources" / "traces.jsonl"
    everything = read_records(traces)
    assert len(everything) == 2 * 4 + 2  # gsm8k: 2 tasks x 4 rollouts; arithmetic-greedy: 2 tasks x 1
    traces.write_text("".join(json.dumps(record) + "\n" for record in everything[:3]))  # as if killed early
    assert main(as_run(resume, "sources")) == 0
    resumed = read_records(traces)
    assert sorted(r["key"] for r in resumed) == sorted(r["key"] for r in everything)
    assert resumed[:3] == everything[:3]  # what was done is kept, only the rest ran again
