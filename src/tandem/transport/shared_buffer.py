"""One flat byte buffer that two processes on one machine both map: the trainer writes a policy into it, an
inference server reads it out, with no disk and no NCCL (which refuses two ranks on one GPU).

- **Kinds.** On a CUDA device the buffer is a tensor of the creator's, shared by its CUDA IPC handle, so the
  server maps the same GPU memory; on the CPU it is a POSIX shared-memory segment (`/dev/shm`). Either way it
  holds one copy of the weights in the model's dtype, counted against the creator.
- **Handles.** `handle()` is a small dict of strings, ints and bools (JSON- and msgpack-safe) that the offer
  carries; `SharedBuffer.open(handle)` validates it field by field and maps it. Nothing is unpickled: the
  handle names a segment of our own name pattern, or CUDA IPC bytes that only the driver interprets.
- **Layout.** `Layout.of(manifest)` places each tensor at an aligned byte offset; `buffer.views(layout)` gives
  typed, shaped views into the buffer, which the writer copies into and the reader copies out of. The layout
  travels as JSON next to the handle and is validated on arrival (known dtypes, no overlaps, inside the
  buffer).
- **Ordering.** The writer calls `fence()` after its copies and before it sends the offer; the reader copies
  out once the offer has arrived and calls `fence()` before it answers, so the writer may overwrite the
  buffer once the answer is in. On CUDA `fence()` waits for the device's work (the copies may be queued on
  any stream); on the CPU copies are done when they return and the message itself orders them.
- **Lifetime.** `close()` by the creator unlinks the segment (CPU) or drops its tensor (CUDA); by an opener it
  only drops the mapping. Views keep their memory mapped until they die, so a stale view never points at
  unmapped memory; the memory returns to the system once the creator, every opener and every view are gone.
  A CUDA handle is single-use (torch counts one consumer per `_share_cuda_` call): ask for one `handle()`
  per opener. CUDA memory the creator drops while an opener still maps it waits in torch's IPC limbo until
  that opener lets go (`torch.cuda.ipc_collect()` frees it then); a handle that is never opened, or whose
  open fails, keeps it until the creator exits. So make one buffer per run and reuse it every policy.
"""

from __future__ import annotations

import _posixshmem
import base64
import binascii
import contextlib
import itertools
import mmap
import os
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

MAX_NBYTES = 1 << 40
"""The largest buffer a handle or layout may name (1 TiB): far above any model this runs, low enough that a
corrupt size fails validation instead of an allocation."""

_SHM_NAME = r"^tandem-w-[0-9]{1,10}-[0-9a-f]{16}$"
_TORCH_SHM_NAME = r"^/torch_[0-9]+_[0-9]+_[0-9]+$"
"""torch's name for the shared-memory file that counts a CUDA IPC storage's consumers (`NewProcessWideShmHandle`)."""
_MAX_IPC_BYTES = 1024
"""Bound on a CUDA IPC memory or event handle (64 bytes today, plus torch's small header)."""

DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}
"""The dtypes a layout may name, by the name `str(dtype)` gives without `torch.`."""


