"""The built-in engine serving vision-language models (Qwen3-VL, Qwen2.5-VL) with images inline: samples scored as
the trainer scores them (fp32, two images of different sizes, n = 2 sharing one encoding, beside a text-only
request), `/generate` returning the expanded prompt and each image's placeholder span, bad images refused with a
400 while the server keeps serving, and the `openai` client sending an image to chat completions."""

from __future__ import annotations

import base64
import json

import httpx
import pytest
import torch

from support.inference import ServerThread, engine_config
from support.vision_models import FAMILIES, image_data_url, png_header, write_servable_vl_model
from tandem.images import PixelEncoder
from tandem.inference.engine import Engine
from tandem.inference.main import eos_token_ids
from tandem.models import load_model
from tandem.models.decoder import Images
from tandem.wire.protocol import SamplingParams

pytest.importorskip("PIL", reason="images need Pillow")
IMAGES = [image_data_url((200, 30, 30), (16, 16)), image_data_url((30, 30, 200), (24, 16), "disc")]


@pytest.fixture(scope="module", params=FAMILIES)
def vl_dir(request, tmp_path_factory):
    return write_servable_vl_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture
def served(vl_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vl_dir)
    config = engine_config(vl_dir, device="cpu", model={"name": str(vl_dir), "dtype": "float32"})
    model = load_model(vl_dir, dtype=torch.float32)
    engine = Engine(
        model, config, tokenizer=tokenizer, eos_token_ids=eos_token_ids(vl_dir, tokenizer), pixels=PixelEncoder(vl_dir)
    ).start()
    yield engine, tokenizer
    engine.stop()


def _prompt(tokenizer, images: list[str]) -> list[int]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    messages = [{"role": "user", "content": [*parts, {"type": "text", "text": "what is shown?"}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _trainer_logprobs(vl_dir, prompt, refs, tokens) -> torch.Tensor:
    """The trainer's scoring, its images encoded from their references as the RL trainer encodes a rollout's."""
    model = load_model(vl_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens])
    extra = {"images": Images(*PixelEncoder(vl_dir).encode(refs))} if refs else {}
    with torch.no_grad():
        logprobs = model(ids, **extra)[0, len(prompt) - 1 : -1].log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(tokens)[:, None])[:, 0].double()


def test_samples_are_scored_as_the_trainer_scores_them(vl_dir, served):
    engine, tokenizer = served
    prompt, images = engine.expand_images(_prompt(tokenizer, IMAGES), IMAGES)
    spans = images.spans
    assert [end - start for start, end in spans] == [4, 6]  # 16 x 16 and 24 x 16 pixels in 4 x 4 patches, 2 x 2
    assert all(prompt[start:end] == [prompt[spans[0][0]]] * (end - start) for start, end in spans)
    text = _prompt(tokenizer, [])
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=3)
    finished = {}
    for name, ids, request_images, n in (("image", prompt, images, 2), ("text", text, None, 1)):
        engine.submit(ids, params, lambda u, name=name: u.finished and finished.setdefault(name, u), n=n,
                      images=request_images)  # fmt: skip
    from support.polling import wait_until

    wait_until(lambda: len(finished) == 2, "both requests to finish")
    assert images.embeds is not None and images.pixel_values is None  # encoded once, for both samples; pixels freed
    for name, ids, refs in (("image", prompt, IMAGES), ("text", text, None)):
        for sample in finished[name].samples:
            p = _trainer_logprobs(vl_dir, ids, refs, sample.token_ids)
            q = torch.tensor(sample.logprobs, dtype=torch.float64)
            kl = (torch.exp(q - p) - (q - p) - 1).mean().item()
            assert abs(kl) < 1e-6 and (p - q).abs().max() < 1e-5, (name, (p - q).abs().max())


