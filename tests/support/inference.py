"""What the inference tests share: engine configs, the inference server on a thread, a toolchain guard, random
prompts, the trainer's scoring of what an engine sampled (the RL mismatch check), and greedy agreement up to ties."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from support.servers import AppThread
from support.tolerance import eps
from tandem.config.inference import InferenceConfig
from tandem.inference.engine import Engine
from tandem.inference.server import InferenceServer
from tandem.models import IGNORE_INDEX, Logprobs
from tandem.wire.kept_ids import decode_kept_matrix

SEQ_LEN = 256


def engine_config(path: Path, **overrides) -> InferenceConfig:
    return InferenceConfig(**{"model": {"name": str(path), "dtype": "float32"}, "seq_len": SEQ_LEN, **overrides})


class ServerThread(AppThread):
    """`InferenceServer` for `engine`, serving the model name "tiny" on a free loopback port until `stop()`."""

    def __init__(self, engine: Engine, tokenizer, weights_dir: Path, admin_token: str | None = None, **options) -> None:
        self.engine = engine
        server = InferenceServer(engine, tokenizer, "tiny", admin_token=admin_token, weights_dir=weights_dir, **options)
        super().__init__(server.app())


@contextmanager
def skip_without_inductor_toolchain() -> Iterator[None]:
    """Skip (rather than fail) where inductor cannot build CPU kernels: no usable C++ compiler."""
    try:
        yield
    except Exception as error:
        text = f"{type(error).__name__}: {error}"
        if any(s in text for s in ("CppCompileError", "InvalidCxxCompiler", "cc1plus", "C++ compiler")):
            pytest.skip(f"inductor toolchain unavailable: {type(error).__name__}")
        raise


def random_prompts(count: int, vocab: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """`count` prompts of random ids in [3, vocab) (above the tiny models' special tokens), their lengths drawn
    from `lengths` (a half-open range)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(*lengths, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in sizes]


def trainer_logprobs(
    model: torch.nn.Module,
    prompt: list[int],
    tokens: list[int],
    temperature: float = 1.0,
    encoded_kept_ids: list | None = None,
) -> torch.Tensor:
    """The RL trainer's scoring of `tokens` sampled after `prompt` (fp64 `[len(tokens)]`): a teacher-forced forward
    of `model` at the sampling temperature, over each token's kept ids when sampling truncated (a sample's
    `encoded_kept_ids`; None: the whole vocabulary)."""
    ids = torch.tensor(prompt + tokens)
    targets = ids[1:].clone()
    targets[: len(prompt) - 1] = IGNORE_INDEX
    kept = encoded_kept_ids if encoded_kept_ids is not None else [None] * len(tokens)
    kept_matrix = torch.tensor(decode_kept_matrix([None] * (len(prompt) - 1) + kept))
    head = Logprobs(targets[None], temperature=temperature, kept_matrix=kept_matrix[None])
    with torch.no_grad():
        out = model(ids[None, :-1], head=head)
    return out.logprobs[0, len(prompt) - 1 :].double()


def assert_on_policy(diffs: list[torch.Tensor]) -> None:
    """Trainer minus engine logprobs of every sampled token: mismatch KL (k3) < 1e-6 and every token within 1e-4."""
    d = torch.cat(diffs)
    kl = (d.exp() - 1 - d).mean().item()  # k3 estimate of KL(inference || trainer)
    assert kl < 1e-6 and d.abs().max() < 1e-4, f"mismatch KL {kl:.2e}, max |diff| {d.abs().max():.2e}"


def assert_greedy_agrees_up_to_ties(
    model: torch.nn.Module, prompts: list[list[int]], got: list[list[int]], expected: list[list[int]], k: float
) -> int:
    """Two computations of the same greedy decode (compiled and eager, graphed and eager) give the same tokens,
    except where two logits tie within rounding: at a row's first difference, a forward of `model` over the prompt
    and the tokens both rows share must put both tokens within `k` ulps (of the model's dtype) of its largest logit,
    on either side. After a tie the rows legitimately part. A wrong computation parts at a clear winner (a random
    tiny model's top two are ~0.1 apart, thousands of fp32 ulps) and fails. Returns how many rows parted at a tie."""
    ties, param = 0, next(model.parameters())
    for row, (prompt, a, b) in enumerate(zip(prompts, got, expected, strict=True)):
        assert len(a) == len(b), f"row {row}: {len(a)} tokens, expected {len(b)}"
        split = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if split is None:
            continue
        ids = torch.tensor([prompt + b[:split]], device=param.device)
        with torch.no_grad():
            logits = model(ids)[0, -1].double()
        bound = k * eps(param.dtype, param.device) * logits.abs().max().item()
        top = logits.max().item()
        gaps = {token: top - logits[token].item() for token in (a[split], b[split])}
        assert max(gaps.values()) <= bound, (
            f"row {row} parts at token {split} without a tie: below the top logit by {gaps}, bound {bound:.2e}"
        )
        ties += 1
    return ties