class SharedBufferError(RuntimeError):
    """A shared buffer could not be created, opened or viewed; the message says what is wrong."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


_Size = Annotated[int, Field(gt=0, le=MAX_NBYTES)]
_Base64 = Annotated[str, Field(min_length=1, max_length=4 * _MAX_IPC_BYTES // 3 + 4)]


class PosixShmHandle(_Model):
    """A CPU buffer: the POSIX shared-memory segment `/<name>` of exactly `nbytes` bytes."""

    kind: Literal["posix_shm"]
    name: str = Field(pattern=_SHM_NAME)
    nbytes: _Size


class CudaIpcHandle(_Model):
    """A CUDA buffer: the fields of `UntypedStorage._share_cuda_()` (bytes as base64) and the UUID of the GPU
    they live on, which the opener looks up among its own devices (its `CUDA_VISIBLE_DEVICES` may number them
    differently)."""

    kind: Literal["cuda_ipc"]
    nbytes: _Size
    device_uuid: str = Field(pattern=r"^[A-Za-z0-9-]{1,64}$")
    storage_handle: _Base64
    storage_offset: int = Field(ge=0, le=MAX_NBYTES)
    ref_counter_handle: str = Field(pattern=_TORCH_SHM_NAME, max_length=128)
    ref_counter_offset: int = Field(ge=0, le=1 << 32)
    event_handle: _Base64
    event_sync_required: bool


Handle = Annotated[PosixShmHandle | CudaIpcHandle, Field(discriminator="kind")]
_HANDLE = TypeAdapter(Handle)


def _invalid(what: str, error: ValidationError) -> SharedBufferError:
    problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in error.errors())
    return SharedBufferError(f"invalid {what}: {problems}")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, field: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error as error:
        raise SharedBufferError(f"invalid shared-buffer handle: {field} is not base64 ({error})") from None


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_cuda_index(uuid: str) -> int:
    """The index, in this process's numbering, of the GPU with `uuid`."""
    if not torch.cuda.is_available():
        raise SharedBufferError(f"a CUDA IPC buffer on GPU {uuid} cannot be opened: CUDA is not available here")
    visible = [_device_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid not in visible:
        raise SharedBufferError(
            f"no visible CUDA device is GPU {uuid} (visible: {visible}); the opener must see the creator's GPU "
            "(check CUDA_VISIBLE_DEVICES)"
        )
    return visible.index(uuid)


_opened_cuda_handles: set[tuple[str, int]] = set()
"""The CUDA handles this process has opened, by their consumer counter: each counts one consumer, so opening
one twice would release the creator's memory while a mapping still uses it."""


class SharedBuffer:
    """A flat uint8 buffer mapped by its creator and any openers; see the module docstring."""

    def __init__(self, flat: torch.Tensor, *, creator: bool, name: str | None = None) -> None:
        self._flat: torch.Tensor | None = flat
        self.nbytes = flat.numel()
        self.device = flat.device
        self.creator = creator
        self._name = name
        self._unlink = weakref.finalize(self, _unlink_shm, name) if creator and name else None

    @classmethod
    def create(cls, nbytes: int, device: torch.device | str) -> SharedBuffer:
        """A new, uninitialised buffer of `nbytes` bytes on `device` (a CUDA device or the CPU)."""
        device = torch.device(device)
        if not 0 < nbytes <= MAX_NBYTES:
            raise SharedBufferError(f"a shared buffer's size must be in (0, {MAX_NBYTES}], not {nbytes}")
        if device.type == "cuda":
            return cls(torch.empty(nbytes, dtype=torch.uint8, device=device), creator=True)
        if device.type != "cpu":
            raise SharedBufferError(f"shared buffers live on a CUDA device or the CPU, not {device}")
        name = f"tandem-w-{os.getpid()}-{secrets.token_hex(8)}"
        return cls(_create_shm(name, nbytes), creator=True, name=name)

    @classmethod
    def open(cls, handle: dict[str, Any]) -> SharedBuffer:
        """Map the buffer another process created and described by `handle()`; raise SharedBufferError for a
        malformed handle, a segment that is gone or a GPU this process does not see."""
        try:
            spec = _HANDLE.validate_python(handle)
        except ValidationError as error:
            raise _invalid("shared-buffer handle", error) from None
        if isinstance(spec, PosixShmHandle):
            return cls(_open_shm(spec.name, spec.nbytes), creator=False, name=spec.name)
        return cls(_open_cuda(spec), creator=False)

    def handle(self) -> dict[str, Any]:
        """What an opener needs to map this buffer. A CPU handle may be opened by any number of processes; a
        CUDA handle by exactly one (call `handle()` once per opener)."""
        flat = self._check_open()
        if self._name is not None:
            return PosixShmHandle(kind="posix_shm", name=self._name, nbytes=self.nbytes).model_dump()
        if not self.creator:
            raise SharedBufferError("only the creator of a CUDA shared buffer can hand out handles")
        try:
            device, storage, size, offset, counter, counter_offset, event, event_sync = (
                flat.untyped_storage()._share_cuda_()
            )
        except RuntimeError as error:
            raise SharedBufferError(f"cannot share the CUDA buffer on {self.device}: {error}") from None
        assert size == self.nbytes and device == self.device.index, (size, device)
        return CudaIpcHandle(
            kind="cuda_ipc",
            nbytes=size,
            device_uuid=_device_uuid(device),
            storage_handle=_b64(storage),
            storage_offset=offset,
            ref_counter_handle=counter.decode("ascii"),
            ref_counter_offset=counter_offset,
            event_handle=_b64(event),
            event_sync_required=bool(event_sync),
        ).model_dump()

    def views(self, layout: Layout) -> dict[str, torch.Tensor]:
        """Each tensor of `layout` as a typed, shaped view into this buffer (writes go straight to the shared
        memory)."""
        flat = self._check_open()
        if layout.nbytes > self.nbytes:
            raise SharedBufferError(f"the layout needs {layout.nbytes} bytes; the buffer holds {self.nbytes}")
        return {
            entry.name: flat[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).view(entry.shape)
            for entry in layout.entries
        }

    def fence(self) -> None:
        """Make this process's writes to (or reads from) the buffer complete before the message that follows:
        the writer calls it before sending the offer, the reader before answering it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Drop this object's mapping; the creator of a CPU buffer also unlinks its segment, so later opens
        fail. Views taken earlier stay valid until they die. Idempotent."""
        self._flat = None
        if self._unlink is not None:
            self._unlink()

    @property
    def closed(self) -> bool:
        return self._flat is None

    def _check_open(self) -> torch.Tensor:
        if self._flat is None:
            raise SharedBufferError("the shared buffer is closed")
        return self._flat

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# POSIX shared memory, through `_posixshmem` (what `multiprocessing.shared_memory` uses) rather than
# `SharedMemory`: on Python < 3.13 every `SharedMemory` an opener attaches is registered with the opener's
# resource tracker, which unlinks the creator's segment when the opener exits. Here only the creator
# registers (so a creator that dies without closing still leaves nothing behind), and only it unlinks.
# The mmap is never closed explicitly: torch.frombuffer's tensor keeps it alive, and closing it under a live
# view would leave that view pointing at unmapped memory.
def _map(fd: int, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)


def _create_shm(name: str, nbytes: int) -> torch.Tensor:
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    resource_tracker.register("/" + name, "shared_memory")
    try:
        os.ftruncate(fd, nbytes)
        if hasattr(os, "posix_fallocate"):  # reserve the pages now: a full /dev/shm fails here, not with SIGBUS
            os.posix_fallocate(fd, 0, nbytes)
        return _map(fd, nbytes)
    except OSError as error:
        _unlink_shm(name)
        raise SharedBufferError(
            f"cannot create {nbytes} bytes of shared memory: {error} (a container's /dev/shm is often small; "
            "raise it, e.g. docker's --shm-size)"
        ) from None
    finally:
        os.close(fd)


def _open_shm(name: str, nbytes: int) -> torch.Tensor:
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise SharedBufferError(f"no shared segment {name!r}: its creator closed it or exited") from None
    try:
        actual = os.fstat(fd).st_size
        if actual != nbytes:
            raise SharedBufferError(f"shared segment {name!r} holds {actual} bytes; the handle says {nbytes}")
        return _map(fd, nbytes)
    finally:
        os.close(fd)


def _unlink_shm(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink("/" + name)
    resource_tracker.unregister("/" + name, "shared_memory")


def _open_cuda(spec: CudaIpcHandle) -> torch.Tensor:
    index = _local_cuda_index(spec.device_uuid)
    key = (spec.ref_counter_handle, spec.ref_counter_offset)
    if key in _opened_cuda_handles:
        raise SharedBufferError("this CUDA handle was already opened in this process; each opener needs its own")
    torch.cuda._lazy_init()
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            _unb64(spec.storage_handle, "storage_handle"),
            spec.nbytes,
            spec.storage_offset,
            spec.ref_counter_handle.encode("ascii"),
            spec.ref_counter_offset,
            _unb64(spec.event_handle, "event_handle"),
            spec.event_sync_required,
        )
    except RuntimeError as error:
        raise SharedBufferError(f"cannot map the CUDA IPC buffer on GPU {spec.device_uuid}: {error}") from None
    _opened_cuda_handles.add(key)
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)


