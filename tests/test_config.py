"""The config mechanism: precedence, section files, flags, errors, dry-run round trip, shared values."""

from __future__ import annotations

import textwrap
import typing
from pathlib import Path

import pytest

from tandem.config import ConfigError, load_config, load_file, to_toml
from tandem.config.dashboard import DashboardConfig
from tandem.config.eval import EvalConfig
from tandem.config.inference import InferenceConfig
from tandem.config.orchestrator import OrchestratorConfig
from tandem.config.rl import RlConfig
from tandem.config.schema import field_kind, kebab
from tandem.config.sft import SftConfig
from tandem.config.trainer import TrainerConfig

ALL_CONFIGS = [SftConfig, RlConfig, EvalConfig, InferenceConfig, OrchestratorConfig, TrainerConfig, DashboardConfig]


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_defaults_then_files_then_flags(tmp_path):
    a = write(tmp_path, "a.toml", "seq_len = 512\n[optim]\nlr = 1e-4\nweight_decay = 0.1\n")
    b = write(tmp_path, "b.toml", "[optim]\nlr = 2e-4\n")
    config, _ = load_config(SftConfig, ["@", a, f"@{b}", "--optim.lr", "3e-6"])
    assert config.seq_len == 512  # from a
    assert config.optim.weight_decay == 0.1  # a, untouched by b's [optim] table (deep merge)
    assert config.optim.lr == 3e-6  # the flag beats both files
    assert config.optim.eps == SftConfig().optim.eps  # default
    config, _ = load_config(SftConfig, ["@", a, "@", b])
    assert config.optim.lr == 2e-4  # the later file wins


def test_flag_order_is_respected(tmp_path):
    a = write(tmp_path, "a.toml", "max_steps = 7\n")
    config, _ = load_config(SftConfig, ["--max-steps", "3", "@", a])
    assert config.max_steps == 7
    config, _ = load_config(SftConfig, ["@", a, "--max-steps", "3"])
    assert config.max_steps == 3


def test_lists_are_replaced_whole(tmp_path):
    a = write(tmp_path, "a.toml", "[optim]\nbetas = [0.8, 0.9]\n")
    b = write(tmp_path, "b.toml", "[optim]\nbetas = [0.5, 0.6]\n")
    assert load_config(SftConfig, ["@", a, "@", b])[0].optim.betas == (0.5, 0.6)
    assert load_config(SftConfig, ["@", a, "--optim.betas", "0.7", "0.75"])[0].optim.betas == (0.7, 0.75)
    assert load_config(SftConfig, ["@", a, "--optim.betas", "[0.1, 0.2]"])[0].optim.betas == (0.1, 0.2)


def test_section_scoped_file(tmp_path):
    trainer = write(tmp_path, "t.toml", "max_steps = 5\n[optim]\nlr = 4e-6\n")
    config, _ = load_config(RlConfig, ["--trainer", "@", trainer, "--trainer.optim.weight-decay", "0.01"])
    assert config.trainer.max_steps == 5
    assert config.trainer.optim.lr == 4e-6
    assert config.trainer.optim.weight_decay == 0.01
    assert config.orchestrator.batch_size == OrchestratorConfig().batch_size


def test_section_scoped_file_unknown_key_names_file_and_line(tmp_path):
    trainer = write(tmp_path, "t.toml", "max_steps = 5\n[optim]\nlr = 4e-6\nbta = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key `trainer\.optim\.bta`.*t\.toml:4"):
        load_config(RlConfig, ["--trainer", "@", trainer])


def test_booleans_and_kebab_case():
    config, _ = load_config(SftConfig, ["--data.fake", "--data.no-pack", "--data.on-bad-row", "fail"])
    assert config.data.fake is True
    assert config.data.pack is False
    assert config.data.on_bad_row == "fail"
    config, _ = load_config(SftConfig, ["--no-data.fake", "--data.pack=false"])
    assert config.data.fake is False
    assert config.data.pack is False


def test_files_accept_kebab_and_snake_keys(tmp_path):
    a = write(tmp_path, "a.toml", "max-steps = 4\n[data]\non-bad-row = 'fail'\n")
    config, _ = load_config(SftConfig, ["@", a])
    assert config.max_steps == 4 and config.data.on_bad_row == "fail"


def test_unknown_key_in_file_names_file_line_and_suggestion(tmp_path):
    a = write(tmp_path, "a.toml", "seq_len = 1\n\n[optim]\nlr = 1e-4\nlrr = 3\n")
    with pytest.raises(ConfigError) as error:
        load_config(SftConfig, ["@", a])
    message = str(error.value)
    assert "unknown key `optim.lrr`" in message
    assert f"{a}:5" in message
    assert "did you mean `optim.lr`?" in message


