"""Checks shared by the hybrid families (a recurrent-state layer beside attention: Nemotron-H's Mamba-2, Qwen3-Next's
Gated DeltaNet): padded and long causal rows, packed rows against transformers document by document, a packed row's
values and gradients against each document alone, a chunked scan against its recurrent reference, and prefill +
decode through a `StateCache`.

transformers does not keep packed documents apart in these layers, so a packed row is compared with each document
run through it alone instead of with `support.model_parity.assert_packed_parity`'s document mask.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from support.model_parity import PACKED_ROWS, assert_padded_parity, packed
from support.tolerance import K_REFERENCE, K_SCAN, K_SCAN_GRADIENT, assert_close_scaled, ulps_apart
from tandem.models import KVCache
from tandem.models.layers.state_cache import StateCache


def assert_padded_and_causal_parity(model: torch.nn.Module, hf: torch.nn.Module, label: str, length: int) -> None:
    """`assert_padded_parity`, then two unpadded rows of `length` tokens against transformers: a `length` past the
    model's scan chunk covers the state carried from one chunk to the next."""
    assert_padded_parity(model, hf, label)
    ids = torch.randint(3, model.args.vocab_size, (2, length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close_scaled(model(ids), hf(ids).logits, K_REFERENCE, msg=f"{label}: causal")


def assert_packed_rows_match_per_document(model: torch.nn.Module, hf: torch.nn.Module) -> None:
    """Each document of a packed row (positions restart) matches transformers run on that document alone, and the
    resets matter: without `position_ids` the documents leak into each other."""
    rows = [packed(lengths, model.args.vocab_size, seed=r + 1) for r, lengths in enumerate(PACKED_ROWS)]
    ids, pos = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    with torch.no_grad():
        ours = model(ids, pos)
        leaky = model(ids)
        for r, lengths in enumerate(PACKED_ROWS):
            start = 0
            for n in lengths:
                ref = hf(ids[r : r + 1, start : start + n]).logits[0]
                assert_close_scaled(ours[r, start : start + n], ref, K_REFERENCE, msg=f"row {r} document at {start}")
                start += n
    assert ulps_apart(leaky, ours) > 100 * K_REFERENCE  # documents would leak into each other without the resets


PACKED_LENGTHS = [5, 11, 3, 9]
"""Documents of one packed row: with chunks of 8, they straddle chunk edges."""


def assert_packed_row_equals_documents(model: torch.nn.Module, recurrent_param: str) -> None:
    """One packed row against each document alone: outputs and every parameter's gradient (training packs rows, so
    the resets must hold backwards too). `recurrent_param`, a substring of a parameter name, proves the recurrent
    layer's parameters got gradients at all."""
    vocab = model.args.vocab_size
    ids, pos = packed(PACKED_LENGTHS, vocab, seed=7)
    weights = torch.randn(sum(PACKED_LENGTHS), vocab, generator=torch.Generator().manual_seed(8))

    out = model(ids[None], pos[None])[0]
    (out * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad()
    start, outs = 0, []
    for n in PACKED_LENGTHS:
        alone = model(ids[None, start : start + n])[0]
        (alone * weights[start : start + n]).sum().backward()
        outs.append(alone.detach())
        start += n
    assert_close_scaled(out.detach(), torch.cat(outs), K_SCAN, msg="packed row vs documents alone")
    assert any(recurrent_param in n for n in packed_grads)
    for name, param in model.named_parameters():
        if name in packed_grads:
            assert_close_scaled(packed_grads[name], param.grad, K_SCAN_GRADIENT, msg=name)


def scan_resets(batch: int = 2, seq: int = 19) -> torch.Tensor:
    """Resets anywhere: every row's first token, a chunk's first token, mid-chunk and consecutive ones."""
    resets = torch.zeros(batch, seq, dtype=torch.bool)
    resets[:, 0] = True
    resets[0, [4, 8, 9, 13]] = True
    resets[1, [6, 16]] = True
    return resets


def assert_chunked_equals_recurrent(
    chunked: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    recurrent: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    initial_state: torch.Tensor,
    chunk_size: int,
) -> None:
    """A chunked scan kernel equals its token-by-token reference (`f(*inputs, resets=, initial_state=)` -> output,
    final state), without and with `scan_resets`: outputs, final states and the inputs' gradients."""
    for r in (None, scan_resets(*inputs[0].shape[:2])):
        ref_in = [t.clone().requires_grad_() for t in inputs]
        ref, ref_state = recurrent(*ref_in, resets=r, initial_state=initial_state)
        our_in = [t.clone().requires_grad_() for t in inputs]
        out, out_state = chunked(*our_in, resets=r, initial_state=initial_state, chunk_size=chunk_size)
        assert_close_scaled(out, ref, K_SCAN, msg="output")
        assert_close_scaled(out_state, ref_state, K_SCAN, msg="final state")
        (ref.sum() + ref_state.sum()).backward()
        (out.sum() + out_state.sum()).backward()
        for a, b in zip(ref_in, our_in, strict=True):
            assert_close_scaled(b.grad, a.grad, K_SCAN_GRADIENT, msg="input gradient")


STATE_PROMPTS = (5, 11, 3)
STATE_DECODE_STEPS = 4
STATE_SLOTS = 4
"""`assert_state_cache_matches_forward`'s prompt lengths, decode steps and `StateCache` slots."""


def assert_state_cache_matches_forward(model: torch.nn.Module) -> None:
    """Three prompts prefilled in two chunks (the second continues the conv and recurrent states), then decoded
    token by token: logits equal the full forward's. The slots start filled with stale values, so a slot reused by
    a new sequence must start from zero."""
    prompts, steps = STATE_PROMPTS, STATE_DECODE_STEPS
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, model.args.vocab_size, (n + steps,), generator=g) for n in prompts]
    cache = KVCache.for_model(model.args, num_blocks=3, block_size=max(map(len, seqs)))
    state = StateCache.for_model(model.args, num_slots=STATE_SLOTS)
    first_layer = min(state.recurrent)
    state.recurrent[first_layer].fill_(7.0)  # stale state in the slots must not leak into fresh sequences
    state.conv[first_layer].fill_(7.0)
    tables, slots = [[2], [0], [1]], [3, 0, 1]
    with torch.no_grad():
        full = [model(s[None])[0] for s in seqs]
        first = [min(n, 3) for n in prompts]
        batch = cache.batch(first, [0, 0, 0], tables)
        model.prefill(torch.cat([s[:n] for s, n in zip(seqs, first, strict=True)]), cache, batch, state,
                      state.batch(slots, [0, 0, 0]))  # fmt: skip
        rest = [n - f for n, f in zip(prompts, first, strict=True)]
        live = [i for i, n in enumerate(rest) if n]
        batch = cache.batch([rest[i] for i in live], [first[i] for i in live], [tables[i] for i in live])
        logits = model.prefill(
            torch.cat([seqs[i][first[i] : prompts[i]] for i in live]),
            cache,
            batch,
            state,
            state.batch([slots[i] for i in live], [first[i] for i in live]),
        )
        for row, i in enumerate(live):
            assert_close_scaled(logits[row], full[i][prompts[i] - 1], K_SCAN, msg="chunked prefill")
        for step in range(steps):
            lens = [n + step for n in prompts]
            batch = cache.batch([1, 1, 1], lens, tables)
            tokens = torch.stack([s[n] for s, n in zip(seqs, lens, strict=True)])
            logits = model.decode(tokens, cache, batch, state, state.batch(slots, lens))
            for i, n in enumerate(lens):
                assert_close_scaled(logits[i], full[i][n], K_SCAN, msg=f"decode step {step}")


def step_kernel_and_torch(
    steps: dict[str, Callable[..., torch.Tensor]], inputs: Sequence[torch.Tensor], states: torch.Tensor, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's Triton kernel (`steps["triton"]`) and torch step (`steps["torch"]`) on one token for three
    sequences in slots 4, 0 and 2 of the five-slot cache `states`, the middle one fresh (its slot's stale state
    ignored), the slots a strided column as in the engine's step inputs. Asserts both leave every slot the same
    and slots 1 and 3 untouched; returns the kernel's output and the torch step's."""
    slots = torch.tensor([[4, 9], [0, 9], [2, 9]], device=device)[:, 0]
    fresh = torch.tensor([False, True, False], device=device)
    runs = []
    for name in ("torch", "triton"):
        cache = states.clone().to(device)
        runs.append((steps[name](*(t.to(device) for t in inputs), cache, slots, fresh), cache))
    (out, cache), (want, want_cache) = runs[1], runs[0]
    assert_close_scaled(cache, want_cache, K_SCAN, msg="state cache")
    assert torch.equal(cache[[1, 3]].cpu(), states[[1, 3]])
    return out, want
