"""Scheduling without a model: admission under the block budget, chunked prefill, preemption, forking, abort."""

from __future__ import annotations

import pytest

from tandem.inference.scheduler import SCRATCH_BLOCK, BlockAllocator, Request, Scheduler
from tandem.wire.protocol import SamplingParams

BLOCK = 4


def _request(prompt_len: int, n: int = 1, name: str = "r") -> Request:
    return Request(
        id=name,
        prompt=list(range(1, prompt_len + 1)),
        params=SamplingParams(),
        n=n,
        seed=0,
        max_tokens=100,
        stream=False,
        detokenize=False,
        on_update=lambda update: None,
    )


def _run(scheduler: Scheduler, plan) -> None:
    """What the engine does after a step: mark chunks cached, append a token to every sequence now complete."""
    for seq, take in plan.prefill:
        seq.num_cached += take
    for seq in plan.decode:
        seq.num_cached += 1
    for seq in [s for s, _ in plan.prefill] + plan.decode:
        if not seq.pending:
            seq.tokens.append(0)


def test_allocator_counts_references_and_never_hands_out_scratch():
    allocator = BlockAllocator(5)
    blocks = allocator.allocate(4)
    assert SCRATCH_BLOCK not in blocks and allocator.num_free == 0
    with pytest.raises(RuntimeError):
        allocator.allocate(1)
    allocator.share(blocks[:2])
    allocator.release(blocks)
    assert allocator.num_free == 2 and allocator.num_used == 2
    allocator.release(blocks[:2])
    assert allocator.num_free == 4


def test_requests_wait_for_blocks_and_run_slots():
    scheduler = Scheduler(BlockAllocator(9), BLOCK, max_running=2, max_prefill_tokens=100)
    for name in "abc":
        scheduler.add(_request(10, name=name), None)  # 3 blocks each; 8 usable
    plan = scheduler.schedule()
    assert [seq.request.id for seq, _ in plan.prefill] == ["a", "b"]  # c: no run slot
    assert scheduler.allocator.num_used == 6 and len(scheduler.waiting) == 1


def test_long_prompts_are_prefilled_in_chunks_next_to_decodes():
    scheduler = Scheduler(BlockAllocator(64), BLOCK, max_running=8, max_prefill_tokens=8)
    scheduler.add(_request(3, name="short"), None)
    _run(scheduler, scheduler.schedule())
    scheduler.add(_request(20, name="long"), None)
    takes = []
    for _ in range(3):
        plan = scheduler.schedule()
        assert [seq.request.id for seq in plan.decode] == ["short"]
        takes.append([take for _, take in plan.prefill])
        _run(scheduler, plan)
    assert takes == [[8], [8], [4]]


def test_the_newest_sequence_is_preempted_and_requeued_first():
    scheduler = Scheduler(BlockAllocator(6), BLOCK, max_running=4, max_prefill_tokens=100)
    old, new = _request(8, name="old"), _request(4, name="new")  # 2 + 1 blocks; 5 usable
    scheduler.add(old, None)
    scheduler.add(new, None)
    _run(scheduler, scheduler.schedule())
    # Each now needs one more block (positions 8 and 4); after that only one block is left.
    for _ in range(5):
        _run(scheduler, scheduler.schedule())
    assert scheduler.preemptions == 1  # at old's 4th block, position 12
    assert [seq.request.id for seq in scheduler.running] == ["old"]
    preempted = new.sequences[0]
    assert list(scheduler.waiting) == [preempted] and preempted.num_cached == 0 and preempted.blocks == []
    assert len(preempted.tokens) == 4 + 5  # what it generated is kept and will be prefilled again


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    scheduler = Scheduler(BlockAllocator(32), BLOCK, max_running=8, max_prefill_tokens=100)
    request = _request(10, n=3)
    scheduler.add(request, None)
    plan = scheduler.schedule()
    ((parent, take),) = plan.prefill
    parent.num_cached += take
    children, copies = scheduler.fork(parent, None)
    assert [c.sample for c in children] == [1, 2]
    assert all(c.blocks[:2] == parent.blocks[:2] and c.blocks[2] != parent.blocks[2] for c in children)
    assert copies == [(parent.blocks[2], c.blocks[2]) for c in children]
    assert scheduler.allocator.num_used == 3 + 2
    scheduler.abort(request)
    assert scheduler.allocator.num_used == 0 and not scheduler.running


def test_after_a_failed_step_requests_run_alone_one_at_a_time():
    """`requeue_running` sends every running sequence back, keeping its recorded tokens (a place held for a token
    in flight is dropped) and freeing its blocks; then only the probe is scheduled, until each of its sequences
    has sampled, and the next probe runs alone; once probation ends everyone is scheduled again."""
    allocator = BlockAllocator(40)
    scheduler = Scheduler(allocator, BLOCK, max_running=8, max_prefill_tokens=100)
    requests = [_request(5, name="a"), _request(6, name="b"), _request(3, n=2, name="c")]
    for request in requests:
        scheduler.add(request, None)
    _run(scheduler, scheduler.schedule())
    scheduler.fork(scheduler.running[2], None)  # as the engine does once c's prompt is cached
    first_a = scheduler.running[0]
    first_a.record.token_ids.append(0)  # one token recorded; the next one is still in flight
    first_a.tokens.append(0)
    assert scheduler.requeue_running() == requests
    assert [seq.request.id for seq in scheduler.waiting] == ["a", "b", "c", "c"]
    assert allocator.num_used == 0 and not scheduler.running
    assert first_a.tokens == [*first_a.request.prompt, 0] and first_a.num_cached == 0
    scheduler.probation.extend(requests)
    for name in "abc":
        plan = scheduler.schedule()
        assert {seq.request.id for seq, _ in plan.prefill} | {seq.request.id for seq in plan.decode} == {name}
        assert {seq.request.id for seq in scheduler.running} == {name}
        _run(scheduler, plan)
        scheduler.passed([seq for seq, _ in plan.prefill] + plan.decode)
    assert not scheduler.probation and [seq.request.id for seq in scheduler.running] == ["c", "c"]
    plan = scheduler.schedule()
    assert sorted(seq.request.id for seq, _ in plan.prefill) == ["a", "b"] and len(plan.decode) == 2
