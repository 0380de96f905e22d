"""Replayed kept ids: stored as CSR (int32 ids + per-position counts), rebuilt into the same `-1`-padded kept
matrix the model takes, capped at MAX_REPLAY_KEPT ids a token (top_k above it refused; a top-p/min-p token that
kept more leaves the loss)."""

from __future__ import annotations

import pytest
import torch

from tandem.config.orchestrator import MAX_REPLAY_KEPT
from tandem.config.rl import RlConfig
from tandem.orchestrator.batching import IGNORE_INDEX, TrainSample, pack_batch, replay_overflow
from tandem.transport.batches import KEPT_COUNTS, KEPT_IDS_FLAT, kept_matrix_from_csr, read_batch, write_batch

SEQ_LEN = 32
VOCAB = 5000


def sample(prompt: list[int], kept: list[list[int]] | None) -> TrainSample:
    n = len(kept) if kept is not None else 3
    completion = [(kept[j][0] if kept and kept[j] else 7) for j in range(n)]
    return TrainSample(
        prompt_ids=prompt, completion_ids=completion, logprobs=[-1.0] * n, advantage=1.0, weight=0.1,
        temperature=1.0, versions=[0] * n, kept_ids=kept,
    )  # fmt: skip


def test_kept_ids_round_trip_compactly_and_rebuild_the_kept_matrix(tmp_path):
    wide = list(range(100, 100 + MAX_REPLAY_KEPT))  # exactly the cap: replayed
    samples = [
        sample([1, 2], [[5, 9], [], wide]),  # top-k, an untruncated token, as many ids as the cap
        sample([3], None),  # sampled from the whole vocabulary
        sample([4, 4, 4], [[11]]),
    ]
    ranks = pack_batch(samples, SEQ_LEN, world_size=1, micro_batch_rows=2)
    write_batch(tmp_path, 1, ranks, {})
    micros, _ = read_batch(tmp_path, 1, 0, 1)
    (micro,) = micros
    assert (KEPT_COUNTS, KEPT_IDS_FLAT) == ("kept_counts", "kept_ids")  # batch-file keys: earlier runs' files read
    assert micro[KEPT_IDS_FLAT].dtype == micro[KEPT_COUNTS].dtype == torch.int32
    assert micro[KEPT_COUNTS].shape == micro["target_ids"].shape
    assert micro[KEPT_IDS_FLAT].numel() == 2 + MAX_REPLAY_KEPT + 1  # no padding stored
    matrix = kept_matrix_from_csr(micro[KEPT_COUNTS], micro[KEPT_IDS_FLAT], VOCAB)
    assert matrix.shape == (*micro["target_ids"].shape, MAX_REPLAY_KEPT)
    # Each completion token's row of the matrix is its kept ids, -1 padded; every other position is all -1.
    expected = {(5, 9), (), tuple(wide), (11,)}
    rows = {tuple(int(i) for i in row if i >= 0) for row in matrix[micro["target_ids"] != IGNORE_INDEX]}
    assert rows == expected
    assert (matrix[micro["target_ids"] == IGNORE_INDEX] == -1).all()
    for row in matrix.view(-1, MAX_REPLAY_KEPT):
        ids = row[row >= 0]
        assert (row[: len(ids)] >= 0).all()  # ids first, then padding


def test_a_token_over_the_cap_leaves_the_loss():
    huge = list(range(MAX_REPLAY_KEPT + 1))  # a flat top-p / min-p step
    samples = [sample([1, 2], [[5], huge, [6, 8]])]
    assert replay_overflow(samples) == 1
    (micro,) = pack_batch(samples, SEQ_LEN, world_size=1)[0]
    targets, weights = micro["target_ids"][0], micro["loss_weights"][0]
    # completion token j is the target at position p - 1 + j = 1 + j
    assert targets[1:4].tolist() == [5, IGNORE_INDEX, 6]
    assert weights[1:4].tolist() == pytest.approx([0.1, 0.0, 0.1])
    assert micro[KEPT_COUNTS][0, 1:4].tolist() == [1, 0, 2]
    assert micro[KEPT_IDS_FLAT].tolist() == [5, 6, 8]


def test_kept_ids_that_do_not_add_up_are_refused():
    counts = torch.tensor([[2, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="do not add up: 3 counted, 2 kept ids stored"):
        kept_matrix_from_csr(counts, torch.tensor([1, 2], dtype=torch.int32), VOCAB)
    with pytest.raises(ValueError, match="outside the vocabulary of 5000"):
        kept_matrix_from_csr(counts, torch.tensor([1, 2, VOCAB], dtype=torch.int32), VOCAB)


def _rl(top_k: int, **inference) -> RlConfig:
    source = {"id": "reverse_text", "sampling": {"top_k": top_k}}
    return RlConfig.model_validate({"orchestrator": {"source": [source]}, "inference": inference})


def test_top_k_above_the_replay_cap_is_a_config_error_naming_the_field():
    assert _rl(MAX_REPLAY_KEPT).orchestrator.source[0].sampling.top_k == MAX_REPLAY_KEPT
    with pytest.raises(ValueError, match=r"orchestrator\.source\[0\]\.sampling\.top_k = 2049 is above 2048"):
        _rl(MAX_REPLAY_KEPT + 1)
    # vLLM without exact replay sends no kept ids: nothing is replayed, nothing to cap
    assert _rl(MAX_REPLAY_KEPT + 1, engine="vllm", exact_replay=False).inference.exact_replay is False


def test_kept_ids_over_the_cap_are_counted_not_listed_when_a_rollout_arrives():
    from tandem.orchestrator.pool import to_completion
    from tandem.wire.kept_ids import count_kept_ids, encode_kept_ids
    from tandem.wire.protocol import SampleOutput

    flat = range(0, 2 * MAX_REPLAY_KEPT, 2)  # more ids than the cap: a bitmap on the wire
    encoded = [encode_kept_ids([3, 1], VOCAB), None, encode_kept_ids(flat, VOCAB)]
    assert encoded[2].startswith("b") and count_kept_ids(encoded[2]) == MAX_REPLAY_KEPT
    encoded[2] = encode_kept_ids([*flat, 4001], VOCAB)
    assert [count_kept_ids(e) for e in (encoded[0], encoded[2])] == [2, MAX_REPLAY_KEPT + 1]
    output = SampleOutput(
        token_ids=[3, 7, 4001], logprobs=[-1.0] * 3, masks=encoded, versions=[0] * 3, finish_reason="stop"
    )
    completion = to_completion(output)
    assert completion.kept_ids == [[1, 3], [], None]
    samples = [
        TrainSample(
            prompt_ids=[1], completion_ids=completion.token_ids, logprobs=completion.logprobs, advantage=1.0,
            weight=0.1, temperature=1.0, versions=[0] * 3, kept_ids=completion.kept_ids,
        )
    ]  # fmt: skip
    assert replay_overflow(samples) == 1
    (micro,) = pack_batch(samples, SEQ_LEN, world_size=1)[0]
    assert micro["target_ids"][0, :3].tolist() == [3, 7, IGNORE_INDEX]
    assert micro[KEPT_COUNTS][0, :3].tolist() == [2, 0, 0] and micro[KEPT_IDS_FLAT].tolist() == [1, 3]
