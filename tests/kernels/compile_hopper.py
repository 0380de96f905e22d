"""Compile every Triton kernel of tandem for Hopper (sm_90) on a machine without a GPU; print one line per launch.

Triton's interpreter runs the kernels on CPU but never type-checks them the way the compiler does (a branch
that redefines a variable with another shape, a dot below its least size, a bad launch option): those errors
appear only on a GPU. Here each kernel wrapper runs on CPU tensors of real model shapes, its launches are
caught before they reach a driver, and each is compiled to Hopper machine code with the ptxas the triton
wheel ships. Run without TRITON_INTERPRET (tests/kernels/test_compile_hopper.py starts it so).

    python tests/kernels/compile_hopper.py
"""

from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

HOPPER = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int8: "*i8",
    torch.uint8: "*u8",
}


def _signature(kernel: JITFunction, bound: dict) -> tuple[dict[str, str], dict[tuple[int, ...], object]]:
    """Triton's argument types for `bound` (name -> value), and the constexpr values by argument position."""
    signature, constexprs = {}, {}
    for index, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[(index,)] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = POINTER_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            signature[param.name] = "fp32"
    return signature, constexprs


@contextmanager
def compiled_launches(compiled: list[str]) -> Iterator[None]:
    """Within it, a kernel launch compiles the kernel for Hopper with the launch's arguments and runs nothing."""
    original = JITFunction.run

    def compile_instead(self: JITFunction, *args, grid, warmup, **kwargs):
        options = {key: kwargs.pop(key) for key in list(kwargs) if key not in self.arg_names}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        bound.apply_defaults()
        signature, constexprs = _signature(self, bound.arguments)
        kernel = triton.compile(ASTSource(self, signature, constexprs), target=HOPPER, options=options)
        flags = ", ".join(
            f"{k}={v}" for k, v in bound.arguments.items() if self.params[self.arg_names.index(k)].is_constexpr
        )
        compiled.append(f"{self.fn.__name__}({flags}): {kernel.metadata.shared} B shared")

    JITFunction.run = compile_instead
    try:
        yield
    finally:
        JITFunction.run = original


Launch = tuple[str, Callable[..., object], tuple, dict]


