"""The HTTP layer's guards (tandem.inference.http): the body-size limit, tokenizing and templating off the event
loop, client chat templates, the admin guard against cross-site requests, the broadcast join address, a client
that disconnects mid-body, and the same guards, request checks and queue-depth header on tandem's vLLM routes."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from types import SimpleNamespace

import httpx
import pytest

from support.inference import SEQ_LEN
from support.polling import wait_until
from tandem.inference import client_template
from tandem.inference.http import OFF_LOOP_BYTES
from tandem.inference.weights_receiver import ReceiverEndpoint

USER = [{"role": "user", "content": "hello"}]


@pytest.fixture
def server(make_engine, serve):
    return serve(make_engine())


def _chunks(data: bytes, size: int = 4096):
    for start in range(0, len(data), size):
        yield data[start : start + size]


def test_a_body_over_the_limit_gets_413_before_it_is_read_and_the_server_carries_on(make_engine, serve):
    server = serve(make_engine(), max_body_bytes=4096)
    big = b'{"prompt_token_ids": [' + b"5, " * 3000 + b"5]}"
    declared = httpx.post(f"{server.url}/generate", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and "max_body_bytes" in declared.json()["error"]["message"]
    # no Content-Length: the limit is counted while the chunks arrive
    chunked = httpx.post(f"{server.url}/generate", content=_chunks(big), headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    small = httpx.post(f"{server.url}/generate", json={"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 2}})
    assert small.status_code == 200 and httpx.get(f"{server.url}/health").json()["status"] == "ok"


class HeldTokenizer:
    """The test tokenizer, except that tokenizing or templating a marked prompt waits until the test lets it go,
    so the test knows that work is in progress (and where it runs) without depending on how long it takes."""

    MARK = "HELD"

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.started, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def _hold(self, text) -> None:
        if isinstance(text, str) and self.MARK in text:
            self.started.set()
            assert self.release.wait(60), "the test never released the tokenizer"

    def __call__(self, text, **kwargs):
        self._hold(text)
        return self._tokenizer(text, **kwargs)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_health_answers_while_a_huge_prompt_is_being_tokenized(route, make_engine, serve, tokenizer):
    held = HeldTokenizer(tokenizer)
    server = serve(make_engine(), tokenizer=held, max_prompt_chars=2_000_000)  # a prompt the tokenizer gets
    text = HeldTokenizer.MARK + " the quick brown fox" * 50_000  # 1 MB: far beyond the context
    body = (
        {"prompt": text, "max_tokens": 4}
        if route == "/v1/completions"
        else {"messages": [{"role": "user", "content": text}], "max_tokens": 4}
    )
    result = {}
    big = threading.Thread(
        target=lambda: result.update(reply=httpx.post(f"{server.url}{route}", json=body, timeout=120))
    )
    big.start()
    try:
        assert held.started.wait(60), "the big request never reached the tokenizer"
        health = httpx.get(f"{server.url}/health", timeout=30)  # while the tokenizer is held
        other = httpx.post(
            f"{server.url}/generate", json={"prompt_token_ids": [5, 6], "sampling": {"max_tokens": 2}}, timeout=30
        )
        assert health.status_code == 200 and other.status_code == 200
        assert big.is_alive()
    finally:
        held.release.set()
        big.join(120)
    assert result["reply"].status_code == 400 and "context" in result["reply"].json()["error"]["message"]


class SpyTokenizer:
    """The test tokenizer, recording the length of every text it tokenizes."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self.lengths = tokenizer, []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, text, **kwargs):
        self.lengths.append(len(text))
        return self._tokenizer(text, **kwargs)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_far_beyond_the_context_is_refused_from_its_beginning(route, make_engine, serve, tokenizer):
    spy = SpyTokenizer(tokenizer)
    server = serve(make_engine(), tokenizer=spy, max_prompt_chars=10**6)  # under it: the beginning is tried
    text = "the quick brown fox jumps over the lazy dog. " * 5000  # 225k characters, the context 256 tokens
    body = {"prompt": text} if route == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    reply = httpx.post(f"{server.url}{route}", json=body)
    assert reply.status_code == 400 and "leaves no room" in reply.json()["error"]["message"], reply.text
    assert spy.lengths and max(spy.lengths) < len(text) // 10  # only a beginning was tokenized
    fits = {"prompt": text[:200]} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{server.url}{route}", json={**fits, "max_tokens": 2}).status_code == 200


