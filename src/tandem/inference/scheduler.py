"""Which sequences run in the next step, and where their KV lives: admission, chunked prefill, preemption, n > 1.

Every step decodes one token for each running sequence that has its whole context cached, continues
prompts that are partly cached, and admits waiting requests first-come first-served while the KV-block
budget, `max_running` and the step's prefill token budget allow. Blocks are allocated as sequences grow; when
none is free, the newest running sequence is preempted: its blocks are freed and it waits again, to be
prefilled from its prompt plus everything it generated (its outputs are kept; only the cache is recomputed).

After a failed step its requests go on probation (`requeue_running`): they run one request at a time, alone in
the batch, until each has sampled a token, so a step that fails again has one request to blame.

A request with n samples is admitted as one sequence. When its prompt is cached it forks into n: the children
share the prompt's full blocks (reference-counted) and get a copy of the last, partly filled one, so no
block is ever written by two sequences.

Hybrid models (linear-attention layers) also keep a recurrent state per sequence (`tandem.models.StateCache`):
with `state_slots`, every running sequence owns one slot, assigned at admission (or at its fork, where the runner
copies the parent's state into it) and freed when it finishes, is cancelled or preempted. A state is only valid at
the end of a sequence's cached tokens, which holds here: a sequence's cache is only ever dropped whole (preemption,
a failed step), so it is recomputed from token 0 (prompt and every token generated so far) from a fresh state, and
no cached prefix is shared across requests.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.inference.detokenize import IncrementalDetokenizer
from tandem.inference.outputs import PromptLogprobs, RequestUpdate, SampleRecord
from tandem.inference.prompt_images import PromptImages
from tandem.wire.protocol import SamplingParams

if TYPE_CHECKING:
    from tandem.inference.routed_experts import ExpertRows

SCRATCH_BLOCK = 0
"""Never allocated: padded rows of a fixed-shape decode step read and write here."""
SCRATCH_SLOT = 0
"""Never assigned: the recurrent-state slot of the padded rows of a fixed-shape decode step (hybrid models)."""


class BlockAllocator:
    """Reference-counted KV blocks; block 0 is the scratch block."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is scratch)")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, SCRATCH_BLOCK, -1))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)


@dataclass(eq=False)
class Request:
    """One submitted prompt with its sampling parameters, sampled `n` times."""

    id: str
    prompt: list[int]
    params: SamplingParams
    n: int
    seed: int
    max_tokens: int
    stream: bool
    detokenize: bool
    on_update: Callable[[RequestUpdate], None]
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    sequences: list[Sequence] = field(default_factory=list)
    unforked: int = 0
    """Samples still to fork from sample 0 once its prompt is cached."""
    prompt_logprobs: PromptLogprobs | None = None
    """When asked for: the prompt's scores, filled by prefill. Positions already scored are never scored again, so
    a prompt prefilled twice (preempted, or a sample prefilled on its own) still gets each exactly once."""
    prompt_logprobs_sent: bool = False
    adapter: bool = True
    """With LoRA adapters served unfolded: run with them (the adapter's model name) or without (the base's)."""
    images: PromptImages | None = None
    """A vision-language prompt's images (expanded placeholders, M-RoPE positions, features once encoded)."""

    @property
    def done(self) -> bool:
        return not self.unforked and all(seq.record.finish_reason for seq in self.sequences)


@dataclass(eq=False)
class Sequence:
    """One sample: its tokens (prompt + generated), its cache blocks, and what it has produced."""

    request: Request
    sample: int
    tokens: list[int]
    detokenizer: IncrementalDetokenizer | None
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    slot: int = SCRATCH_SLOT
    """Its recurrent-state slot while it runs (hybrid models only)."""
    record: SampleRecord = field(default_factory=SampleRecord)
    routing: ExpertRows | None = None
    """With `inference.return_routed_experts`: the experts routed at each computed position."""
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_finish: bool = False

    @property
    def pending(self) -> int:
        """Tokens whose K/V is not cached yet; 1 for a sequence that decodes."""
        return len(self.tokens) - self.num_cached


