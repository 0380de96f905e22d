"""The built-in engine serving a base model with a LoRA adapter, folded into the weights (the default) or unmerged:
its logprobs are the trainer's scoring of the same adapter (fp32), the fused decode step runs folded adapters and
refuses unmerged ones, a bad adapter directory is a ConfigError before anything is allocated, and every weight
hand-off (shared, broadcast, file) moves the adapters only, in place, folding them again from the kept base."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from support.inference import ServerThread, engine_config, trainer_logprobs
from support.lora import BROKEN_ADAPTERS, adapted_model, break_adapter
from support.polling import wait_until
from tandem.cli import main
from tandem.config import ConfigError
from tandem.inference.engine import Engine
from tandem.inference.fused_decode import fused_decode_supported
from tandem.inference.limits import RequestRefused
from tandem.inference.main import eos_token_ids, load_served_model, lora_to_serve, served_names
from tandem.inference.weights import weight_targets
from tandem.models import load_model
from tandem.models.lora import (
    LoraArgs,
    adapter_state_dict,
    is_adapter_name,
    lora_modules,
    merge_lora,
    save_adapter,
    write_adapter,
)
from tandem.transport.weights.broadcast import BroadcastSender
from tandem.transport.weights.control import JoinRequest, Offer, check_offer
from tandem.transport.weights.shared import SharedSender
from tandem.wire.protocol import SamplingParams

ARGS = LoraArgs(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))


def _adapted(path, seed: int):
    return adapted_model(path, ARGS, seed)


def _engine(path, tokenizer, **overrides) -> Engine:
    """An fp32 CPU engine built as `tandem inference` builds it (`lora_to_serve`, then `load_served_model`)."""
    config = engine_config(path, device="cpu", **overrides)
    model = load_served_model(config, path, torch.device("cpu"), lora_to_serve(config, path))
    return Engine(model, config, tokenizer=tokenizer, eos_token_ids=eos_token_ids(path, tokenizer)).start()


@pytest.fixture
def engines():
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.stop()


def _sample(engine: Engine, prompt: list[int]) -> tuple[list[int], list[float]]:
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    (sample,) = engine.generate([prompt], params)[0]
    return sample.token_ids, sample.logprobs


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "unmerged"])
def test_the_engine_samples_an_adapter_as_the_trainer_scores_it(fold, model_dir, tokenizer, tmp_path, engines):
    base = model_dir()
    trained = _adapted(base, seed=1)
    adapter = save_adapter(trained, tmp_path / "my-adapter", base_model_name=str(base))
    engines.append(engine := _engine(base, tokenizer, lora_adapter=adapter, lora_fold=fold))
    folded = {"lora_adapter": adapter, "lora_fold": True}
    assert served_names(engine_config(base, **folded), base) == ("my-adapter", None)
    assert served_names(engine_config(base, **folded, lora_name="reverser"), base) == ("reverser", None)
    assert served_names(engine_config(base, **folded, served_model_name="mine"), base) == ("mine", None)
    if fold:  # the weights hold base + adapters: the fused step (which reads `.weight` alone) may run
        assert fused_decode_supported(engine.model) is None
    else:  # the Triton step would skip the adapters
        assert "LoRA" in fused_decode_supported(engine.model)

    prompt = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    tokens, logprobs = _sample(engine, prompt)
    q = torch.tensor(logprobs, dtype=torch.float64)
    p = trainer_logprobs(trained, prompt, tokens)
    kl = (torch.exp(q - p) - (q - p) - 1).mean().item()  # the trainer's mismatch_kl (k3 of p against q)
    assert abs(kl) < 1e-6 and (p - q).abs().max() < 1e-5, (kl, (p - q).abs().max())
    plain = load_model(base, dtype=torch.float32, device="cpu")
    assert (trainer_logprobs(plain, prompt, tokens) - q).abs().max() > 1e-3  # the adapter is in the forward


def test_a_bad_adapter_directory_is_a_config_error_before_loading(model_dir, tmp_path):
    base = model_dir()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"adapter_config\.json"):
        lora_to_serve(engine_config(base, lora_adapter=tmp_path / "empty"), base)
    # an adapter of another width: its tensors do not fit this base
    adapters = adapter_state_dict(_adapted(base, seed=0))
    wider = {n: torch.zeros(t.shape[0], t.shape[1] + 1) if ".lora_A." in n else t for n, t in adapters.items()}
    write_adapter(tmp_path / "wider", wider, ARGS)
    with pytest.raises(ConfigError, match="does not fit the base model"):
        lora_to_serve(engine_config(base, lora_adapter=tmp_path / "wider"), base)
    save_adapter(_adapted(base, seed=0), tmp_path / "fits")
    with pytest.raises(ConfigError, match=r"model\.lora asks for rank 8"):
        lora = {"name": str(base), "lora": {"rank": 8}}
        lora_to_serve(engine_config(base, lora_adapter=tmp_path / "fits", model=lora), base)
    with pytest.raises(ValueError, match="lora_fold = true is the built-in engine's"):
        engine_config(base, engine="vllm", lora_adapter=tmp_path / "fits", lora_fold=True)
    with pytest.raises(ConfigError, match=r"model\.lora: LoRA on routed experts .* needs an MoE model"):
        lora_to_serve(engine_config(base, model={"name": str(base), "lora": {"rank": 4, "experts": True}}), base)
    with pytest.raises(ValueError, match="served by the built-in engine only"):
        engine_config(base, engine="vllm", model={"name": str(base), "lora": {"rank": 4, "experts": True}})


@pytest.mark.parametrize("case", ["nan", "int64", "alpha-nan", "alpha-huge", "no-r", "r-string", "deep-json"])
def test_tandem_inference_refuses_a_broken_adapter_in_one_line(case, model_dir, tmp_path, capsys, monkeypatch):
    """At start-up the adapter passes the same loader and checks as /update_weights: a NaN adapter or alpha is
    never served (every answer would be empty), an integer one never cast to a no-op."""

    def served(*args, **kwargs):
        raise AssertionError("the broken adapter passed the start-up checks")  # (instead of serving it forever)

    monkeypatch.setattr("tandem.inference.main.load_served_model", served)
    base = model_dir()
    broken = break_adapter(save_adapter(_adapted(base, seed=0), tmp_path / "good"), tmp_path / case, case)
    argv = ["inference", "--model", str(base), "--lora-adapter", str(broken), "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("tandem inference: error: inference.lora_adapter: "), err
    assert err.count("\n") == 1 and re.search(BROKEN_ADAPTERS[case][1], err), err


def test_update_weights_refuses_a_broken_adapter_with_a_400(model_dir, tokenizer, tmp_path, engines):
    base = model_dir()
    lora = {"rank": ARGS.rank, "alpha": ARGS.alpha, "target_modules": list(ARGS.target_modules)}
    engines.append(engine := _engine(base, tokenizer, model={"name": str(base), "dtype": "float32", "lora": lora}))
    served = {name: t.clone() for name, t in engine.model.named_parameters()}
    good = write_adapter(tmp_path / "good", adapter_state_dict(_adapted(base, seed=1)), ARGS)
    server = ServerThread(engine, tokenizer, tmp_path)
    try:
        for case, (_, message) in BROKEN_ADAPTERS.items():
            path = break_adapter(good, tmp_path / case, case)
            answer = httpx.post(f"{server.url}/update_weights", json={"path": str(path), "version": 1}, timeout=60)
            assert answer.status_code == 400, (case, answer.text)
            assert re.search(message, answer.json()["error"]["message"]), (case, answer.text)
        assert engine.version == 0
        for name, param in engine.model.named_parameters():
            assert torch.equal(param, served[name]), name  # nothing was touched
        answer = httpx.post(f"{server.url}/update_weights", json={"path": str(good), "version": 1}, timeout=60)
        assert answer.status_code == 200 and engine.version == 1
    finally:
        server.stop()


def _join(server: ServerThread, sender) -> None:
    join = JoinRequest(**sender.rendezvous.model_dump(), rank=1, world_size=2)
    assert httpx.post(f"{server.url}/weights/join", json=join.model_dump()).status_code == 202


@pytest.mark.parametrize("transport", ["shared", "broadcast", "file"])
def test_a_hand_off_moves_the_adapters_only(transport, model_dir, tokenizer, tmp_path, engines):
    base = model_dir()
    lora = {"rank": ARGS.rank, "alpha": ARGS.alpha, "target_modules": list(ARGS.target_modules)}
    # what `tandem rl` starts: the server builds the trainer's adapters from [model.lora], zero B (= the base)
    engines.append(engine := _engine(base, tokenizer, model={"name": str(base), "dtype": "float32", "lora": lora}))
    frozen = {n: p.clone() for n, p in engine.model.named_parameters() if not is_adapter_name(n)}
    targets = weight_targets(engine.model)
    assert targets and all(is_adapter_name(name) for name in targets)
    policies = [_adapted(base, seed) for seed in (1, 2)]
    manifest = [(name, torch.float32, tuple(t.shape)) for name, t in adapter_state_dict(policies[0]).items()]
    full = [(name, p.dtype, tuple(p.shape)) for name, p in policies[0].named_parameters()]
    assert "different model" in check_offer(Offer(1, 1, full), targets)  # a full policy is refused
    server = ServerThread(engine, tokenizer, tmp_path)
    sender = None
    try:
        if transport == "shared":
            sender = SharedSender(manifest, torch.device("cpu"), "127.0.0.1", 0, timeout_s=60)
        elif transport == "broadcast":
            sender = BroadcastSender("127.0.0.1", 0, "gloo", timeout_s=60)
        if sender is not None:
            _join(server, sender)
            sender.connect()
        for version, policy in enumerate(policies, start=1):
            adapters = adapter_state_dict(policy)
            if transport == "shared":
                sender.send(version, iter(adapters.values()))
                sender.settle()
            elif transport == "broadcast":
                sender.send(version, manifest, iter(adapters.values()))
            else:
                path = write_adapter(tmp_path / f"policy-{version}", adapters, ARGS, base_model_name=str(base))
                body = {"path": str(path), "version": version}
                assert httpx.post(f"{server.url}/update_weights", json=body, timeout=60).status_code == 200
            assert engine.version == version
            for name, tensor in adapters.items():
                assert torch.equal(targets[name], tensor), name
        # the served weights are the base with the last adapters folded in from the kept base, as merge_lora
        # folds them: no rounding carried over from the first policy
        merged = dict(merge_lora(_adapted(base, seed=2)).named_parameters())
        for name, param in engine.model.named_parameters():
            if not is_adapter_name(name):
                assert torch.equal(param, merged[name]), name
        for name, module in lora_modules(engine.model):
            assert torch.equal(module.folded_base, frozen[f"{name}.weight"]), name  # the kept base never moves
        prompt = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
        tokens, logprobs = _sample(engine, prompt)
        p = trainer_logprobs(policies[-1], prompt, tokens)
        assert (p - torch.tensor(logprobs, dtype=torch.float64)).abs().max() < 1e-5
        if sender is not None:
            sender.close()
            wait_until(lambda: httpx.get(f"{server.url}/weights").json()["state"] == "stopped", "the receiver to stop")
        else:  # a full checkpoint is refused by a server that serves adapters
            full_dir = tmp_path / "full"
            from tandem.models import save_model

            save_model(load_model(base, dtype=torch.float32, device="cpu"), full_dir, dtype=torch.float32)
            answer = httpx.post(f"{server.url}/update_weights", json={"path": str(full_dir), "version": 3})
            assert answer.status_code == 400 and "PEFT adapter directory" in answer.text
    finally:
        if sender is not None:
            sender.close()
        server.stop()


def test_base_and_adapter_are_served_side_by_side(model_dir, tokenizer, tmp_path, engines):
    """An adapter directory is served unfolded (auto), beside the base model: one batch mixes requests of both,
    each scored as the trainer scores its own model, and the two names are the ones the API serves."""
    base = model_dir()
    trained = _adapted(base, seed=1)
    adapter = save_adapter(trained, tmp_path / "my-adapter", base_model_name=str(base))
    engines.append(engine := _engine(base, tokenizer, lora_adapter=adapter))
    assert engine.runner.adapter_gates is not None
    assert served_names(engine_config(base, lora_adapter=adapter), base) == ("my-adapter", base.resolve().name)
    with pytest.raises(ConfigError, match="both be served as `same`"):
        served_names(engine_config(base, lora_adapter=adapter, lora_name="same", served_model_name="same"), base)

    first, second = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in ("the quick brown", "over the"))
    prompts, adapters = [first, first, second, second], [True, False, False, True]
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=5)
    samples = engine.generate(prompts, params, adapters=adapters)
    plain = load_model(base, dtype=torch.float32, device="cpu")
    for prompt, adapted, (sample,) in zip(prompts, adapters, samples, strict=True):
        p = trainer_logprobs(trained if adapted else plain, prompt, sample.token_ids)
        other = trainer_logprobs(plain if adapted else trained, prompt, sample.token_ids)
        q = torch.tensor(sample.logprobs, dtype=torch.float64)
        assert (p - q).abs().max() < 1e-5 and (other - q).abs().max() > 1e-3, (adapted, (p - q).abs().max())


def test_a_folded_server_refuses_the_base(model_dir, tokenizer, tmp_path, engines):
    base = model_dir()
    adapter = save_adapter(_adapted(base, seed=1), tmp_path / "my-adapter", base_model_name=str(base))
    engines.append(engine := _engine(base, tokenizer, lora_adapter=adapter, lora_fold=True))
    assert engine.runner.adapter_gates is None
    with pytest.raises(RequestRefused, match="cannot serve the base"):
        engine.submit([1, 2, 3], SamplingParams(max_tokens=2), lambda update: None, adapter=False)


def test_the_openai_api_serves_base_and_adapter_by_name(model_dir, tokenizer, tmp_path, engines):
    import openai

    base = model_dir()
    trained = _adapted(base, seed=1)
    adapter = save_adapter(trained, tmp_path / "my-adapter", base_model_name=str(base))
    engines.append(engine := _engine(base, tokenizer, lora_adapter=adapter))
    server = ServerThread(engine, tokenizer, tmp_path, base_name="base")  # served as "tiny" (the adapter) and "base"
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        assert sorted(m.id for m in client.models.list()) == ["base", "tiny"]
        prompt = "the quick brown fox"
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        plain = load_model(base, dtype=torch.float32, device="cpu")
        bests = []
        for name, model in (("tiny", trained), ("base", plain)):
            reply = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
            assert reply.model == name
            with torch.no_grad():
                best = model(torch.tensor([ids]))[0, -1].log_softmax(-1).max().item()
            # greedy: the first token is the argmax of that name's own model, at its logprob
            assert reply.choices[0].logprobs.token_logprobs[0] == pytest.approx(best, abs=1e-4)
            bests.append(best)
        assert abs(bests[0] - bests[1]) > 1e-2  # the two names run different models
        with pytest.raises(openai.NotFoundError, match="serves `tiny`, `base`"):
            client.completions.create(model="other", prompt=prompt, max_tokens=1)
    finally:
        server.stop()


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "side-by-side"])
def test_expert_adapters_are_served_as_the_trainer_scores_them(fold, model_dir, tokenizer, tmp_path, engines):
    """Adapters on routed experts (`model.lora.experts`): folded into the stacked expert weights, or run as thin
    grouped matmuls gated per row beside the base model; a file hand-off swaps them (and folds them again)."""
    base = model_dir("qwen3_moe")
    args = LoraArgs(rank=4, alpha=8, target_modules=("q_proj",), experts=True)
    first, trained = (adapted_model(base, args, seed) for seed in (1, 2))
    adapter = save_adapter(first, tmp_path / "experts", base_model_name=str(base))
    engines.append(engine := _engine(base, tokenizer, lora_adapter=adapter, lora_fold=fold))
    server = ServerThread(engine, tokenizer, tmp_path)
    try:
        path = save_adapter(trained, tmp_path / "policy-1", base_model_name=str(base))
        answer = httpx.post(f"{server.url}/update_weights", json={"path": str(path), "version": 1}, timeout=60)
        assert answer.status_code == 200, answer.text
    finally:
        server.stop()
    prompt = tokenizer("the quick brown fox", add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    plain = load_model(base, dtype=torch.float32, device="cpu")
    models, adapters = ([trained], None) if fold else ([trained, plain], [True, False])
    samples = engine.generate([prompt] * len(models), params, adapters=adapters)
    for model, (sample,) in zip(models, samples, strict=True):
        q = torch.tensor(sample.logprobs, dtype=torch.float64)
        assert (trainer_logprobs(model, prompt, sample.token_ids) - q).abs().max() < 1e-5
    (sample,) = samples[0]
    assert (trainer_logprobs(plain, prompt, sample.token_ids) - torch.tensor(sample.logprobs)).abs().max() > 1e-3
