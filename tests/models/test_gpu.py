"""GPU backends: flex attention, CUDA grouped_mm, compile with flex inside a block. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.models import KVCache, Logprobs, ModelRuntime, load_model, reference_token_logprobs, token_logprobs
from tandem.models.layers import attention_inputs
from tandem.models.layers import moe as moe_module
from tandem.models.layers.moe import MoE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _packed(vocab: int, lengths=(37, 100, 91)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids.cuda(), pos.cuda()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_flex_matches_sdpa_forward_and_backward(model_dir):
    """fp32: flex == SDPA. bf16: flex is as close to the fp32 result as bf16 SDPA is (kernels round differently)."""
    path = model_dir("qwen3")
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for backend in ("sdpa", "flex"):
            model = load_model(path, dtype=dtype, device="cuda", runtime=ModelRuntime(attn_backend=backend))
            ids, pos = _packed(model.args.vocab_size)
            out = model(ids, pos, head=Logprobs(ids.roll(-1, 1)))
            out.logprobs.sum().backward()
            results[backend, dtype] = (out.logprobs.detach(), model.layers[0].self_attn.qkv_proj.weight.grad)
    for got, want in zip(results["flex", torch.float32], results["sdpa", torch.float32], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    truth = results["sdpa", torch.float32]
    for flex, sdpa, ref in zip(results["flex", torch.bfloat16], results["sdpa", torch.bfloat16], truth, strict=True):
        assert _rel_err(flex, ref) < 2 * _rel_err(sdpa, ref) + 1e-3


def test_auto_picks_flex_on_cuda():
    pos = torch.arange(8, device="cuda")[None]
    assert attention_inputs("auto", pos.device, pos, None).block_mask is not None


@pytest.mark.parametrize("tokens", [5, 333])
def test_cuda_grouped_mm_matches_loop(tokens):
    torch.manual_seed(0)
    layers = {}
    for backend in ("loop", "grouped_mm"):
        layer = MoE(256, 128, num_experts=16, top_k=4, norm_topk_prob=True, backend=backend)
        torch.manual_seed(1)
        for p in layer.parameters():
            p.data = torch.randn_like(p) * 0.05
        layers[backend] = layer.cuda().bfloat16()
    x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
    assert moe_module._grouped_mm_unsupported(x, layers["grouped_mm"].experts.gate_up_proj.transpose(1, 2)) is None
    outs = {}
    for backend, layer in layers.items():
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.float().square().sum().backward()
        outs[backend] = (out.detach().float(), xi.grad.float(), layer.experts.gate_up_proj.grad.float())
    for got, want in zip(outs["grouped_mm"], outs["loop"], strict=True):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_bf16_model_as_close_to_fp32_as_transformers(model_dir, arch):
    """Dense models: in MoE models bf16 rounding flips near-tied router choices, a lottery for both sides."""
    path = model_dir(arch)
    ids = torch.randint(3, 500, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    logits = {}
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            kw = {"dtype": dtype, "attn_implementation": "eager"}
            logits["hf", dtype] = AutoModelForCausalLM.from_pretrained(path, **kw).cuda().eval()(ids).logits
            logits["ours", dtype] = load_model(path, dtype=dtype, device="cuda")(ids)
    truth = logits["hf", torch.float32]
    assert _rel_err(logits["ours", torch.float32], truth) < 1e-5
    ours, theirs = _rel_err(logits["ours", torch.bfloat16], truth), _rel_err(logits["hf", torch.bfloat16], truth)
    print(f"{arch} bf16 relative logit error vs fp32: tandem {ours:.4f}, transformers {theirs:.4f}")
    assert ours < 1.5 * theirs + 1e-3


def test_kv_cache_on_cuda(model_dir):
    model = load_model(model_dir("llama"), device="cuda").eval()
    a = model.args
    cache = KVCache(a.num_layers, 8, 16, a.num_kv_heads, a.head_dim, device="cuda")
    seqs = [torch.randint(3, 500, (n,), device="cuda") for n in (20, 7)]
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        logits = model.prefill(
            torch.cat([s[:-1] for s in seqs]), cache, cache.batch([19, 6], [0, 0], [[3, 1], [5, -1]])
        )
        torch.testing.assert_close(logits, torch.stack([full[0][18], full[1][5]]), atol=1e-4, rtol=1e-4)
        step = model.decode(torch.stack([s[-1] for s in seqs]), cache, cache.batch([1, 1], [19, 6], [[3, 1], [5, -1]]))
        torch.testing.assert_close(step, torch.stack([full[0][19], full[1][6]]), atol=1e-4, rtol=1e-4)


def test_chunked_logprobs_memory_and_values_on_cuda():
    tokens, vocab, hidden = 4096, 151_936, 1024
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_(True)
    t = torch.randint(0, vocab, (tokens,), device="cuda")
    peaks = {}
    for name, fn, kw in (("naive", reference_token_logprobs, {}), ("chunked", token_logprobs, {"chunk_size": 1024})):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn(h, w, t, **kw)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        torch.cuda.synchronize()
        peaks[name] = (torch.cuda.max_memory_allocated() - base, out.logprobs.detach(), h.grad.float())
        h.grad = w.grad = None
    print({k: f"{v[0] / 2**20:.0f} MiB" for k, v in peaks.items()})
    torch.testing.assert_close(peaks["chunked"][1], peaks["naive"][1], atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(peaks["chunked"][2], peaks["naive"][2], atol=1e-2, rtol=5e-2)
    assert peaks["chunked"][0] < peaks["naive"][0] / 4


def test_moe_block_with_flex_compiles_fullgraph_on_cuda(model_dir):
    model = load_model(
        model_dir("qwen3_moe"), dtype=torch.bfloat16, device="cuda", runtime=ModelRuntime(attn_backend="flex")
    )
    ids, pos = _packed(model.args.vocab_size)
    attn = attention_inputs("flex", ids.device, pos, None)
    x = model.embed_tokens(ids).detach()
    cos, sin = model.rotary(pos, x.dtype)
    block = model.layers[0]
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    with torch.no_grad():
        got, want = compiled(x, cos, sin, attn), block(x, cos, sin, attn)
    assert (got.float() - want.float()).abs().max() < 0.1