def _launches() -> Iterator[Launch]:
    """Every kernel as the engine and the trainer launch it, at Qwen3-0.6B's shapes, in bf16 (what GPUs run); the
    attention kernels at one row (keys split over programs) and 32 rows, and the one-kernel attention in fp32
    too (the GPU tests run it). Each is (label, the wrapper, its arguments, its keyword arguments)."""
    from tandem.kernels import decode, delta_scan, gemv, gumbel, rope, ssd, swiglu

    heads, kv_heads, dim, hidden, blocks, block_size = 16, 8, 128, 1024, 40, 16
    for dtype, rows in [(torch.bfloat16, 1), (torch.bfloat16, 32), (torch.float32, 1)]:

        def tensors(*shape, kind=dtype):
            return torch.zeros(*shape, dtype=kind)

        qkv = tensors(rows, (heads + 2 * kv_heads) * dim)
        norms = (tensors(dim), tensors(dim))
        rotation = (1e-6, tensors(rows, dim), tensors(rows, dim))  # eps, cos, sin
        cache = (tensors(blocks, block_size, kv_heads, dim), tensors(blocks, block_size, kv_heads, dim))
        index, tables = torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, 16, dtype=torch.int64)
        keys = (tables, torch.full((rows,), 100, dtype=torch.int64), 0.1, 4 if rows == 1 else 1)
        pdl = {"pdl": True}
        label = f"{dtype}, {rows} rows"
        attention = (qkv, *norms, *rotation, *cache, index, *keys)
        yield f"decode_attention {label}", decode.decode_attention, attention, pdl
        if dtype == torch.float32:
            continue
        yield f"qk_norm_rope_store {label}", decode.qk_norm_rope_store, (qkv, *norms, *rotation, *cache, index), pdl
        yield (
            f"paged_decode_attention {label}",
            decode.paged_decode_attention,
            (tensors(rows, heads, dim), *cache, *keys),
            pdl,
        )
        if rows > 1:  # the rest compile to the same code at any row count
            continue
        norm_args = (tensors(rows, hidden), tensors(rows, hidden), tensors(hidden), 1e-6)
        yield f"add_rms_norm {label}", decode.add_rms_norm, norm_args, {}
        yield f"silu_mul {label}", swiglu.silu_mul, (tensors(rows, 6144),), {}
        yield f"swiglu_backward {label}", swiglu.swiglu_backward, (tensors(rows, 6144), tensors(rows, 3072)), {}
        yield (
            f"rope {label}",
            rope.rope,
            (tensors(1, rows, heads, dim), tensors(1, rows, dim), tensors(1, rows, dim)),
            {},
        )
    rows, vocab = 256, 151_936
    keys = (torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64))
    draw = (torch.zeros(rows, dtype=torch.float32), torch.zeros(rows, dtype=torch.bool), *keys)
    yield "gumbel_max bf16 logits", gumbel.gumbel_max, (torch.zeros(rows, vocab, dtype=torch.bfloat16), *draw), {}
    x = torch.zeros(1, hidden, dtype=torch.bfloat16)
    for config in gemv.CONFIGS[-1:]:  # the same code at every tile size: one suffices
        tile = "x".join(str(config.all_kwargs()[k]) for k in ("BLOCK_N", "BLOCK_K", "num_warps"))
        up = torch.zeros(6144, hidden, dtype=x.dtype)
        yield (
            f"norm_gemv swiglu {tile}",
            gemv.norm_gemv,
            (x, x, x[0], 1e-6, up),
            {"swiglu": True, "pdl": True, "config": config},
        )
        yield f"gemv {tile}", gemv.gemv, (x, torch.zeros(2048, hidden, dtype=x.dtype)), {"config": config}
    # Gated DeltaNet's pass over chunks at Qwen3-Next's widths (32 value heads, dk = dv = 128, chunks of 64), fp32
    batch_heads, chunks, size, dk = (1, 32), 4, 64, 128
    u, w = torch.zeros(*batch_heads, chunks, size, dk), torch.zeros(*batch_heads, chunks, size, dk)
    a, decay = torch.zeros(*batch_heads, chunks, size, size), torch.zeros(*batch_heads, chunks)
    state = torch.zeros(*batch_heads, dk, dk)
    saved = (u, w, w, a, w, decay)
    yield "delta scan forward", delta_scan.scan_forward, (*saved, state), {}
    states = torch.zeros(*batch_heads, chunks, dk, dk)
    yield "delta scan backward", delta_scan.scan_backward, (saved, states, u, state), {}
    # Mamba-2's within-chunk part at Nemotron-H-8B's widths (128 heads of 64, 8 groups, state 128), packed, fp32
    batch, chunks, size, heads, groups = 1, 4, 64, 128, 8
    C, xdt = torch.zeros(batch, chunks, size, groups, 128), torch.zeros(batch, chunks, size, heads, 64)
    cum, seg = torch.zeros(batch, heads, chunks, size), torch.zeros(batch, 1, chunks, size, dtype=torch.int64)
    yield "ssd intra-chunk forward", ssd.intra_forward, (C, C, xdt, cum, seg), {}
    yield "ssd intra-chunk backward", ssd.intra_backward, (C, C, xdt, cum, seg, xdt), {}
    # The decode steps on a state cache of 9 slots, 8 sequences, bf16 inputs, fp32 states: Qwen3-Next's and
    # Nemotron-H-8B's widths
    rows, slots, fresh = 8, torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.bool)
    qk, v = torch.zeros(rows, 16, 128, dtype=torch.bfloat16), torch.zeros(rows, 32, 128, dtype=torch.bfloat16)
    gates = (torch.zeros(rows, 32), torch.zeros(rows, 32, dtype=torch.bfloat16))
    step = (qk, qk, v, *gates, torch.zeros(9, 32, 128, 128), slots, fresh)
    yield "gated delta decode step", delta_scan.gated_delta_step_triton, step, {}
    x, dt, bc = torch.zeros(rows, heads, 64), torch.zeros(rows, heads), torch.zeros(rows, groups, 128)
    step = (x, dt, dt[0], bc, bc, dt[0], torch.zeros(9, heads, 64, 128), slots, fresh)
    yield "ssd decode step", ssd.ssd_step_triton, step, {}


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter's kernels cannot be compiled")
    failures = 0
    for label, wrapper, args, kwargs in _launches():
        compiled: list[str] = []
        try:
            with compiled_launches(compiled):
                wrapper(*args, **kwargs)
        except Exception as error:  # report every kernel that fails, not just the first
            failures += 1
            print(f"FAILED {label}: {type(error).__name__}: {str(error).strip()[:2000]}")
            continue
        print(f"ok {label}: {'; '.join(compiled)}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