@dataclass
class StepPlan:
    """The work of one step: `(sequence, new tokens)` for prefill chunks, and the decoding sequences."""

    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_running: int,
        max_prefill_tokens: int,
        state_slots: int = 0,
    ) -> None:
        """`state_slots`: the recurrent-state slots of a hybrid model (0: none), slot 0 being scratch; needs
        `max_running + 1`, one per running sequence."""
        if state_slots and state_slots < max_running + 1:
            raise ValueError(f"{state_slots} state slots for max_running = {max_running}: needs max_running + 1")
        self.allocator, self.block_size = allocator, block_size
        self.state_slots = state_slots
        self._free_slots = list(range(state_slots - 1, SCRATCH_SLOT, -1))
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.watermark = max(1, allocator.num_blocks // 100)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.probation: deque[Request] = deque()
        """Requests of a failed step still to run alone; the first (the probe) is the only one scheduled."""
        self._probed: set[Sequence] = set()
        """The probe's sequences that have sampled a token on probation."""

    @property
    def num_free_slots(self) -> int:
        """Recurrent-state slots not held by a running sequence (scratch excluded)."""
        return len(self._free_slots)

    @property
    def num_waiting_requests(self) -> int:
        return len({id(seq.request) for seq in self.waiting})

    def add(self, request: Request, tokenizer: Any) -> None:
        first = self._new_sequence(request, 0, list(request.prompt), tokenizer)
        request.sequences.append(first)
        request.unforked = request.n - 1
        self.waiting.append(first)

    def _new_sequence(self, request: Request, sample: int, tokens: list[int], tokenizer: Any) -> Sequence:
        needs_text = request.detokenize or bool(request.params.stop)
        detokenizer = IncrementalDetokenizer(tokenizer, request.prompt, request.params.stop) if needs_text else None
        return Sequence(request, sample, tokens, detokenizer)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_prefill_tokens
        index = 0
        running, block_size = self.running, self.block_size
        while index < len(running):  # on probation only the probe runs (`passed` requeues the others)
            seq = running[index]
            pending = len(seq.tokens) - seq.num_cached
            take = 1 if pending == 1 else min(pending, budget)
            grows = seq.num_cached + take > len(seq.blocks) * block_size
            if take and grows and not self._grow(seq, seq.num_cached + take):
                continue  # `seq` itself was preempted; the same index now holds the next one
            if pending == 1 and not seq.request.unforked:
                plan.decode.append(seq)
            elif take:  # a prompt chunk; its last token too while samples wait to fork (prefill forks them)
                plan.prefill.append((seq, take))
                budget -= take
            index += 1
        while budget > 0 and (seq := self._next_waiting()) is not None and self._fits(seq, budget):
            self.waiting.remove(seq)
            take = min(seq.pending, budget)
            seq.blocks = self.allocator.allocate(self._blocks_for(take))
            self._assign_slot(seq)
            self.running.append(seq)
            if seq.pending == 1 and not seq.request.unforked:
                plan.decode.append(seq)
            else:  # a prompt, or a one-token prompt still to fork into its samples (prefill forks them)
                plan.prefill.append((seq, take))
            budget -= take
        return plan

    def _next_waiting(self) -> Sequence | None:
        """The waiting sequence to admit next: the first, or on probation the probe's first."""
        if not self.probation:
            return self.waiting[0] if self.waiting else None
        return next((seq for seq in self.waiting if seq.request is self.probation[0]), None)

    def _fits(self, seq: Sequence, budget: int, reserved_blocks: int = 0) -> bool:
        """Whether waiting `seq` can join now (with `budget` prompt tokens to prefill, `reserved_blocks` taken)."""
        slots = 1 + seq.request.unforked if seq.sample == 0 else 1
        free = self.allocator.num_free - reserved_blocks - self.blocks_to_admit(min(seq.pending, budget), slots)
        forking = sum(running.request.unforked for running in self.running if running.sample == 0)
        return len(self.running) + forking + slots <= self.max_running and free >= self.watermark

    def blocks_to_admit(self, tokens: int, samples: int) -> int:
        """Free blocks a waiting sequence needs to join with a chunk of `tokens` prompt tokens: the chunk's, plus one
        per other sample of its request (each forks with its own copy of the prompt's last block)."""
        return self._blocks_for(tokens) + samples - 1

    def admits_next(self, reserved_blocks: int = 0) -> bool:
        """Whether the next step would admit a waiting sequence, `reserved_blocks` free blocks being taken first."""
        seq = self._next_waiting()
        return seq is not None and self._fits(seq, self.max_prefill_tokens, reserved_blocks)

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """Give `seq` blocks for `tokens` tokens, preempting newer sequences; False if `seq` itself had to go."""
        needed = self._blocks_for(tokens) - len(seq.blocks)
        while needed > self.allocator.num_free:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        seq.blocks += self.allocator.allocate(max(needed, 0))
        return True

    def preempt(self, seq: Sequence) -> None:
        """Drop `seq`'s cache and queue it first, to be prefilled again from all its tokens."""
        self._drop(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _drop(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq.blocks)
        seq.blocks, seq.num_cached = [], 0  # recomputed from token 0: a hybrid's state starts fresh again
        if self.state_slots and seq.slot != SCRATCH_SLOT:
            self._free_slots.append(seq.slot)
            seq.slot = SCRATCH_SLOT

    def _assign_slot(self, seq: Sequence) -> None:
        if self.state_slots:
            seq.slot = self._free_slots.pop()  # `max_running` bounds the running sequences, so one is free

    def fork(self, parent: Sequence, tokenizer: Any) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """Sample 0's prompt is cached: make the other samples. Returns them and the `(src, dst)` block copies
        the caller must make (the partly filled last block) before they run; with state slots, the caller also
        copies the parent's state into each child's slot.

        Children that get no block for that copy wait to be prefilled on their own instead.
        """
        request = parent.request
        full, partial = divmod(parent.num_cached, self.block_size)
        shared = parent.blocks[:full]
        children, copies = [], []
        for sample in range(1, request.unforked + 1):
            child = self._new_sequence(request, sample, list(parent.tokens), tokenizer)
            request.sequences.append(child)
            if partial and self.allocator.num_free == 0:
                self.waiting.appendleft(child)
                continue
            self.allocator.share(shared)
            child.blocks = list(shared)
            if partial:
                (copy,) = self.allocator.allocate(1)
                copies.append((parent.blocks[full], copy))
                child.blocks.append(copy)
            child.num_cached = parent.num_cached
            self._assign_slot(child)
            children.append(child)
        request.unforked = 0
        at = self.running.index(parent) + 1
        self.running[at:at] = children
        return children, copies

    def finish(self, seq: Sequence) -> None:
        self._drop(seq)

    def abort(self, request: Request) -> None:
        """Remove every sequence of `request`, running or waiting, and free its blocks."""
        for seq in request.sequences:
            if seq in self.running:
                self._drop(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
        request.unforked = 0
        self._leave_probation(request)

    def requeue_running(self) -> list[Request]:
        """After a failed step: every running sequence waits again, first, keeping what it generated (tokens
        held for a step in flight are dropped; its cache is recomputed, as after a preemption). Returns their
        requests, oldest first."""
        requests = list(dict.fromkeys(seq.request for seq in self.running))
        for seq in reversed(self.running[:]):  # newest first, so the waiting queue keeps their order
            del seq.tokens[len(seq.request.prompt) + len(seq.record.token_ids) :]
            self._drop(seq)
            self.waiting.appendleft(seq)
        return requests

    def passed(self, sampled: list[Sequence]) -> None:
        """A probation step succeeded, sampling `sampled`. Once each of the probe's sequences has sampled (or
        finished) the probe is cleared; if another follows, the probe's sequences wait again so that the next
        one runs alone."""
        probe = self.probation[0]
        self._probed.update(seq for seq in sampled if seq.request is probe)
        if probe.unforked or any(s.record.finish_reason is None and s not in self._probed for s in probe.sequences):
            return
        self._leave_probation(probe)
        if self.probation:
            self.requeue_running()

    def _leave_probation(self, request: Request) -> None:
        if self.probation and self.probation[0] is request:
            self._probed.clear()
        if request in self.probation:
            self.probation.remove(request)