def test_generate_expands_images_and_refuses_bad_ones(vl_dir, served, tmp_path):
    engine, tokenizer = served
    server = ServerThread(engine, tokenizer, tmp_path)
    try:
        prompt = _prompt(tokenizer, IMAGES[:1])
        body = {"prompt_token_ids": [prompt, _prompt(tokenizer, [])], "images": [IMAGES[:1], []],
                "sampling": {"max_tokens": 3, "temperature": 0}}  # fmt: skip
        answer = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        with_image, text_only = answer.json()["outputs"]
        (span,) = with_image["image_spans"]
        image_token = json.loads((vl_dir / "config.json").read_text())["image_token_id"]
        assert span[1] - span[0] == 4 and with_image["prompt_token_ids"][span[0] : span[1]] == [image_token] * 4
        assert with_image["prompt_token_count"] == len(prompt) + 3 and text_only.get("image_spans") is None
        corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode()
        for urls, reason in (
            ([corrupt], "not an image"),
            (["/etc/passwd"], "data URLs only"),
            (["https://example.com/a.png"], "data URLs only"),
            (IMAGES, "2 images"),  # one placeholder for two images
        ):
            body = {"prompt_token_ids": prompt, "images": [urls], "sampling": {"max_tokens": 2}}
            refused = httpx.post(f"{server.url}/generate", json=body, timeout=60)
            assert refused.status_code == 400 and reason in refused.text, refused.text
        assert httpx.post(f"{server.url}/generate", json={**body, "images": [IMAGES[:1]]}).status_code == 200
    finally:
        server.stop()


def test_pixel_bombs_and_requests_over_the_pixel_budget_are_refused_before_decoding(served, tmp_path):
    """Headers claiming more pixels than an image may have, or than a request's images may have together (across
    its prompts), get a 400 naming the limit (decoding any of them would say "truncated"); the server answers the
    next request."""
    engine, tokenizer = served
    server = ServerThread(engine, tokenizer, tmp_path)
    try:
        prompt = _prompt(tokenizer, IMAGES[:2])
        bomb, large = png_header(50_000, 50_000), png_header(6_000, 6_000)  # 2.5 G and 36 M pixels claimed
        for images, reason in (
            ([[IMAGES[0], bomb]], "far more than 40,000,000 pixels"),
            ([[png_header(7_000, 6_000)] * 2], "7000 x 6000 pixels, over the limit of 40,000,000"),
            ([[large, large], [large, large]], "144,000,000 pixels together, over the limit of 100,000,000"),
        ):
            body = {"prompt_token_ids": [prompt] * len(images), "images": images, "sampling": {"max_tokens": 2}}
            refused = httpx.post(f"{server.url}/generate", json=body, timeout=60)
            assert refused.status_code == 400 and reason in refused.text, refused.text
        chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": large}}] * 3}],
                "max_tokens": 2}  # fmt: skip
        refused = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
        assert refused.status_code == 400 and "max_request_image_pixels" in refused.text, refused.text
        body = {"prompt_token_ids": prompt, "images": [IMAGES[:2]], "sampling": {"max_tokens": 2}}
        assert httpx.post(f"{server.url}/generate", json=body, timeout=60).status_code == 200
    finally:
        server.stop()


def test_the_openai_client_sends_an_image(served, tmp_path):
    import openai

    engine, tokenizer = served
    server = ServerThread(engine, tokenizer, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        content = [{"type": "image_url", "image_url": {"url": IMAGES[0]}}, {"type": "text", "text": "what is shown?"}]
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=4, temperature=0
        )
        expanded, _ = engine.expand_images(_prompt(tokenizer, IMAGES[:1]), IMAGES[:1])
        assert reply.usage.prompt_tokens == len(expanded) == len(_prompt(tokenizer, IMAGES[:1])) + 3  # 4 patches
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError, match="data URLs only"):
            content[0]["image_url"]["url"] = "https://example.com/a.png"
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=2)
    finally:
        server.stop()


