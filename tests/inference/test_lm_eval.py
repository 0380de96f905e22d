"""lm-evaluation-harness against the server: its `local-completions` model (echo + prompt logprobs, as every
multiple-choice benchmark scores answers) gives the loglikelihoods and is_greedy its `hf` model computes from the
same checkpoint with transformers. No dataset is read: the requests are built here."""

from __future__ import annotations

import os

import pytest

from support.inference import SEQ_LEN
from tandem.wire.protocol import SamplingParams

pytest.importorskip("lm_eval", reason="needs lm-evaluation-harness (the dev extra installs lm-eval[api,hf])")

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")


def _requests(engine, tokenizer) -> list:
    """(context, continuation) pairs: multiple-choice-like ones, and a few whose continuation is the model's own
    greedy text, so that is_greedy is true for some."""
    from lm_eval.api.instance import Instance

    pairs = [
        ("The capital of France is", " Paris"),
        ("The capital of France is", " a small dog"),
        ("once upon a time there", " was a king"),
        ("2 + 2 =", " 4"),
        ("the quick brown fox", " jumps over the lazy dog"),
    ]
    for context in ("the lazy dog", "once upon a time"):
        ids = tokenizer(context).input_ids
        greedy = engine.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), detokenize=True)
        pairs.append((context, greedy[0][0].text))
    return [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=index) for index, pair in enumerate(pairs)
    ]


def test_local_completions_loglikelihoods_equal_hf(make_engine, serve, model_dir, tokenizer):
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    path = str(model_dir("qwen3"))
    engine = make_engine()
    server = serve(engine)
    requests = _requests(engine, tokenizer)
    served = LocalCompletionsAPI(
        base_url=f"{server.url}/v1/completions",
        model="tiny",
        tokenizer_backend="huggingface",
        tokenizer=path,
        max_length=SEQ_LEN - 1,  # room for the one token each request also samples
        batch_size=3,  # several prompts in one request
        max_retries=1,
    )
    reference = HFLM(pretrained=path, dtype="float32", device="cpu", batch_size=1)
    got = served.loglikelihood(requests)
    want = reference.loglikelihood(requests)
    assert len(got) == len(want) == len(requests)
    for (logprob, greedy), (want_logprob, want_greedy), request in zip(got, want, requests, strict=True):
        assert logprob == pytest.approx(want_logprob, abs=1e-4), request.arguments
        assert greedy == want_greedy, request.arguments
    assert any(greedy for _, greedy in want) and not all(greedy for _, greedy in want)
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
