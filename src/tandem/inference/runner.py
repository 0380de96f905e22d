"""The runner: executes the step the scheduler planned on the model, and hands back the tokens to record.

One forward prefills every prompt chunk of the step (`CausalLM.prefill`; with prompt logprobs, from the hidden
states of every token), requests with n > 1 fork once their prompt is cached, one forward decodes a token for
every running sequence (`decode.py`, under CUDA graphs when enabled, on the Triton kernels where chosen), and one
sampler call draws the next token of every sequence that has its whole context cached (`sampling.py`).

A hybrid model (linear-attention layers, `args.is_hybrid`) also gets a `StateCache` beside the KV cache, a slot per
running sequence (the scheduler assigns them); its forwards take the state and the step's `StateBatch`, and a
fork copies the parent's state into its children's slots as it copies the last KV block.

A model served with unfolded LoRA adapters serves the base model too: before every forward the runner writes one
gate per row (1.0 for a request of the adapter, 0.0 for one of the base, `Request.adapter`) into a buffer every
adapted projection reads (`lora.route_adapters`), so one batch mixes both, under CUDA graphs too.

With `overlap_steps`, a decode step whose rows all sample from the whole vocabulary leaves its tokens on the
device (`InFlight`): the next step, when it decodes exactly the same sequences, is launched with those tokens as
inputs before the host reads them, so the request side records the previous step while the GPU computes. A
step that cannot continue the one in flight (a waiting request can join, prefill, a cache out of blocks, a
sequence at its last token) lands it first (`settle`); so do the engine's cancel, pause and stop (`land`).

Only the engine thread calls it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from tandem.config.inference import InferenceConfig
from tandem.inference.cuda_graphs import GraphedDecoder
from tandem.inference.decode import EagerDecoder, StepFunction, copy_to_device, decode_step
from tandem.inference.fused_decode import fused_decode_step, fused_decode_supported
from tandem.inference.kv_budget import block_bytes, state_bytes
from tandem.inference.outputs import PromptLogprobs
from tandem.inference.prompt_images import chunk_features, chunk_positions, step_features
from tandem.inference.prompt_images import encode as encode_images
from tandem.inference.requests import Sampled
from tandem.inference.routed_experts import RoutingRecorder
from tandem.inference.sampling import Sampler, SamplingBatch
from tandem.inference.scheduler import SCRATCH_BLOCK, SCRATCH_SLOT, Request, Scheduler, Sequence, StepPlan
from tandem.kernels import triton_available, triton_unavailable_reason
from tandem.models import CausalLM, KVCache, StateCache
from tandem.models.logprobs import score_tokens
from tandem.models.lora import lora_args, lora_folded, route_adapters
from tandem.wire.protocol import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class InFlight:
    """A decode step sampled on the device that the host has not recorded yet: the next step's input tokens,
    and a copy of tokens and logprobs on its way to host memory."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    """`[R]` on the device, in `seqs` order."""
    host: torch.Tensor
    """`[2, R]` float64: tokens, logprobs (pinned memory on CUDA, filled without blocking)."""
    copied: torch.cuda.Event | None
    version: int
    batch: SamplingBatch
    """The step's sampling parameters; the next step's are these one token later."""

    @classmethod
    def launch(
        cls, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor, version: int, batch: SamplingBatch
    ) -> InFlight:
        values = torch.stack((tokens.double(), logprobs.double()))
        if not tokens.is_cuda:
            return cls(seqs, tokens, values, None, version, batch)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(tokens.device))
        return cls(seqs, tokens, host, copied, version, batch)

    def results(self) -> tuple[list[int], list[float]]:
        if self.copied is not None:
            self.copied.synchronize()
        tokens, logprobs = self.host.tolist()
        return [int(token) for token in tokens], logprobs


class Runner:
    """The model, its KV cache, the decoder and the sampler, driven one planned step at a time."""

    def __init__(self, model: CausalLM, config: InferenceConfig, scheduler: Scheduler, tokenizer: Any) -> None:
        self.model, self.config, self.scheduler, self.tokenizer = model, config, scheduler, tokenizer
        args = model.args
        self.device = model.lm_head_weight.device
        dtype = model.lm_head_weight.dtype
        self.max_model_len = config.seq_len
        num_blocks = scheduler.allocator.num_blocks
        self.cache = KVCache.for_model(args, num_blocks, config.block_size, dtype, self.device)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            config.block_size,
            num_blocks * block_bytes(args, config.block_size, dtype) / 2**30,
        )
        self.state: StateCache | None = None
        """The recurrent state of a hybrid model's linear-attention layers (slot 0 is scratch); None otherwise."""
        if args.is_hybrid:
            slots = scheduler.state_slots
            if slots < config.max_running + 1:
                raise ValueError(f"{args.architecture} keeps a recurrent state: the scheduler needs state_slots")
            self.state = StateCache.for_model(args, slots, dtype, self.device)
            logger.info(
                "recurrent state: %d slots for %d running sequences (%.2f GiB)",
                slots,
                config.max_running,
                state_bytes(args, slots, dtype) / 2**30,
            )
        self.adapter_gates: torch.Tensor | None = None
        """With unfolded LoRA adapters: per row of a forward, 1.0 to run them (`Request.adapter`), 0.0 for the base
        model (`lora.route_adapters`); long enough for any step's rows, a CUDA graph's padding included."""
        # The most rows one forward may have, a CUDA graph's padding included: the per-row buffers' length.
        rows = config.max_prefill_tokens + max(config.max_running, *config.cuda_graph_batch_sizes)
        if lora_args(model) is not None and not lora_folded(model):
            self.adapter_gates = torch.ones(rows, device=self.device)
            route_adapters(model, self.adapter_gates)
        self.routing: RoutingRecorder | None = None
        """With `return_routed_experts`: the buffer the MoE layers write their choices into, filed per sequence."""
        if config.return_routed_experts:
            self.routing = RoutingRecorder(model, rows, self.device)
        self.decoder = self._decoder()
        self.sampler = Sampler(triton=self.decoder.step is fused_decode_step)
        self.in_flight: InFlight | None = None
        self.overlapped_steps = 0
        """Decode steps launched before the host read the previous step's tokens."""

    def _decoder(self) -> EagerDecoder | GraphedDecoder:
        step = self._decode_step()
        compiled = step is not decode_step and step is not fused_decode_step
        # Compiled, a batch of 1 would be a second compilation (size 1 is always specialised, see EagerDecoder);
        # a padded row costs next to nothing in a memory-bound step.
        smallest = 2 if compiled else 1
        if self.config.cuda_graphs and self.device.type == "cuda":
            max_blocks = -(-self.max_model_len // self.config.block_size)
            sizes = [max(b, smallest) for b in self.config.cuda_graph_batch_sizes if b <= self.config.max_running]
            return GraphedDecoder(self.model, self.cache, sizes, max_blocks, step, self.state)
        return EagerDecoder(self.model, self.cache, step, self.state, min_rows=smallest)

    def _decode_step(self) -> StepFunction:
        """The Triton step where asked (auto: on CUDA with triton installed), else the module step, compiled if asked."""
        kernels = self.config.decode_kernels
        unsupported = fused_decode_supported(self.model)
        if kernels == "auto":
            kernels = "triton" if self.device.type == "cuda" and triton_available() and unsupported is None else "torch"
        if kernels == "triton":
            unsupported = unsupported or triton_unavailable_reason(self.device.type)
            if unsupported is not None:
                raise ValueError(f"inference.decode_kernels = triton: {unsupported}")
            if self.config.compile:
                logger.info("decode uses the Triton kernels; inference.compile applies to decode_kernels = torch only")
            logger.info("decode steps run on the Triton decode kernels")
            return fused_decode_step
        return torch.compile(decode_step, dynamic=True) if self.config.compile else decode_step

    # --- what the engine calls ---

    def settle(self) -> Sampled | None:
        """Before the next plan: the step in flight's tokens, read now unless the next step can run on them
        unread (so no plan depends on them)."""
        if self.in_flight is None or self._continues(self.in_flight):
            return None
        return self.land()

    def land(self) -> Sampled | None:
        """The step in flight's tokens, read; None if no step is in flight."""
        step, self.in_flight = self.in_flight, None
        return None if step is None else self._read(step)

    def holds(self, request: Request) -> bool:
        """Whether the step in flight sampled tokens of `request`."""
        return self.in_flight is not None and any(seq.request is request for seq in self.in_flight.seqs)

    def discard(self) -> None:
        """Forget the step in flight (a step failed: its sequences are recomputed, with the same seeded draws)."""
        self.in_flight = None

    def execute(self, plan: StepPlan, version: int) -> tuple[list[Sequence], Sampled | None]:
        """Run `plan` with the weights of policy `version`. Returns the sequences that sampled a token, and the
        tokens ready to record: this step's, or when this step was launched overlapped, the previous step's
        (this one's stay on the device, in flight)."""
        previous = self.in_flight
        if previous is not None and (plan.prefill or plan.decode != previous.seqs):
            raise RuntimeError("an overlapped decode step must run the sequences of the step in flight, only")
        logits: list[torch.Tensor] = []
        ready: list[Sequence] = []
        if plan.prefill:
            prefill_logits, prefill_ready = self._prefill(plan.prefill)
            if prefill_ready:
                logits.append(prefill_logits)
                ready += prefill_ready
        if plan.decode:
            logits.append(self._decode(plan.decode, None if previous is None else previous.tokens))
            ready += plan.decode
        sampled = None
        if ready:  # a step continuing `previous` samples its rows, one token on
            batch = self._sampling_batch(ready) if previous is None else previous.batch.next_step()
            all_logits = torch.cat(logits) if len(logits) > 1 else logits[0]
            overlap = self.config.overlap_steps and not plan.prefill and not self.scheduler.probation
            if overlap and batch.stays_on_device:
                self.in_flight = InFlight.launch(ready, *self.sampler.on_device(all_logits, batch), version, batch)
                now = time.monotonic()
                for seq in ready:
                    seq.tokens.append(0)  # its place: the next step reads the token from the device
                    if seq.request.first_token_at is None:
                        seq.request.first_token_at = now
                if previous is not None:
                    self.overlapped_steps += 1
                    sampled = self._read(previous)  # recorded while the GPU runs the step just launched
            else:  # no `previous` here: its sequences, alone in this step, sample the same way again
                drawn = self.sampler(all_logits, batch)
                sampled = Sampled(ready, drawn.tokens, drawn.logprobs, drawn.kept_ids, drawn.top, version)
        return ready, sampled

    def self_check(self) -> None:
        """Prefill one token into the scratch block and sample it, with no request involved: raises if the engine
        cannot step at all (a broken device)."""
        batch = self.cache.batch([1], [0], [[SCRATCH_BLOCK]])
        ids = torch.zeros(1, dtype=torch.long, device=self.device)
        logits = self.model.prefill(ids, self.cache, batch, *self._state_args([SCRATCH_SLOT], [0]))
        self.sampler(logits, SamplingBatch.build([SamplingParams(temperature=0)], [0], [0], [0], self.device))

    # --- a step's parts ---

    def _sampling_batch(self, ready: list[Sequence]) -> SamplingBatch:
        return SamplingBatch.build(
            [seq.request.params for seq in ready],
            [seq.request.seed for seq in ready],
            [seq.sample for seq in ready],
            [len(seq.tokens) - len(seq.request.prompt) for seq in ready],  # tokens generated, in flight too
            self.device,
            [seq.record.token_ids for seq in ready],  # complete: no step is in flight when a batch is built
        )

    def _continues(self, previous: InFlight) -> bool:
        """Whether the next step can run on `previous`'s tokens unread: it decodes exactly `previous`'s sequences
        (no waiting request can join, no cache block runs out, none is at its last token), so no plan depends on
        them."""
        scheduler, block_size = self.scheduler, self.config.block_size
        if scheduler.running != previous.seqs:
            return False
        growing = sum(seq.num_cached + 1 > len(seq.blocks) * block_size for seq in previous.seqs)
        if growing > scheduler.allocator.num_free or scheduler.admits_next(reserved_blocks=growing):
            return False
        return all(
            len(seq.record.token_ids) + 2 <= seq.request.max_tokens
            and len(seq.request.prompt) + len(seq.record.token_ids) + 2 <= self.max_model_len
            for seq in previous.seqs
        )

    def _read(self, step: InFlight) -> Sampled | None:
        """A step in flight's tokens for the sequences that have not stopped since it was launched."""
        tokens, logprobs = step.results()
        live = [row for row, seq in enumerate(step.seqs) if seq.record.finish_reason is None]
        if not live:
            return None
        return Sampled(
            [step.seqs[row] for row in live],
            [tokens[row] for row in live],
            [logprobs[row] for row in live],
            [None] * len(live),
            None,
            step.version,
        )

    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the step's prompt chunks; returns logits rows for the sequences now ready to sample."""
        seqs = [seq for seq, _ in chunks]
        ids = [token for seq, take in chunks for token in seq.tokens[seq.num_cached : seq.num_cached + take]]
        width = max(len(seq.blocks) for seq in seqs)
        tables = [seq.blocks + [-1] * (width - len(seq.blocks)) for seq in seqs]
        batch = self.cache.batch([take for _, take in chunks], [seq.num_cached for seq in seqs], tables)
        input_ids = torch.tensor(ids, device=self.device)
        self._gate_adapters([seq.request.adapter for seq, take in chunks for _ in range(take)])
        state = self._state_args([seq.slot for seq in seqs], [seq.num_cached for seq in seqs])  # () unless hybrid
        vision = self._vision_args(chunks) if self.model.visual is not None else {}
        scoring = self._prompt_targets(chunks)
        if scoring[0]:  # only requests that asked for prompt logprobs pay for the hidden states of every token
            hidden = self.model.cached_hidden_states(input_ids, self.cache, batch, *state, **vision)
            logits = self.model.compute_logits(hidden[batch.last_index])
            self._score_prompts(hidden, *scoring)
        else:
            logits = self.model.prefill(input_ids, self.cache, batch, *state, **vision)
        if self.routing is not None:
            self.routing.file_prefill(chunks)
        rows: list[int] = []
        ready: list[Sequence] = []
        for row, (seq, take) in enumerate(chunks):
            seq.num_cached += take
            if seq.pending:
                continue
            group = [seq]
            if seq.request.unforked:
                children, copies = self.scheduler.fork(seq, self.tokenizer)
                self._copy_blocks(copies)
                if self.routing is not None:
                    self.routing.fork(seq, children)
                if self.state is not None and children:
                    self.state.copy([seq.slot] * len(children), [child.slot for child in children])
                group += children
            rows += [row] * len(group)
            ready += group
        return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)], ready

    def _vision_args(self, chunks: list[tuple[Sequence, int]]) -> dict[str, Any]:
        """A vision-language model's prefill arguments: the chunks' M-RoPE positions `[3, T]` and the image features
        of the placeholders among them (each request's images encoded at its first prefill, once for all samples)."""
        positions, mask, parts = [], [], []
        for seq, take in chunks:
            images = seq.request.images
            positions.append(chunk_positions(images, seq.num_cached, take))
            chunk_mask, rows = chunk_features(images, seq.num_cached, take)
            mask += chunk_mask
            if images is not None and rows is not None:
                encode_images(self.model, images)
                parts.append((images, rows))
        out: dict[str, Any] = {"rope_positions": torch.cat(positions, dim=1).to(self.device)}
        if parts:
            out["visual"] = step_features(parts, torch.tensor([mask], device=self.device))
        return out

    def _prompt_targets(self, chunks: list[tuple[Sequence, int]]) -> tuple[list[int], list[int], list[PromptLogprobs]]:
        """The packed rows of these prompt chunks that score prompt tokens not scored yet, the token each scores
        and the scores it goes to. The hidden state at position q predicts token q + 1; the last prompt token's
        predicts the completion, which the sampler scores."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[PromptLogprobs] = []
        start = 0
        for seq, take in chunks:
            scores = seq.request.prompt_logprobs
            if scores is not None and not scores.complete:
                if scores.filled <= seq.num_cached:
                    raise RuntimeError("prompt logprobs: a chunk starts past the first unscored prompt token")
                for position in range(scores.filled, min(seq.num_cached + take, scores.length - 1) + 1):
                    rows.append(start + position - 1 - seq.num_cached)
                    targets.append(seq.request.prompt[position])
                    owners.append(scores)
            start += take
        return rows, targets, owners

    def _score_prompts(
        self, hidden: torch.Tensor, rows: list[int], targets: list[int], owners: list[PromptLogprobs]
    ) -> None:
        """Score prompt tokens from the prefill's hidden states, with the model's chunked logprob code (temperature
        1, no truncation: the model's own distribution, as vLLM's prompt logprobs), and append to their owners."""
        top_n = max(owner.top_n for owner in owners)
        device = hidden.device
        scored = score_tokens(
            hidden[torch.tensor(rows, device=device)],
            self.model.lm_head_weight,
            torch.tensor(targets, device=device),
            top_n,
        )
        logprobs, top_logprobs, top_ids = (values.tolist() for values in scored)
        for row, owner in enumerate(owners):
            owner.logprobs.append(logprobs[row])
            n = owner.top_n
            owner.top.append(list(zip(top_ids[row][:n], top_logprobs[row][:n], strict=True)) if n else None)

    def _decode(self, seqs: list[Sequence], device_tokens: torch.Tensor | None) -> torch.Tensor:
        tokens = [seq.tokens[-1] for seq in seqs]  # a place-holder where `device_tokens` has the token
        lengths, tables = [seq.num_cached for seq in seqs], [seq.blocks for seq in seqs]
        self._gate_adapters([seq.request.adapter for seq in seqs])
        if self.model.visual is not None:  # M-RoPE: positions after an image run at a fixed offset
            offsets = [0 if seq.request.images is None else seq.request.images.offset for seq in seqs]
            logits = self.decoder(tokens, lengths, tables, device_tokens, rope_offsets=offsets)
        elif self.state is None:
            logits = self.decoder(tokens, lengths, tables, device_tokens)
        else:
            logits = self.decoder(tokens, lengths, tables, device_tokens, [seq.slot for seq in seqs])
        if self.routing is not None:
            self.routing.file_decode(seqs)
        for seq in seqs:
            seq.num_cached += 1
        return logits

    def _gate_adapters(self, adapter: list[bool]) -> None:
        """Write the next forward's per-row adapter gates (serving unfolded LoRA adapters; a no-op otherwise)."""
        if self.adapter_gates is None:
            return
        if len(adapter) > len(self.adapter_gates):
            raise RuntimeError(
                f"a step of {len(adapter)} rows is longer than the adapter gates ({len(self.adapter_gates)})"
            )
        copy_to_device(torch.tensor(adapter, dtype=torch.float32), self.adapter_gates[: len(adapter)])

    def _state_args(self, slots: list[int], cached: list[int]) -> tuple[Any, ...]:
        """A hybrid model's extra forward arguments, the state cache and the step's `StateBatch` (a sequence with 0
        cached tokens starts from a zero state); none for other models."""
        return () if self.state is None else (self.state, self.state.batch(slots, cached))

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        source = torch.tensor([s for s, _ in copies], device=self.device)
        target = torch.tensor([t for _, t in copies], device=self.device)
        self.cache.copy_blocks(source, target)