def test_unknown_top_level_key_in_file(tmp_path):
    a = write(tmp_path, "a.toml", "seq_lenn = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key `seq-lenn` \(did you mean `seq-len`\?\) in .*a\.toml:1"):
        load_config(SftConfig, ["@", a])


def test_unknown_key_in_array_of_tables_line(tmp_path):
    a = write(tmp_path, "a.toml", "[optim]\nlr = 1.0\n[data]\npath = 'x'\nfakee = true\n")
    with pytest.raises(ConfigError, match=r"`data\.fakee` \(did you mean `data\.fake`\?\) in .*a\.toml:5"):
        load_config(SftConfig, ["@", a])


def test_unknown_flag_names_flag_and_suggestion():
    with pytest.raises(
        ConfigError, match=r"unknown key `optim\.lrx` \(did you mean `optim\.lr`\?\) \(flag --optim\.lrx\)"
    ):
        load_config(SftConfig, ["--optim.lrx", "1"])
    with pytest.raises(ConfigError, match=r"unknown key `optimm` \(did you mean `optim`\?\)"):
        load_config(SftConfig, ["--optimm.lr", "1"])


def test_an_unknown_flag_suggests_the_nested_field_of_that_name(tmp_path):
    from tandem.config.rl import RlConfig

    with pytest.raises(ConfigError, match=r"unknown key `lr` \(did you mean `optim\.lr`\?\) \(flag --lr\)"):
        load_config(SftConfig, ["--lr", "1e-5"])
    with pytest.raises(ConfigError, match=r"unknown key `lr` \(did you mean `trainer\.optim\.lr`\?\)"):
        load_config(RlConfig, ["--lr", "1e-5"])
    with pytest.raises(ConfigError, match=r"unknown key `optim\.lrr` \(did you mean `optim\.lr`\?\)"):
        load_config(SftConfig, ["--optim.lrr", "3"])  # a close sibling still comes first
    with pytest.raises(ConfigError, match=r"did you mean `optim\.lr`\?\) in .*a\.toml:1"):
        load_config(SftConfig, ["@", write(tmp_path, "a.toml", "lr = 1e-5\n")])


