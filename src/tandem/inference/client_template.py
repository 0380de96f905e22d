"""What a chat request may hand the chat template (`chat_template_kwargs`), and the limits on a template of its own.

The kwargs are the template's variables (`enable_thinking`, `tools`, ...). A few names are instead arguments of
`apply_chat_template` that change what it returns (`tokenize`, `return_dict`, ...); those are refused, since the
server tokenizes the rendered text itself. `chat_template` replaces the model's template with the client's Jinja
program: refused unless the server trusts request templates (`trust_request_chat_template`, as vLLM's flag of
that name), and then at most `MAX_TEMPLATE_CHARS` long and stopped after `TEMPLATE_TIMEOUT_S` of rendering.
The deadline is checked at every line the template's compiled code runs and at every call it makes; it cannot
cut a single huge operation short (one `"x" * 10**10`), so trust request templates only from trusted clients.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

MAX_TEMPLATE_CHARS = 64 * 1024
TEMPLATE_TIMEOUT_S = 5.0
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "add_generation_prompt",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)
JINJA_CODE = "<template>"
"""The file name of the code Jinja compiles a template string to."""

T = TypeVar("T")


class TemplateRefused(ValueError):
    """A request's template arguments this server will not run (HTTP 400)."""


class TemplateTimeout(TemplateRefused):
    """A request's own template rendered for longer than TEMPLATE_TIMEOUT_S."""


def check_template_kwargs(kwargs: dict[str, Any], *, trust_request_template: bool) -> bool:
    """Refuse what `kwargs` may not set; True when it brings its own template (which must then run under
    `with_deadline`)."""
    reserved = sorted(RESERVED_KWARGS & set(kwargs))
    if reserved:
        raise TemplateRefused(f"chat_template_kwargs: {reserved} are set by the server, not by a request")
    if "chat_template" not in kwargs:
        return False
    template = kwargs["chat_template"]
    if not trust_request_template:
        raise TemplateRefused(
            "chat_template_kwargs.chat_template: this server runs only its model's chat template "
            "(start it with `trust_request_chat_template = true` to accept templates from requests)"
        )
    if not isinstance(template, str):
        raise TemplateRefused("chat_template_kwargs.chat_template: must be a string (a Jinja template)")
    if len(template) > MAX_TEMPLATE_CHARS:
        raise TemplateRefused(
            f"chat_template_kwargs.chat_template: {len(template)} characters, more than {MAX_TEMPLATE_CHARS}"
        )
    return True


def with_deadline(work: Callable[[], T], seconds: float | None = None) -> T:
    """`work()`, stopped with TemplateTimeout once it has run `seconds` (default TEMPLATE_TIMEOUT_S; checked in
    Jinja's compiled code and at each call on this thread). Run it on a worker thread: tracing slows the code it
    watches."""
    seconds = TEMPLATE_TIMEOUT_S if seconds is None else seconds
    deadline = time.monotonic() + seconds

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateTimeout(f"the request's chat template ran longer than {seconds:g}s and was stopped")
        return trace if frame.f_code.co_filename == JINJA_CODE else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return work()
    finally:
        sys.settrace(previous)