def _greedy_on_cuda(vl_dir, graphs: bool) -> dict[str, list[int]]:
    """Greedy tokens of an image prompt and a text-only one decoded together by an fp32 CUDA engine."""
    from transformers import AutoTokenizer

    from support.polling import wait_until
    from tandem.inference.cuda_graphs import GraphedDecoder

    tokenizer = AutoTokenizer.from_pretrained(vl_dir)
    config = engine_config(
        vl_dir, device="cuda", cuda_graphs=graphs, kv_cache_blocks=64, model={"name": str(vl_dir), "dtype": "float32"}
    )
    model = load_model(vl_dir, dtype=torch.float32, device="cuda")
    engine = Engine(
        model, config, tokenizer=tokenizer, eos_token_ids=eos_token_ids(vl_dir, tokenizer), pixels=PixelEncoder(vl_dir)
    ).start()
    try:
        prompt, images = engine.expand_images(_prompt(tokenizer, IMAGES), IMAGES)
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        finished: dict[str, object] = {}
        for name, ids, request_images in (("image", prompt, images), ("text", _prompt(tokenizer, []), None)):
            engine.submit(ids, params, lambda u, name=name: u.finished and finished.setdefault(name, u),
                          images=request_images)  # fmt: skip
        wait_until(lambda: len(finished) == 2, "both requests to finish")
        assert isinstance(engine.runner.decoder, GraphedDecoder) == graphs
        return {name: update.samples[0].token_ids for name, update in finished.items()}
    finally:
        engine.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_give_the_eager_tokens(vl_dir):
    """Decode replayed from CUDA graphs, each row's M-RoPE offset an input column: the eager engine's greedy tokens
    (fp32, as the other graph tests)."""
    assert _greedy_on_cuda(vl_dir, graphs=True) == _greedy_on_cuda(vl_dir, graphs=False)


@pytest.mark.slow
def test_sigterm_during_image_work_ends_the_server_promptly(vl_dir, tmp_path):
    """`tandem inference` with one image thread and a minute of 36-Mpx images queued behind it: SIGTERM ends it
    after the graceful wait and the image in hand, not after the queue (the requests in flight are cancelled, the
    queued image jobs dropped)."""
    import contextlib
    import io
    import signal
    import subprocess
    import sys
    import threading
    import time

    from PIL import Image
    from transformers import AutoTokenizer

    from tandem.inference.main import GRACEFUL_SHUTDOWN_S
    from tandem.testing.progress import tree_state, wait_for

    buffer = io.BytesIO()
    Image.new("1", (6000, 6000), 1).save(buffer, format="PNG")  # 36 M white pixels in ~16 KB
    white = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    command = [
        sys.executable, "-m", "tandem", "inference", "--model", str(vl_dir), "--model.dtype", "float32",
        "--device", "cpu", "--port", "0", "--seq-len", "256", "--image-workers", "1", "--log-interval-s", "0",
        "--output-dir", str(tmp_path), "--run-name", "srv",
    ]  # fmt: skip
    log = tmp_path / "server.log"  # a file, not a pipe: shutdown logs every cancelled request's traceback
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    try:
        server_json = tmp_path / "srv" / "server.json"
        wait_for(lambda: server_json.is_file() or process.poll() is not None, lambda: tree_state([tmp_path]))
        assert process.poll() is None, log.read_text()
        url = json.loads(server_json.read_text())["url"]
        tokenizer = AutoTokenizer.from_pretrained(vl_dir)
        body = {"prompt_token_ids": _prompt(tokenizer, [white] * 2), "images": [[white] * 2],
                "sampling": {"max_tokens": 1}}  # fmt: skip
        started = time.monotonic()
        assert httpx.post(f"{url}/generate", json=body, timeout=300).status_code == 200
        one = time.monotonic() - started
        count = min(400, int(60 / one) + 1)  # a minute of image work or more, one request after another

        def send() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server went away: what SIGTERM is for
                httpx.post(f"{url}/generate", json=body, timeout=300)

        clients = [threading.Thread(target=send, daemon=True) for _ in range(count)]
        for client in clients:
            client.start()
        time.sleep(1.0)  # the requests read and queued behind the one image thread
        assert process.poll() is None
        process.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        process.wait(timeout=count * one)  # without the fix: the whole queue
        elapsed = time.monotonic() - stopping
        assert process.returncode == 0, log.read_text()[-4000:]
        assert elapsed < GRACEFUL_SHUTDOWN_S + (count * one) / 3, (elapsed, count, one)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
