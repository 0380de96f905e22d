"""What `tandem rl` checks and sets up before any child starts, in-process and fast: sources, resume, the token."""

from __future__ import annotations

from pathlib import Path

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


class FakeChild:
    """What `subprocess.Popen` gives the launcher, with nothing run: the command and environment each child got.
    A server announces its address at once, and every child has exited 0 by the launcher's first look."""

    def __init__(self, started: list[FakeChild], command, *, env, **_):
        self.command, self.env, self.pid, self.returncode = command, env, 0, 0
        if command[-3:-1] == ["inference", "@"]:
            (Path(command[-1]).parent / "server.json").write_text('{"url": "http://127.0.0.1:1"}')
        started.append(self)

    def poll(self) -> int:
        return 0

    def wait(self, timeout=None) -> int:
        return 0


def _launch(monkeypatch, tmp_path, model, *flags: str) -> dict[str, FakeChild]:
    """`tandem rl` run with FakeChild processes; each child by its name (the subcommand it runs)."""
    import functools
    import subprocess

    started: list[FakeChild] = []
    monkeypatch.setattr(subprocess, "Popen", functools.partial(FakeChild, started))
    args = ["rl", "--model", str(model), "@", _sources(tmp_path), "--output-dir", str(tmp_path / "out"), *flags]
    assert main([*args, "--max-steps", "1"]) == 0
    return {child.command[child.command.index("@") - 1]: child for child in started}


@pytest.mark.parametrize(
    ("flags", "environ", "given"),
    [
        ([], {}, None),
        (["--inference.admin-token", "mine"], {}, "mine"),
        (["--orchestrator.inference.admin-token", "mine"], {}, "mine"),
        ([], {"TANDEM_ADMIN_TOKEN": "mine"}, "mine"),
    ],
)
def test_the_run_token_reaches_the_servers_and_orchestrator_by_their_environment_alone(
    monkeypatch, tmp_path, tiny_model_dir, flags, environ, given
):
    """The run's servers always require a token (a random one per run unless one is configured), handed to the
    processes that serve or call the admin routes in their environment: never on a command line (any process
    reads /proc/*/cmdline), in a config file of the run directory, or to the trainer."""
    monkeypatch.delenv("TANDEM_ADMIN_TOKEN", raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    model = tiny_model_dir("qwen3")
    children = _launch(monkeypatch, tmp_path, model, "--run-name", "a", *flags)
    assert sorted(children) == ["inference", "orchestrator", "trainer"]
    token = children["inference"].env["TANDEM_ADMIN_TOKEN"]
    assert token == given or (given is None and len(token) >= 32)
    assert children["orchestrator"].env["TANDEM_ADMIN_TOKEN"] == token
    assert "TANDEM_ADMIN_TOKEN" not in children["trainer"].env
    assert not any(token in " ".join(child.command) for child in children.values())
    written = [path for path in (tmp_path / "out" / "a").rglob("*") if path.is_file()]
    assert written and not any(token.encode() in path.read_bytes() for path in written)
    if given is None:  # random per run
        again = _launch(monkeypatch, tmp_path, model, "--run-name", "b")
        assert again["inference"].env["TANDEM_ADMIN_TOKEN"] not in (token, None)


def test_two_different_admin_tokens_are_refused(tmp_path, capsys):
    flags = ["--inference.admin-token", "one", "--orchestrator.inference.admin-token", "two", "--dry-run"]
    assert main(["rl", "@", _sources(tmp_path), *flags]) == 2
    assert "inference.admin_token and orchestrator.inference.admin_token differ" in capsys.readouterr().err


def test_the_rl_trainer_checkpoints_by_default_whatever_else_its_section_sets():
    """A stopped `tandem rl` run (the README's example, Ctrl-C) can be resumed without a setting of its own."""
    from tandem.config import load_config
    from tandem.config.rl import RlConfig

    assert RlConfig().trainer.ckpt.interval == 50
    config = load_config(RlConfig, ["--trainer.ckpt.keep", "3"])[0]
    assert (config.trainer.ckpt.interval, config.trainer.ckpt.keep) == (50, 3)
    assert load_config(RlConfig, ["--trainer.ckpt.interval", "0"])[0].trainer.ckpt.interval == 0


def test_resuming_a_run_stopped_before_its_first_checkpoint_names_the_setting(
    monkeypatch, tmp_path, tiny_model_dir, capsys
):
    model = tiny_model_dir("qwen3")
    _launch(monkeypatch, tmp_path, model, "--run-name", "a")  # no child ran: no checkpoint
    capsys.readouterr()
    args = ["rl", "--model", str(model), "@", _sources(tmp_path), "--output-dir", str(tmp_path / "out")]
    assert main([*args, "--run-name", "a", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "tandem rl: error: nothing to resume: no complete checkpoint under " in err
    assert "with `trainer.ckpt.interval` = 50 one is written every 50 steps" in err


@pytest.mark.parametrize("dry_run", [True, False])
def test_a_python_tool_without_a_sandbox_stops_tandem_rl_before_anything_starts(
    tmp_path, capsys, monkeypatch, tiny_model_dir, dry_run
):
    """On a host with no isolation (a root container without CAP_SYS_ADMIN), a source with the `python` tool is
    refused in one line naming the opt-out before any process starts or the model loads; with
    `orchestrator.sandbox.unsafe_no_isolation` the same check passes."""
    from tandem.envs import sandbox
    from tandem.envs.sandbox_isolation import Probe

    monkeypatch.setattr(sandbox, "probe", lambda: Probe(None, ("bubblewrap: not installed", "namespaces: EPERM")))
    monkeypatch.setattr(sandbox, "_settings", sandbox._Settings())
    sources = tmp_path / "tools.toml"
    sources.write_text('[[orchestrator.source]]\nid = "calculator"\nargs = { tool = "python" }\n')
    out = tmp_path / "outputs"
    model = tiny_model_dir("qwen3")
    capsys.readouterr()
    args = ["rl", "--model", str(model), "@", str(sources), "--output-dir", str(out)]
    assert main([*args, *(["--dry-run"] if dry_run else [])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the python tool needs a sandbox" in err, err
    assert "sandbox.unsafe_no_isolation = true" in err and not out.exists()
    opted_out = [*args, "--orchestrator.sandbox.unsafe-no-isolation", "true", "--dry-run"]
    assert main(opted_out) == 0
