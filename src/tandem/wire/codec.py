"""What a tandem client and server agree on below HTTP: msgpack bodies for `/generate` (the one encoder and the
one safe decoder, shared by both servers through `tandem.inference.http` and by `tandem.client`) and the
queue-depth header.

A rollout response is 16 samples x 256 token ids, logprobs and versions; as JSON most of its cost is printing
and parsing floats, which msgpack stores as 8 raw bytes (float64, so every fp32 logprob comes back exactly).
The decoded value is what `json.loads` would give for the same document (maps with string keys, lists, str,
int, float, bool, None), so a decoded request goes through the same pydantic model as a JSON one.

Decoding is safe for untrusted bytes: no extension types (nothing but plain values is ever built), map keys
must be strings (no hash-collision keys), strings must be UTF-8, every length is bounded by the body's own
size (a 10-byte body cannot announce a 4-billion-item array), nesting is bounded by msgpack's parser stack,
and trailing bytes after the one object are an error.
"""

from __future__ import annotations

from typing import Any

import msgpack

MEDIA_TYPE = "application/msgpack"

QUEUE_DEPTH_HEADER = "x-queue-depth"
"""Response header a server may set to the number of requests it has waiting (the built-in server does)."""


class MsgpackError(ValueError):
    """A body that is not one well-formed msgpack value of plain types; the message says what is wrong."""


def pack(value: Any) -> bytes:
    """`value` (dicts, lists, tuples, str, int, float, bool, None) as msgpack; floats as float64."""
    return msgpack.packb(value, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """The one msgpack value in `data`, decoded safely (module docstring); MsgpackError otherwise."""
    if not data:
        raise MsgpackError("invalid msgpack body: it is empty")
    limit = len(data)
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=limit,
            max_bin_len=limit,
            max_array_len=limit,
            max_map_len=limit,
            max_ext_len=0,
        )
    except msgpack.ExtraData:
        raise MsgpackError("invalid msgpack body: extra bytes after the first value") from None
    except msgpack.StackError:
        raise MsgpackError("invalid msgpack body: nested too deeply") from None
    except msgpack.FormatError:
        raise MsgpackError("invalid msgpack body: a byte that starts no msgpack value") from None
    except UnicodeDecodeError:
        raise MsgpackError("invalid msgpack body: a string is not valid UTF-8") from None
    except (ValueError, TypeError) as error:
        raise MsgpackError(f"invalid msgpack body: {_reason(str(error))}") from None


def _reason(message: str) -> str:
    if "incomplete input" in message:
        return "truncated (it ends inside a value)"
    if "max_ext_len" in message:
        return "extension types are not accepted"
    if "map key" in message:
        return "map keys must be strings"
    if "exceeds max_" in message:
        return f"a length larger than the whole body ({message})"
    return message
