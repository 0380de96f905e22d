"""The sampler: logit bias and penalties, temperature, then top-k, top-p and min-p truncation, then a seeded draw;
vectorised over rows.

For each row (one sequence's next token) with temperature T > 0, on fp32 logits `l` (step 0 for every row):

0. `l += logit_bias - frequency_penalty * c - presence_penalty * (c > 0)`, with `c` the number of times this
   sample has generated each token so far (OpenAI's and vLLM's penalties; the prompt does not count);
1. `z = l / T`; order tokens by `z`, most likely first (ties in the order the sort returns them);
2. the kept ids are the shortest prefix of that order allowed by all of: top-k (the first k), top-p (the
   tokens whose exclusive cumulative probability, renormalised over the top-k, is below top_p), min-p (the
   tokens with `p >= min_p * p_max`); at least one token is always kept;
3. the token is drawn from `softmax(z)` restricted to the kept ids, by the Gumbel-max trick with noise
   computed by hashing (seed, sample index, step, token id): the same seed gives the same token whatever
   else is in the batch, on any device;
4. its logprob is `z[token] - logsumexp(z[kept])`: the log-probability under the distribution it was drawn
   from, exactly what `tandem.models.token_logprobs(..., temperature=T, kept_matrix=...)` recomputes (when there
   is no bias or penalty, which the trainer does not know of).

T = 0 is greedy: the argmax of `l` (after step 0; first index on ties), no truncation, logprob under
`softmax(l)` (T = 1). Top-N logprobs are taken from the same final distribution (greedy: `softmax(l)`). So with a
bias or a penalty the reported logprobs are those of the adjusted distribution actually sampled from (as vLLM's
processed logprobs).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from tandem.inference.decode import copy_to_device
from tandem.wire.protocol import SamplingParams

_MIX = (0x21F0AAAD, 0x735A2D97)  # below 2**31, so products with 32-bit values never overflow int64
_MASK32 = 0xFFFFFFFF
_SECOND_KEY = 0x5BD1E995


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash of non-negative int64 values below 2**32 (elementwise)."""
    x = x ^ (x >> 16)
    x = (x * _MIX[0]) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX[1]) & _MASK32
    return x ^ (x >> 15)