@dataclass(frozen=True)
class LayoutEntry:
    """One tensor of a layout: `nbytes` bytes at byte `offset` of the buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * self.dtype.itemsize


class _EntryJson(_Model):
    name: str = Field(min_length=1, max_length=1024)
    dtype: str
    shape: list[Annotated[int, Field(ge=0, le=MAX_NBYTES)]] = Field(max_length=16)
    offset: int = Field(ge=0, le=MAX_NBYTES)


class _LayoutJson(_Model):
    nbytes: _Size
    tensors: list[_EntryJson]


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a manifest lies in a shared buffer of at least `nbytes` bytes (the end of the last
    tensor; never 0, which no buffer may be)."""

    entries: tuple[LayoutEntry, ...]
    nbytes: int

    @classmethod
    def of(cls, manifest: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], align: int = 256) -> Layout:
        """The tensors of `manifest` one after another, each starting at a multiple of `align` bytes (256 keeps
        every view aligned for vectorised copies)."""
        if align <= 0 or align & (align - 1):
            raise SharedBufferError(f"the alignment must be a power of two, not {align}")
        entries, offset, end = [], 0, 1
        for name, dtype, shape in manifest:
            entry = LayoutEntry(name, dtype, tuple(shape), offset)
            entries.append(entry)
            end = max(end, offset + entry.nbytes)
            offset += -(-entry.nbytes // align) * align
        return cls._checked(tuple(entries), end)

    def to_json(self) -> dict[str, Any]:
        """The layout as plain JSON (dtypes by name), for the offer to carry."""
        return {
            "nbytes": self.nbytes,
            "tensors": [
                {
                    "name": e.name,
                    "dtype": str(e.dtype).removeprefix("torch."),
                    "shape": list(e.shape),
                    "offset": e.offset,
                }
                for e in self.entries
            ],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Layout:
        """The layout `to_json` wrote, validated: known dtypes, unique names, aligned offsets, every tensor
        inside `nbytes`, no two overlapping."""
        try:
            spec = _LayoutJson.model_validate(data)
        except ValidationError as error:
            raise _invalid("layout", error) from None
        entries = []
        for tensor in spec.tensors:
            if tensor.dtype not in DTYPES:
                raise SharedBufferError(f"layout: tensor {tensor.name!r} has unknown dtype {tensor.dtype!r}")
            entries.append(LayoutEntry(tensor.name, DTYPES[tensor.dtype], tuple(tensor.shape), tensor.offset))
        return cls._checked(tuple(entries), spec.nbytes)

    @classmethod
    def _checked(cls, entries: tuple[LayoutEntry, ...], nbytes: int) -> Layout:
        if nbytes > MAX_NBYTES:
            raise SharedBufferError(f"layout: {nbytes} bytes exceeds the limit of {MAX_NBYTES}")
        names = [entry.name for entry in entries]
        if len(set(names)) != len(names):
            raise SharedBufferError(
                f"layout: duplicate tensor names {sorted({n for n in names if names.count(n) > 1})}"
            )
        placed = sorted((e for e in entries if e.nbytes), key=lambda e: e.offset)
        for entry in entries:
            if entry.dtype not in DTYPES.values():
                raise SharedBufferError(f"layout: tensor {entry.name!r} has unsupported dtype {entry.dtype}")
            if entry.offset % entry.dtype.itemsize:
                raise SharedBufferError(
                    f"layout: tensor {entry.name!r} at offset {entry.offset} is not aligned to its {entry.dtype}"
                )
            if entry.offset + entry.nbytes > nbytes:
                raise SharedBufferError(
                    f"layout: tensor {entry.name!r} ends at byte {entry.offset + entry.nbytes}, past the buffer's {nbytes}"
                )
        for before, after in itertools.pairwise(placed):
            if before.offset + before.nbytes > after.offset:
                raise SharedBufferError(f"layout: tensors {before.name!r} and {after.name!r} overlap")
        return cls(entries, nbytes)