def test_bad_value_names_key_value_type_and_source(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(SftConfig, ["--optim.lr", "abc"])
    message = str(error.value)
    assert "`optim.lr` = 'abc'" in message and "flag --optim.lr" in message and "expected float" in message
    a = write(tmp_path, "a.toml", "[data]\non_bad_row = 'explode'\n")
    with pytest.raises(
        ConfigError, match=r"`data\.on-bad-row` = 'explode' \(from .*a\.toml:2\), expected 'skip' \| 'fail'"
    ):
        load_config(SftConfig, ["@", a])
    with pytest.raises(ConfigError, match=r"`max-steps` = '0'.*greater than 0"):
        load_config(SftConfig, ["--max-steps", "0"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.toml"):
        load_config(SftConfig, ["@", str(tmp_path / "nope.toml")])
    bad = write(tmp_path, "bad.toml", "[optim\nlr = 1\n")
    with pytest.raises(ConfigError, match=r"malformed TOML in .*bad\.toml: .*line 1"):
        load_config(SftConfig, ["@", bad])


def test_argument_errors():
    with pytest.raises(ConfigError, match="needs a value"):
        load_config(SftConfig, ["--optim.lr"])
    with pytest.raises(ConfigError, match="takes one value"):
        load_config(SftConfig, ["--optim.lr", "1", "2"])
    with pytest.raises(ConfigError, match="unexpected argument"):
        load_config(SftConfig, ["stray"])
    with pytest.raises(ConfigError, match="must be followed by a TOML file"):
        load_config(SftConfig, ["@"])
    with pytest.raises(ConfigError, match="not a section"):
        load_config(SftConfig, ["--seq-len", "@", "x.toml"])


@pytest.mark.parametrize("config_class", ALL_CONFIGS, ids=lambda c: c.__name__)
def test_dry_run_toml_loads_back_to_the_same_config(tmp_path, config_class):
    argv = ["--model.name", "some/model", "--seq-len", "333"] if "model" in config_class.model_fields else []
    config, _ = load_config(config_class, argv)
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(config))
    assert load_file(config_class, path) == config


def test_shared_values_flow_into_process_sections(tmp_path):
    a = write(
        tmp_path,
        "rl.toml",
        """
        seq_len = 1024
        output_dir = "runs"
        [model]
        name = "tiny"
        [inference]
        seq_len = 4096
        [trainer.model]
        dtype = "float32"
        """,
    )
    config, _ = load_config(RlConfig, ["@", a, "--run-name", "exp1"])
    for section in (config.trainer, config.orchestrator, config.inference):
        assert section.model.name == "tiny"
        assert section.output_dir == Path("runs")
        assert section.run_name == "exp1"
        assert section.run_dir == Path("runs/exp1")
    assert config.trainer.seq_len == config.orchestrator.seq_len == 1024
    assert config.inference.seq_len == 4096  # a section's own value wins
    assert config.trainer.model.dtype == "float32"  # tables merge key by key
    assert config.orchestrator.model.dtype == "bfloat16"


def test_default_run_name_is_shared_and_valid():
    config, _ = load_config(RlConfig, [])
    assert config.run_name.startswith("rl-")
    assert config.trainer.run_name == config.inference.run_name == config.run_name
    with pytest.raises(ConfigError, match="run-name"):
        load_config(RlConfig, ["--run-name", "../escape"])


def test_bare_section_flag_turns_on_its_enabled_switch():
    assert load_config(SftConfig, ["--resume"])[0].resume.enabled is True
    config, _ = load_config(SftConfig, ["--resume.step", "3"])
    assert config.resume.enabled is True and config.resume.step == 3
    assert load_config(SftConfig, ["--resume", "--no-resume"])[0].resume.enabled is False


def test_model_shorthand_is_the_model_name(tmp_path):
    config, _ = load_config(RlConfig, ["--model", "./dir", "--trainer.model.dtype", "float32"])
    assert config.model.name == config.trainer.model.name == config.inference.model.name == "./dir"
    assert config.trainer.model.dtype == "float32"
    a = write(tmp_path, "a.toml", 'model = "other"\n')
    assert load_config(RlConfig, ["@", a])[0].orchestrator.model.name == "other"


def test_model_shorthand_then_model_flags_merge():
    config, _ = load_config(SftConfig, ["--model", "dir", "--model.dtype", "float32"])
    assert config.model.name == "dir" and config.model.dtype == "float32"
    with pytest.raises(ConfigError, match=r"invalid value for `optim` = '3' \(from flag --optim\)"):
        load_config(SftConfig, ["--optim", "3"])


def test_keys_inside_free_form_tables_parse_as_toml_literals():
    from tandem.config.eval import EvalConfig

    flags = ["--env.id", "arithmetic", "--env.args.num-tasks", "5", "--env.args.path", "data.jsonl"]
    config, _ = load_config(EvalConfig, [*flags, "--env.args.flag", "true", "--env.select.include", "0:10"])
    assert config.env.args == {"num_tasks": 5, "path": "data.jsonl", "flag": True}
    assert config.env.select.include is not None  # a field-level shorthand still reaches its validator


def test_setting_one_key_keeps_a_sections_declared_defaults():
    config, _ = load_config(TrainerConfig, ["--optim.weight-decay", "0.1"])
    assert config.optim.lr == TrainerConfig().optim.lr == 1e-6  # the RL trainer's default, not OptimConfig's
    rl, _ = load_config(RlConfig, ["--trainer.optim.weight-decay", "0.1", "--max-steps", "7"])
    assert rl.trainer.optim.lr == 1e-6 and rl.inference.port == 0
    assert rl.trainer.max_steps == rl.orchestrator.max_steps == 7


def test_one_flag_value_for_a_list_or_scalar_field_is_the_scalar():
    one, _ = load_config(SftConfig, ["--model.moe-backend", "loop"])
    assert one.model.moe_backend == "loop"
    two, _ = load_config(SftConfig, ["--model.moe-backend", "loop", "grouped_mm"])
    assert two.model.moe_backend == ["loop", "grouped_mm"]
    listed, _ = load_config(SftConfig, ["--speed.sdpa-backends", "cudnn"])
    assert listed.speed.sdpa_backends == ("cudnn",)


def test_vllm_with_the_weight_broadcast_is_refused_up_front():
    with pytest.raises(ConfigError, match="needs the built-in engine"):
        load_config(RlConfig, ["--inference.engine", "vllm", "--trainer.weights.transport", "broadcast"])


def float_flags(model, prefix=""):
    """Every float-valued leaf key of a config model, as a `--dotted.kebab` flag."""
    for name, info in model.model_fields.items():
        kind = field_kind(info.annotation)
        flag = f"{prefix}{kebab(name)}"
        if kind.model is not None:
            yield from float_flags(kind.model, f"{flag}.")
        elif takes_float(info.annotation) and not kind.is_list and not kind.is_mapping:
            yield f"--{flag}"


def takes_float(annotation) -> bool:
    return annotation is float or any(takes_float(arg) for arg in typing.get_args(annotation))


@pytest.mark.parametrize("config_class", ALL_CONFIGS, ids=lambda c: c.__name__)
def test_nan_and_infinities_are_refused_by_every_float_key(tmp_path, config_class):
    flags = list(float_flags(config_class))
    assert flags or config_class is DashboardConfig
    for flag in flags:
        for value in ("nan", "inf", "-inf"):
            with pytest.raises(ConfigError, match="finite number"):
                load_config(config_class, [flag, value])
    if flags:  # a TOML file's own nan/inf literals, too
        dotted = flags[0][2:].split(".")
        table = f"[{'.'.join(dotted[:-1])}]\n" if len(dotted) > 1 else ""
        path = write(tmp_path, "inf.toml", f"{table}{dotted[-1]} = -inf\n")
        with pytest.raises(ConfigError, match=r"inf\.toml:\d.*finite number"):
            load_config(config_class, ["@", path])


def test_nan_inside_a_list_or_tuple_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"`optim\.betas\.0`.*finite number"):
        load_config(SftConfig, ["--optim.betas", "[nan, 0.95]"])
    path = write(tmp_path, "betas.toml", "[optim]\nbetas = [0.9, inf]\n")
    with pytest.raises(ConfigError, match=r"`optim\.betas\.1`.*betas\.toml.*finite number"):
        load_config(SftConfig, ["@", path])


def test_nan_inside_free_form_args_is_refused(tmp_path):
    """An environment's args are a free-form table: a NaN or infinity in them is refused too (the saved TOML
    could not hold it, so a resume would run without it)."""
    base = ["--env.id", "arithmetic", "--base-url", "http://127.0.0.1:9/v1"]
    with pytest.raises(ConfigError, match=r"`env\.args`.*flag --env\.args.*holds inf"):
        load_config(EvalConfig, [*base, "--env.args", "{num_tasks = 3, scale = inf}"])
    path = write(tmp_path, "args.toml", '[env]\nid = "arithmetic"\n[env.args]\nnested = {deep = [1.0, nan]}\n')
    with pytest.raises(ConfigError, match=r"`env\.args`.*args\.toml.*holds nan"):
        load_config(EvalConfig, ["@", path, "--base-url", "http://127.0.0.1:9/v1"])
    config, _ = load_config(EvalConfig, [*base, "--env.args", "{num_tasks = 3, scale = 1.5}"])
    assert config.env.args == {"num_tasks": 3, "scale": 1.5}


def test_unreadable_config_files_are_config_errors(tmp_path, monkeypatch):
    (tmp_path / "dir.toml").mkdir()
    with pytest.raises(ConfigError, match=r"dir\.toml is a directory"):
        load_config(SftConfig, ["@", str(tmp_path / "dir.toml")])
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes('run_name = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.toml is not UTF-8 text \(invalid byte at offset 15\)"):
        load_config(SftConfig, ["@", str(latin1)])
    locked = write(tmp_path, "locked.toml", "seed = 1\n")

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)  # chmod 000 does not stop root, who may run the tests
    with pytest.raises(ConfigError, match=r"cannot read config file .*locked\.toml: Permission denied"):
        load_config(SftConfig, ["@", locked])


@pytest.mark.parametrize(
    "text",
    [
        "seed = " + "[" * 5000 + "]" * 5000,  # deeper than the parser's recursion can go
        "seed = " + "{a = " * 40 + "1" + "}" * 40,  # parses, but deeper than any config
        "[" + ".".join(["a"] * 200) + "]\n",  # nested by a header, with no recursion in the parser
    ],
    ids=["arrays", "inline-tables", "dotted-header"],
)
def test_deeply_nested_toml_is_a_config_error(tmp_path, text):
    path = write(tmp_path, "deep.toml", text)
    with pytest.raises(ConfigError, match=r"malformed TOML in .*deep\.toml: tables and arrays nest deeper than 32"):
        load_config(SftConfig, ["@", path])
    with pytest.raises(ConfigError, match=r"flag --optim\.betas: cannot parse .*characters.*nest deeper than 32"):
        load_config(SftConfig, ["--optim.betas", "[" * 3000 + "]" * 3000])