def row_keys(seeds: torch.Tensor, samples: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit keys `[R]` (int64 below 2**32) that, hashed with a token id, give a row's noise for that
    token: one stream per (seed, sample index), one key per step of it."""
    stream = mix32(mix32(mix32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32)) ^ samples)
    key_a = mix32(stream ^ steps)
    return key_a, mix32(key_a ^ _SECOND_KEY)


def gumbel_noise(seeds: torch.Tensor, samples: torch.Tensor, steps: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise `[R, W]` for token ids `ids` `[R, W]` (or `[W]`), keyed per row by seed/sample/step.

    Two keyed hash rounds give one uniform 32-bit value per (row, token id); `-log(-log1p(-w))` keeps full
    precision for the large values that decide the argmax.
    """
    key_a, key_b = (key[:, None] for key in row_keys(seeds, samples, steps))
    bits = mix32(mix32(ids ^ key_a) ^ key_b)
    uniform = ((bits.float() + 0.5) * 2.0**-32).clamp_(max=1 - 2.0**-24)
    return -torch.log(-torch.log1p(-uniform))


def kept_counts(sorted_z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """How long a prefix of each row's descending tempered logits `[R, W]` top-k, top-p and min-p keep."""
    width = sorted_z.shape[1]
    relative = (sorted_z - sorted_z[:, :1]).exp()  # p / p_max
    k = torch.where(top_k > 0, top_k.clamp(max=width), width)
    in_k = (torch.arange(width, device=sorted_z.device) < k[:, None]).float()
    mass = relative * in_k
    before = mass.cumsum(dim=-1) - mass
    by_p = (before < top_p[:, None] * mass.sum(dim=-1, keepdim=True)).sum(dim=-1)
    by_p = torch.where(top_p >= 1, width, by_p)
    by_min_p = (relative >= min_p[:, None]).sum(dim=-1)
    return torch.minimum(torch.minimum(k, by_p), by_min_p).clamp_(min=1)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row parameters of one step on the logits' device, plus host-side row groups."""

    temperature: torch.Tensor  # [R] fp32, 0 = greedy
    divisor: torch.Tensor  # [R] fp32: the temperature, 1 for greedy rows
    top_p: torch.Tensor
    min_p: torch.Tensor
    top_k: torch.Tensor  # [R] int64, 0 = off
    seeds: torch.Tensor  # [R] int64 (any 64-bit pattern)
    samples: torch.Tensor  # [R] int64 sample index within its request
    steps: torch.Tensor  # [R] int64 tokens the sample generated before this one
    truncated: list[int]  # rows whose params may cut the distribution
    plain: list[int]  # the other rows (greedy, or sampled from the whole vocabulary)
    any_sampled_plain: bool
    any_tempered: bool  # some row's temperature is neither 0 nor 1: the logits need dividing
    any_penalised: bool  # some row's logits depend on the tokens it generated (they change every step)
    top_width: int  # the largest top_logprobs asked for (0: none)
    top_k_width: int  # sort width for the truncated rows: max top_k when all of them set top_k, else 0 (all)
    adjust: tuple[torch.Tensor, torch.Tensor] | None = None
    """Additions to the logits, `([2, E] int64 (row, token id), [E] fp32 value)`, summed where they repeat: each
    row's logit bias and penalties. None when no row has any."""

    def next_step(self) -> SamplingBatch:
        """The same rows one token later (each row's `steps` + 1): one device op instead of a rebuild and two
        host-to-device copies, for a decode step that continues the one before it. Only for batches that stay on
        the device, whose logit additions (biases alone) do not change from step to step."""
        if self.any_penalised:
            raise ValueError("penalties change with every token: build the next step's batch from the outputs")
        return replace(self, steps=self.steps + 1)

    @property
    def stays_on_device(self) -> bool:
        """Every row samples from the whole vocabulary, none asks for top logprobs and none is penalised (whose
        next logits need the tokens on the host): `Sampler.on_device`."""
        return not self.truncated and not self.top_width and not self.any_penalised

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        samples: Sequence[int],
        steps: Sequence[int],
        device: torch.device,
        generated: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        """`generated`: each row's tokens generated so far (what penalties count); None: no row has any yet."""
        floats, ints, truncated, plain = [], [], [], []
        any_sampled_plain, any_tempered, top_width, widths = False, False, 0, []
        for row, (p, seed, sample, step) in enumerate(zip(params, seeds, samples, steps, strict=True)):
            floats.append((p.temperature, p.top_p, p.min_p, p.temperature if p.temperature > 0 else 1.0))
            ints.append((max(p.top_k, 0), _signed64(seed), sample, step))
            top_width = max(top_width, p.top_logprobs)
            any_tempered |= p.temperature not in (0, 1)
            if p.truncates:
                truncated.append(row)
                widths.append(p.top_k)
            else:
                plain.append(row)
                any_sampled_plain |= p.temperature > 0
        f, i = torch.tensor(floats, dtype=torch.float32), torch.tensor(ints, dtype=torch.int64)
        f, i = (copy_to_device(t, torch.empty(t.shape, dtype=t.dtype, device=device)) for t in (f, i))
        return cls(
            adjust=_logit_additions(params, generated, device),
            any_penalised=any(p.penalised for p in params),
            temperature=f[:, 0],
            divisor=f[:, 3],
            top_p=f[:, 1],
            min_p=f[:, 2],
            top_k=i[:, 0],
            seeds=i[:, 1],
            samples=i[:, 2],
            steps=i[:, 3],
            truncated=truncated,
            plain=plain,
            any_sampled_plain=any_sampled_plain,
            any_tempered=any_tempered,
            top_width=top_width,
            top_k_width=max(widths) if widths and min(widths) > 0 else 0,
        )


def _logit_additions(
    params: Sequence[SamplingParams], generated: Sequence[Sequence[int]] | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`SamplingBatch.adjust`: one (row, id, value) per biased token and per distinct token a penalised row
    generated, so the cost follows what the rows asked for, not the vocabulary."""
    rows: list[int] = []
    ids: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        rows += [row] * len(p.logit_bias)
        ids += p.logit_bias
        values += p.logit_bias.values()
        if p.penalised and generated is not None:
            counts = Counter(generated[row])
            rows += [row] * len(counts)
            ids += counts
            values += (-(p.frequency_penalty * count + p.presence_penalty) for count in counts.values())
    if not rows:
        return None
    index, value = torch.tensor([rows, ids], dtype=torch.int64), torch.tensor(values, dtype=torch.float32)
    return tuple(copy_to_device(t, torch.empty(t.shape, dtype=t.dtype, device=device)) for t in (index, value))  # type: ignore[return-value]


def _signed64(seed: int) -> int:
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@dataclass
class DrawnTokens:
    """What `Sampler` drew, per row, read back to the host."""

    tokens: list[int]
    logprobs: list[float]
    kept_ids: list[list[int] | None]  # the kept ids (unordered) where the row truncated, else None
    top: list[list[tuple[int, float]]] | None  # top_width (id, logprob) pairs per row, most likely first


def _take(values: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return values if index is None else values[index]


def _adjusted_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """fp32 logits plus the rows' biases and penalties, over each row's temperature (greedy rows: over 1; each
    skipped when no row needs it). Never in place: the logits may be a CUDA graph's output buffer."""
    z = logits.float()
    if batch.adjust is not None:
        index, values = batch.adjust
        z = z.index_put((index[0], index[1]), values, accumulate=True)
    return z / batch.divisor[:, None] if batch.any_tempered else z


def _draw_whole_vocab(
    logits: torch.Tensor, batch: SamplingBatch, index: torch.Tensor | None, triton: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprobs) for rows `index` (None: all) of `logits` that sample from the whole vocabulary.

    With `triton` (CUDA logits, no logit additions) one kernel draws every row in a single read of the logits
    (`tandem.kernels.gumbel`); the torch path below is its reference: the hashed noise alone is ~20 passes over
    `[R, V]`, which at 256 rows of a 152K vocabulary outlasts the model's decode step. Torch's path uses one
    log-softmax kernel, where `logsumexp` launches six: at batch 1 the host's launches set a step's pace."""
    if triton and logits.is_cuda and batch.adjust is None:
        from tandem.kernels.gumbel import gumbel_max

        keys = row_keys(_take(batch.seeds, index), _take(batch.samples, index), _take(batch.steps, index))
        sampled = _take(batch.temperature, index) > 0
        return gumbel_max(_take(logits, index), _take(batch.divisor, index), sampled, *keys)
    z = _take(_adjusted_logits(logits, batch), index)
    pick = z
    if batch.any_sampled_plain:
        ids = torch.arange(z.shape[1], device=z.device)
        noise = gumbel_noise(_take(batch.seeds, index), _take(batch.samples, index), _take(batch.steps, index), ids)
        pick = torch.where(_take(batch.temperature, index)[:, None] > 0, z + noise, z)
    tokens = pick.argmax(dim=-1)
    return tokens, z.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]


class Sampler:
    """Samples the next token of every row of `[R, V]` logits in a few batched tensor ops per row group.

    `triton`: draw whole-vocabulary rows of CUDA logits with the Triton Gumbel-max kernel (the engine sets it
    with its Triton decode kernels); the same tokens as the torch path, in one pass over the logits."""

    def __init__(self, triton: bool = False) -> None:
        self.triton = triton

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> DrawnTokens:
        rows, vocab = logits.shape
        top: list[list[tuple[int, float]]] | None = [[] for _ in range(rows)] if batch.top_width else None
        out = DrawnTokens([0] * rows, [0.0] * rows, [None] * rows, top)
        if batch.plain:
            self._whole_vocab(logits, batch, out)
        if batch.truncated:
            self._truncated(_adjusted_logits(logits, batch), batch, out, vocab)
        return out

    def on_device(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and logprobs `[R]` for a batch of whole-vocabulary rows without top logprobs
        (`batch.stays_on_device`), left on the device: nothing waits for the GPU."""
        if not batch.stays_on_device:
            raise ValueError(
                "only rows that sample from the whole vocabulary, without top logprobs, stay on the device"
            )
        return _draw_whole_vocab(logits, batch, None, self.triton)

    def _whole_vocab(self, logits: torch.Tensor, batch: SamplingBatch, out: DrawnTokens) -> None:
        rows = batch.plain
        index = torch.tensor(rows, device=logits.device) if len(rows) < logits.shape[0] else None
        tokens, logprobs = _draw_whole_vocab(logits, batch, index, self.triton)
        top = None
        if batch.top_width:
            top = _take(_adjusted_logits(logits, batch), index).log_softmax(dim=-1).topk(batch.top_width, dim=-1)
        self._store(out, rows, tokens, logprobs, top, None, None)

    def _truncated(self, z: torch.Tensor, batch: SamplingBatch, out: DrawnTokens, vocab: int) -> None:
        rows = batch.truncated
        index = torch.tensor(rows, device=z.device)
        z = z[index]
        if batch.top_k_width:
            values, order = z.topk(min(batch.top_k_width, vocab), dim=-1)
        else:
            values, order = z.sort(dim=-1, descending=True)
        counts = kept_counts(values, batch.top_k[index], batch.top_p[index], batch.min_p[index])
        kept_mask = torch.arange(values.shape[1], device=z.device) < counts[:, None]  # over the sorted order
        masked = values.masked_fill(~kept_mask, float("-inf"))
        noise = gumbel_noise(batch.seeds[index], batch.samples[index], batch.steps[index], order)
        choice = (masked + noise).argmax(dim=-1)
        tokens = order.gather(1, choice[:, None])[:, 0]
        lse = masked.logsumexp(dim=-1)
        logprobs = values.gather(1, choice[:, None])[:, 0] - lse
        width = min(batch.top_width, values.shape[1])
        top = (masked[:, :width], order[:, :width]) if batch.top_width else None
        widest = int(counts.max())
        kept_ids_flat = order[:, :widest][kept_mask[:, :widest]].tolist()
        kept_ids, start = [], 0
        for count in counts.tolist():
            kept_ids.append(kept_ids_flat[start : start + count] if count < vocab else None)
            start += count
        self._store(out, rows, tokens, logprobs, top, lse, kept_ids)

    @staticmethod
    def _store(
        out: DrawnTokens,
        rows: list[int],
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
        top: tuple[torch.Tensor, torch.Tensor] | None,
        lse: torch.Tensor | None,
        kept_ids: list[list[int] | None] | None,
    ) -> None:
        """`top`: (values, ids) per row; logprobs, or logits to subtract `lse` from."""
        host_tokens, host_logprobs = torch.stack((tokens.double(), logprobs.double())).tolist()  # one device sync
        for row, token, logprob in zip(rows, host_tokens, host_logprobs, strict=True):
            out.tokens[row], out.logprobs[row] = int(token), logprob
        if kept_ids is not None:
            for row, ids in zip(rows, kept_ids, strict=True):
                out.kept_ids[row] = ids
        if top is not None and out.top is not None:
            values, ids = top
            logprobs = values if lse is None else values - lse[:, None]
            for row, row_values, row_ids in zip(rows, logprobs.tolist(), ids.tolist(), strict=True):
                out.top[row] = [(i, v) for i, v in zip(row_ids, row_values, strict=True) if v != float("-inf")]
