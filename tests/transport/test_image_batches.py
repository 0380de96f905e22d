"""A vision-language batch's images travel as their references (UTF-8 bytes + sizes), with a mask of the
placeholder tokens the server expanded, through a batch file and back, in the order of the packed rows."""

from __future__ import annotations

import torch

from tandem.orchestrator.batching import TrainSample, pack_batch
from tandem.transport.batches import IMAGE_MASK, IMAGE_REFS, IMAGE_SIZES, read_batch, unpack_refs, write_batch

IMAGE = 9


def _sample(prompt: list[int], images: tuple[str, ...], spans: tuple[tuple[int, int], ...]) -> TrainSample:
    completion = [IMAGE, 5]  # a completion may sample the placeholder id: it is text, not an image
    return TrainSample(
        prompt_ids=prompt, completion_ids=completion, logprobs=[-1.0] * 2, advantage=1.0, weight=0.1,
        temperature=1.0, versions=[0] * 2, images=images, image_spans=spans,
    )  # fmt: skip


def test_image_references_and_placeholders_survive_a_batch_file(tmp_path):
    samples = [
        _sample([1, IMAGE, IMAGE, 2], ("data:image/png;base64,AAA",), ((1, 3),)),
        _sample([3, 4], (), ()),
        _sample([IMAGE, IMAGE, IMAGE, IMAGE, 6, IMAGE], ("data:a", "data:bé"), ((0, 4), (5, 6))),
    ]
    ranks = pack_batch(samples, seq_len=32, world_size=1, micro_batch_rows=1)
    write_batch(tmp_path, 1, ranks, {})
    micros, _ = read_batch(tmp_path, 1, 0, 1)
    refs, marked = [], 0
    for micro in micros:
        refs += unpack_refs(micro[IMAGE_REFS], micro[IMAGE_SIZES])
        mask = micro[IMAGE_MASK]
        assert mask.dtype == torch.bool and mask.shape == micro["input_ids"].shape
        assert (micro["input_ids"][mask] == IMAGE).all()
        marked += int(mask.sum())
    assert sorted(refs) == sorted(["data:image/png;base64,AAA", "data:a", "data:bé"])
    assert marked == 2 + 4 + 1  # the spans only: the completions' sampled placeholder ids are not images
