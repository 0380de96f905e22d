"""The shared buffer: a child process maps the parent's buffer and sees its tensors bit for bit, its writes
come back, its exit leaves the segment alone, the creator's close removes it, and every malformed handle or
layout is refused with a SharedBufferError."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import textwrap

import msgpack
import pytest
import torch

from tandem.testing.progress import run_while_progressing
from tandem.transport.shared_buffer import Layout, SharedBuffer, SharedBufferError

MANIFEST = [
    ("embed.weight", torch.float32, (7, 5)),
    ("norm.weight", torch.bfloat16, (13,)),
    ("positions", torch.int64, (3, 2)),
    ("scale", torch.float32, ()),
    ("empty", torch.bfloat16, (0, 4)),
    ("mask", torch.bool, (9,)),
    ("reply", torch.int64, (4,)),
]

CHILD = textwrap.dedent(
    """
    import hashlib, json, sys
    import torch
    from tandem.transport.shared_buffer import Layout, SharedBuffer

    message = json.loads(sys.argv[1])
    layout = Layout.from_json(message["layout"])
    with SharedBuffer.open(message["handle"]) as buffer:
        views = buffer.views(layout)
        digests = {name: hashlib.sha256(view.cpu().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                   for name, view in views.items() if name != "reply"}
        views["reply"].copy_(torch.arange(4) * 11)
        buffer.fence()
    # A resource tracker the child started would unlink what it registered now, at the child's exit.
    from multiprocessing import resource_tracker
    resource_tracker._resource_tracker._stop()
    print(json.dumps(digests))
    """
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _fill(views: dict[str, torch.Tensor]) -> None:
    generator = torch.Generator().manual_seed(0)
    for name, view in views.items():
        if view.dtype.is_floating_point:
            values = torch.randn(view.shape, generator=generator)
        else:
            values = torch.randint(-(2**40), 2**40, view.shape, generator=generator) % (2 if name == "mask" else 2**62)
        view.copy_(values.to(view.dtype))


def _child(buffer: SharedBuffer, layout: Layout) -> dict[str, str]:
    message = json.dumps({"handle": buffer.handle(), "layout": layout.to_json()})
    done = run_while_progressing([sys.executable, "-c", CHILD, message])
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("device", DEVICES)
def test_a_child_reads_every_tensor_bit_for_bit_and_its_writes_come_back(device):
    layout = Layout.of(MANIFEST)
    with SharedBuffer.create(layout.nbytes, device) as buffer:
        views = buffer.views(layout)
        _fill(views)
        buffer.fence()
        expected = {name: _digest(view) for name, view in views.items() if name != "reply"}
        assert _child(buffer, layout) == expected
        assert views["reply"].cpu().tolist() == [0, 11, 22, 33]


def test_a_reader_exiting_leaves_the_segment_and_the_creators_close_removes_it():
    layout = Layout.of(MANIFEST)
    buffer = SharedBuffer.create(layout.nbytes, "cpu")
    views = buffer.views(layout)
    _fill(views)
    handle = buffer.handle()
    first = _child(buffer, layout)
    assert _child(buffer, layout) == first  # the first reader's exit (and its resource tracker's) left it there
    with SharedBuffer.open(handle) as again:
        assert torch.equal(again.views(layout)["positions"], views["positions"])
    buffer.close()
    with pytest.raises(SharedBufferError, match="no shared segment"):
        SharedBuffer.open(handle)
    assert views["reply"].tolist() == [0, 11, 22, 33]  # a view outlives the close, still mapped
    with pytest.raises(SharedBufferError, match="closed"):
        buffer.views(layout)


def test_the_handle_and_layout_survive_json_and_msgpack():
    layout = Layout.of(MANIFEST, align=64)
    assert all(entry.offset % 64 == 0 for entry in layout.entries)
    with SharedBuffer.create(layout.nbytes, "cpu") as buffer:
        for dumps, loads in ((json.dumps, json.loads), (msgpack.packb, msgpack.unpackb)):
            assert loads(dumps(buffer.handle())) == buffer.handle()
            assert Layout.from_json(loads(dumps(layout.to_json()))) == layout


def test_an_opener_closing_leaves_the_creators_buffer():
    with SharedBuffer.create(64, "cpu") as buffer:
        SharedBuffer.open(buffer.handle()).close()
        buffer.views(Layout.of([("x", torch.int64, (8,))]))["x"].fill_(3)
        with SharedBuffer.open(buffer.handle()) as again:
            assert again.views(Layout.of([("x", torch.int64, (8,))]))["x"].tolist() == [3] * 8


OPEN_TWICE = textwrap.dedent(
    """
    import json, sys
    from tandem.transport.shared_buffer import SharedBuffer, SharedBufferError

    handle = json.loads(sys.argv[1])
    try:
        with SharedBuffer.open(handle):
            SharedBuffer.open(handle)
    except SharedBufferError as error:
        print(error)
    """
)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize(
    ("env", "message"),
    [({}, "already opened in this process"), ({"CUDA_VISIBLE_DEVICES": ""}, "CUDA is not available")],
)
def test_a_cuda_handle_opens_once_and_only_where_its_gpu_is_visible(env, message):
    with SharedBuffer.create(4096, "cuda") as buffer:
        command = [sys.executable, "-c", OPEN_TWICE, json.dumps(buffer.handle())]
        done = run_while_progressing(command, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    assert message in done.stdout


@pytest.fixture
def cpu_handle():
    with SharedBuffer.create(4096, "cpu") as buffer:
        yield buffer.handle()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"kind": "pickle"}, "kind"),
        ({"name": "../../dev/shm/x"}, "name"),
        ({"name": "tandem-w-1-0123456789abcdeg"}, "name"),
        ({"nbytes": 4097}, "holds 4096 bytes"),
        ({"nbytes": 0}, "nbytes"),
        ({"nbytes": 1 << 50}, "nbytes"),
        ({"nbytes": "4096"}, "nbytes"),
        ({"extra": 1}, "extra: Extra inputs"),
        ({"name": "tandem-w-1-0123456789abcdef"}, "no shared segment"),
    ],
)
def test_a_malformed_shm_handle_is_refused(cpu_handle, change, message):
    with pytest.raises(SharedBufferError, match=message):
        SharedBuffer.open({**cpu_handle, **change})


CUDA_HANDLE = {
    "kind": "cuda_ipc",
    "nbytes": 4096,
    "device_uuid": "GPU-00000000-0000-0000-0000-000000000000",
    "storage_handle": "AAAA",
    "storage_offset": 0,
    "ref_counter_handle": "/torch_1_2_3",
    "ref_counter_offset": 0,
    "event_handle": "AAAA",
    "event_sync_required": False,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ref_counter_handle": "/../etc/passwd"}, "ref_counter_handle"),
        ({"storage_handle": "not base64!"}, "storage_handle|CUDA|GPU"),
        ({"device_uuid": "a b"}, "device_uuid"),
        ({"event_sync_required": "yes"}, "event_sync_required"),
        ({"name": "x"}, "name"),
        ({}, "CUDA is not available|no visible CUDA device"),
    ],
)
def test_a_malformed_or_foreign_cuda_handle_is_refused(change, message):
    with pytest.raises(SharedBufferError, match=message):
        SharedBuffer.open({**CUDA_HANDLE, **change})


def _layout_json(*tensors, nbytes=4096):
    return {
        "nbytes": nbytes,
        "tensors": [dict(zip(("name", "dtype", "shape", "offset"), t, strict=True)) for t in tensors],
    }


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (_layout_json(("a", "float32", [4], 0), ("b", "float32", [4], 8)), "overlap"),
        (_layout_json(("a", "complex64", [4], 0)), "unknown dtype"),
        (_layout_json(("a", "float32", [4], 4088)), "past the buffer"),
        (_layout_json(("a", "float32", [4], 2)), "not aligned"),
        (_layout_json(("a", "float32", [4], 0), ("a", "int8", [1], 64)), "duplicate"),
        (_layout_json(("a", "float32", [-1], 0)), "shape"),
        (_layout_json(("a", "float32", [4], -8)), "offset"),
        ({**_layout_json(), "align": 256}, "align: Extra inputs"),
        (_layout_json(nbytes=0), "nbytes"),
    ],
)
def test_a_malformed_layout_is_refused(data, message):
    with pytest.raises(SharedBufferError, match=message):
        Layout.from_json(data)


def test_a_layout_larger_than_the_buffer_has_no_views():
    layout = Layout.from_json(_layout_json(("a", "float32", [4], 0), nbytes=8192))
    with SharedBuffer.create(4096, "cpu") as buffer, pytest.raises(SharedBufferError, match="8192 bytes"):
        buffer.views(layout)