def _prompt_body(route: str, text: str) -> dict:
    return {"prompt": text} if route == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_text_over_max_prompt_chars_is_refused_before_the_tokenizer_runs(route, make_engine, serve, tokenizer):
    """A 1 MB prompt without whitespace (tokenized whole it took seconds and hundreds of MB; 10 MB, 17 s and
    2.6 GB): a 400 naming the limit, the tokenizer never called, and the server answers the next request."""
    spy = SpyTokenizer(tokenizer)
    server = serve(make_engine(), tokenizer=spy)
    limit = 32 * SEQ_LEN  # the default: 32 characters per token of the context
    bodies = [_prompt_body(route, "x" * 1_000_000), _prompt_body(route, "x" * (limit + 1))]
    if route == "/v1/completions":
        bodies.append({"prompt": ["hello", "x" * 1_000_000]})
    for body in bodies:
        reply = httpx.post(f"{server.url}{route}", json=body, timeout=60)
        assert reply.status_code == 400, reply.text
        assert f"more than this server tokenizes: max_prompt_chars = {limit}" in reply.json()["error"]["message"]
        assert all(length <= limit for length in spy.lengths)
    assert max(spy.lengths, default=0) <= len("hello")
    # under the limit (a chat template adds a few characters) the text is tokenized, and refused for the context
    at_limit = httpx.post(f"{server.url}{route}", json=_prompt_body(route, "ab " * ((limit - 100) // 3)), timeout=60)
    assert at_limit.status_code == 400 and "max_prompt_chars" not in at_limit.json()["error"]["message"]
    fits = httpx.post(f"{server.url}{route}", json={**_prompt_body(route, "hello"), "max_tokens": 2}, timeout=60)
    assert fits.status_code == 200 and httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_max_prompt_chars_is_configurable(make_engine, serve):
    server = serve(make_engine(), max_prompt_chars=100)
    reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a " * 51, "max_tokens": 2})
    assert reply.status_code == 400 and "102 characters" in reply.json()["error"]["message"]
    assert "max_prompt_chars = 100" in reply.json()["error"]["message"]
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "a " * 50, "max_tokens": 2}).status_code == 200


def test_a_large_json_body_is_parsed_and_served(server):
    prompt = [5] * (OFF_LOOP_BYTES // 3)  # "5, " per token: above the size parsed on a worker thread
    reply = httpx.post(f"{server.url}/generate", json={"prompt_token_ids": prompt})
    assert reply.status_code == 400 and f"the prompt has {len(prompt)} tokens" in reply.json()["error"]["message"]


ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"


def test_client_chat_templates_are_refused_unless_trusted_and_then_limited(make_engine, serve, tokenizer, monkeypatch):
    untrusted = serve(make_engine())
    for kwargs, message in [
        ({"chat_template": "{{ messages[0]['content'] }}"}, "trust_request_chat_template"),
        ({"tokenize": True}, "set by the server"),
        ({"add_generation_prompt": False}, "set by the server"),
    ]:
        reply = httpx.post(
            f"{untrusted.url}/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": kwargs}
        )
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text
    ok = httpx.post(
        f"{untrusted.url}/v1/chat/completions",
        json={"messages": USER, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert ok.status_code == 200

    monkeypatch.setattr(client_template, "TEMPLATE_TIMEOUT_S", 0.5)
    trusted = serve(make_engine(), trust_request_chat_template=True)
    chat = f"{trusted.url}/v1/chat/completions"
    own = {"chat_template": "<<{{ messages[0]['content'] }}>>"}
    reply = httpx.post(
        chat, json={"messages": USER, "max_tokens": 2, "return_token_ids": True, "chat_template_kwargs": own}
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["prompt_token_ids"] == tokenizer("<<hello>>", add_special_tokens=False).input_ids
    endless = httpx.post(chat, json={"messages": USER, "chat_template_kwargs": {"chat_template": ENDLESS}}, timeout=60)
    assert endless.status_code == 400 and "longer than 0.5s" in endless.json()["error"]["message"]
    huge = {"chat_template": "x" * (client_template.MAX_TEMPLATE_CHARS + 1)}
    assert httpx.post(chat, json={"messages": USER, "chat_template_kwargs": huge}).status_code == 400
    assert httpx.get(f"{trusted.url}/health").json()["status"] == "ok"


def _paused(server) -> bool:
    return httpx.get(f"{server.url}/health").json()["paused"]


def test_admin_routes_refuse_what_a_browser_page_on_another_site_can_send(server):
    pause = f"{server.url}/pause"
    port = server.url.rsplit(":", 1)[1]
    refused = [
        ({"content-type": "text/plain"}, b"{}", 415),  # a cross-site fetch needs no preflight for this
        ({"content-type": "application/x-www-form-urlencoded"}, b"a=1", 415),  # an HTML form
        ({"content-type": "application/x-www-form-urlencoded"}, b"", 415),
        ({"origin": "http://evil.example"}, b"", 403),
        ({"origin": "http://evil.example", "content-type": "application/json"}, b"{}", 403),
        ({"origin": f"http://evil.example:{port}"}, b"", 403),  # a DNS-rebound name for this server
        ({"origin": "http://127.0.0.1:1"}, b"", 403),  # another local site
        ({"origin": "null"}, b"", 403),
    ]
    for headers, body, status in refused:
        reply = httpx.post(pause, headers=headers, content=body)
        assert reply.status_code == status, (headers, reply.text)
        assert not _paused(server)
    weights = httpx.post(
        f"{server.url}/update_weights", headers={"content-type": "text/plain"}, content=b'{"path": "x", "version": 1}'
    )
    assert weights.status_code == 415
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}", None):  # this server's own pages, scripts
        headers = {"origin": origin} if origin else {}
        assert httpx.post(pause, headers=headers).status_code == 200 and _paused(server)
        assert httpx.post(f"{server.url}/resume", headers=headers, json={}).status_code == 200
    assert not _paused(server)


def test_a_broadcast_join_connects_only_to_loopback_or_configured_hosts(server):
    join = {"kind": "broadcast", "host": "10.1.2.3", "port": 29500, "backend": "gloo", "timeout_s": 1.0, "rank": 1}
    join["world_size"] = 2
    reply = httpx.post(f"{server.url}/weights/join", json=join)
    assert reply.status_code == 403 and "broadcast_hosts" in reply.json()["error"]["message"]
    for port in (0, 70000):
        assert httpx.post(f"{server.url}/weights/join", json={**join, "port": port}).status_code == 400
    assert httpx.post(f"{server.url}/weights/join", json={**join, "kind": "shared"}).status_code == 400  # no backend
    assert httpx.get(f"{server.url}/weights").json()["state"] == "idle"
    endpoint = ReceiverEndpoint(server.engine, ["10.1.2.3"])
    endpoint._check_host("10.1.2.3")
    endpoint._check_host("127.0.0.1")
    endpoint._check_host("::1")


def test_a_client_that_disconnects_mid_body_costs_one_log_line(server, caplog):
    port = int(server.url.rsplit(":", 1)[1])
    head = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    with caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(head + b'{"prompt_token_ids": [5, ')
        wait_until(lambda: any("disconnected" in r.getMessage() for r in caplog.records), message="the log line")
        assert httpx.get(f"{server.url}/health").status_code == 200
    logged = [r for r in caplog.records if r.name.startswith(("tandem", "uvicorn"))]
    assert sum("disconnected" in r.getMessage() for r in logged) == 1, [r.getMessage() for r in logged]
    assert not any(r.exc_info or r.levelno >= logging.ERROR for r in logged), [r.getMessage() for r in logged]


class FakeVllmEngine:
    """The parts of vLLM's EngineClient the admin routes, the request checks and the queue depth use: 7 requests
    unfinished, at most 4 running."""

    def __init__(self) -> None:
        self.paused = False
        self.model_config = SimpleNamespace(max_model_len=64, max_logprobs=5, get_vocab_size=lambda: 100)
        self.vllm_config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4))
        self.output_processor = SimpleNamespace(get_num_unfinished_requests=lambda: 7)

    async def check_health(self) -> None:
        return None

    async def is_paused(self) -> bool:
        return self.paused

    async def get_weight_version(self) -> str:
        return "3"

    async def pause_generation(self, **kwargs) -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        self.paused = False


def test_the_vllm_routes_share_the_guards(monkeypatch, tmp_path):
    from starlette.applications import Starlette
    from starlette.middleware import Middleware

    from tandem.inference.vllm.routes import SETTINGS_ENV, RouteSettings, TandemRoutes

    settings = RouteSettings(
        model_dir=str(tmp_path), model_name="tiny", weights_dir=str(tmp_path), admin_token=None,
        exact_replay=True, run_dir=str(tmp_path), max_body_bytes=1024,
    )  # fmt: skip
    monkeypatch.setenv(SETTINGS_ENV, settings.to_env())
    app = Starlette(middleware=[Middleware(TandemRoutes)])
    engine = app.state.engine_client = FakeVllmEngine()

    async def calls() -> None:
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as http:
            assert (await http.post("/pause", headers={"content-type": "text/plain"}, content=b"{}")).status_code == 415
            assert (await http.post("/pause", headers={"origin": "http://evil.example"})).status_code == 403
            assert not engine.paused
            too_big = await http.post("/generate", json={"prompt_token_ids": [5] * 1000})
            assert too_big.status_code == 413
            wrong_model = await http.post("/generate", json={"prompt_token_ids": [5], "model": "gpt-9"})
            assert wrong_model.status_code == 404 and "not served here" in wrong_model.json()["error"]["message"]
            # the built-in engine's checks, with this server's limits, before vLLM is asked
            for sampling, words in [
                ({"top_p": 0.9}, "returns no kept ids"),
                ({"max_tokens": 64}, "does not fit"),
                ({"top_logprobs": 6}, "max_logprobs"),
                ({"stop_token_ids": [100]}, "stop_token_ids"),
            ]:
                refused = await http.post("/generate", json={"prompt_token_ids": [5], "sampling": sampling})
                assert refused.status_code == 400 and words in refused.json()["error"]["message"], sampling
                assert refused.headers["x-queue-depth"] == "3"
            outside = await http.post("/generate", json={"prompt_token_ids": [100]})
            assert outside.status_code == 400 and "prompt token ids" in outside.json()["error"]["message"]
            older = await http.post("/update_weights", json={"path": "policy-2", "version": 2})
            assert older.status_code == 409 and "older than the served version 3" in older.json()["error"]["message"]
            assert (await http.post("/pause")).status_code == 200 and engine.paused

    asyncio.run(calls())


def test_tandem_rl_lets_its_servers_join_the_trainers_broadcast_address():
    from tandem.config import load_config
    from tandem.config.rl import RlConfig
    from tandem.launch import _configure, server_configs

    argv = ["--trainer.weights.transport", "broadcast", "--trainer.weights.host", "10.0.0.7"]
    wired = _configure(load_config(RlConfig, argv)[0], 0)
    assert all(server.broadcast_hosts == ["10.0.0.7"] for server in server_configs(wired).values())
    assert _configure(load_config(RlConfig, argv[:2])[0], 0).inference.broadcast_hosts == []  # loopback: nothing to add
