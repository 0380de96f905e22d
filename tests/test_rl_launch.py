"""What `tandem rl` checks and sets up before any child starts, in-process and fast: sources, resume, the token."""

from __future__ import annotations

import pytest

from tandem.cli import main


def _sources(tmp_path, train: str = "reverse_text", evaluated: str = "arithmetic") -> str:
    path = tmp_path / "sources.toml"
    path.write_text(
        f'[[orchestrator.source]]\nid = "{train}"\n'
        "[orchestrator.eval]\ninterval = 2\n"
        f'[[orchestrator.eval.source]]\nid = "{evaluated}"\nargs = {{ num_tasks = 3 }}\n'
    )
    return str(path)


@pytest.mark.parametrize(
    ("train", "evaluated", "named"),
    [("reverse_txt", "arithmetic", "reverse_text"), ("reverse_text", "arithmetc", "arithmetic")],
)
@pytest.mark.parametrize("dry_run", [True, False])
def test_a_mistyped_source_is_one_line_with_a_suggestion_before_anything_starts(
    tmp_path, capsys, tiny_model_dir, train, evaluated, named, dry_run
):
    """A typo in a training or an online eval source's env id: exit 2, one line naming the source with a
    did-you-mean, from `--dry-run` as from the run itself, which creates nothing (it used to start every process,
    load the model and print a 35-line traceback 41 s later)."""
    out = tmp_path / "outputs"
    model = tiny_model_dir("qwen3")
    capsys.readouterr()  # what writing the model printed
    args = ["rl", "--model", str(model), "@", _sources(tmp_path, train, evaluated)]
    args += ["--output-dir", str(out), *(["--dry-run"] if dry_run else [])]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1, captured.err
    typo = train if train != "reverse_text" else evaluated
    assert captured.err.startswith(f"tandem rl: error: source {typo!r}: unknown taskset id {typo!r}; ")
    assert f"did you mean {named!r}?" in captured.err
    assert not out.exists()


def test_bad_source_args_are_refused_by_the_dry_run(tmp_path, capsys):
    sources = tmp_path / "sources.toml"
    sources.write_text('[[source]]\nid = "reverse_text"\nargs = { num_task = 3 }\n')
    assert main(["orchestrator", "@", str(sources), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem orchestrator: error: source 'reverse_text': taskset 'reverse_text': bad args")


def test_the_dry_run_of_good_sources_prints_the_config(tmp_path, capsys):
    assert main(["rl", "@", _sources(tmp_path), "--dry-run"]) == 0
    assert 'id = "reverse_text"' in capsys.readouterr().out
