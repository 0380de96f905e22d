"""SFT data: rows to token samples (loss only on what the model should learn), packing into rows.

A sample is a token sequence plus a per-token loss mask: `loss_mask[i]` says whether the model is
trained to predict token `i` from the tokens before it. A packed row concatenates samples up to
`seq_len` tokens with `position_ids` restarting at each sample, so the model's packed attention
path keeps every sample to itself.

Rows with images (chat messages with image parts, `tandem.images`; vision-language models): the chat template
writes one image placeholder per image, which becomes as many placeholder tokens as the image has merged
patches; they are never trained. A sample keeps the images' references, not pixels; a packed row lists its
samples' images in order, which is the order of its placeholder spans, so every image stays with its document.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.config.errors import ConfigError
from tandem.images import ImageError, PixelEncoder, image_refs

logger = logging.getLogger(__name__)


class BadRow(ValueError):
    """A dataset row that cannot become a training sample: a short reason, plus detail."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason} ({detail})" if detail else reason)


class DatasetError(ConfigError):
    """The dataset as a whole is unusable (missing, or bad rows with `on_bad_row = "fail"`)."""


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[bool]
    images: tuple[str, ...] = ()  # image references, in the order of their placeholder spans

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class BadRowReport:
    """Rows skipped, by reason, with the first few row numbers of each for the log."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[int]] = field(default_factory=dict)

    def add(self, reason: str, row_number: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self.examples.setdefault(reason, [])
        if len(self.examples[reason]) < 5:
            self.examples[reason].append(row_number)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def read_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(1-based line number, parsed row) for every non-blank line; a line that is not UTF-8 or not JSON yields
    a BadRow value, so it is skipped or fails the run like any other bad row."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file not found: {path}")
    try:
        handle = path.open("rb")
    except OSError as error:
        raise DatasetError(f"cannot read dataset file {path}: {error.strerror}") from None
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            yield number, _parse_row(line)


def _parse_row(line: bytes) -> Any:
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as error:
        return BadRow("not UTF-8 text", f"invalid byte at column {error.start + 1}")
    except json.JSONDecodeError as error:
        return BadRow("invalid JSON", error.msg)
    except RecursionError:
        return BadRow("invalid JSON", "nested deeper than the parser goes")


def _chat_spans(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans the template emits for each assistant turn.

    An assistant turn's span runs from the end of the rendered prefix with the generation prompt to
    the end of the rendered conversation through that turn, so whatever the template writes for the
    turn (content, end-of-turn token) is learned, and nothing of the prompt is.
    """
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start_text = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        end_text = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        if not (end_text.startswith(start_text) and full.startswith(end_text)):
            raise BadRow("the chat template does not render conversations prefix by prefix")
        spans.append((len(start_text), len(end_text)))
    return full, spans


@dataclass(frozen=True)
class VisionTokens:
    """How a vision-language model's rows spell images: the placeholder token and the image processor that says
    how many placeholders each image takes."""

    image_token_id: int
    pixels: PixelEncoder


def _text(content: Any) -> str:
    """A message content's text: the string, or its text parts joined."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text")


def _is_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("text", "image_url", "image")


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadRow("`messages` must be a non-empty list")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRow("every message needs a string `role`")
        content = message.get("content")
        if not isinstance(content, str | list) or (isinstance(content, list) and not all(map(_is_part, content))):
            raise BadRow(
                "a message has no string `content` (nor a list of text and image parts)",
                f"role {message.get('role')!r}",
            )
    if not any(message["role"] == "assistant" and _text(message["content"]) for message in messages):
        raise BadRow("no non-empty assistant message to learn from")
    return messages


def _expand_images(
    ids: list[int], mask: list[bool], refs: list[str], vision: VisionTokens | None
) -> tuple[list[int], list[bool]]:
    """Each image's one placeholder (as the chat template writes it) as one per merged patch, untrained."""
    if not refs:
        return ids, mask
    if vision is None:
        raise BadRow("the row has images, but the model takes none")
    at = [i for i, token in enumerate(ids) if token == vision.image_token_id]
    if len(at) != len(refs):
        raise BadRow("image placeholders do not match the images", f"{len(at)} placeholders, {len(refs)} images")
    out_ids: list[int] = []
    out_mask: list[bool] = []
    start = 0
    for i, ref in zip(at, refs, strict=True):
        try:
            count = vision.pixels.placeholders(ref)
        except ImageError as error:
            raise BadRow("unreadable image", str(error)) from None
        out_ids += [*ids[start:i], *[vision.image_token_id] * count]
        out_mask += [*mask[start:i], *[False] * count]
        start = i + 1
    return out_ids + ids[start:], out_mask + mask[start:]


def tokenize_row(row: Any, tokenizer: Any, vision: VisionTokens | None = None) -> Sample:
    """One dataset row (`messages`, or `prompt` + `completion`) as a Sample; raises BadRow. `vision`: how a
    vision-language model's rows spell images (rows with images need it)."""
    if not isinstance(row, dict):
        raise BadRow("row is not a JSON object")
    refs: list[str] = []
    if "messages" in row:
        if not getattr(tokenizer, "chat_template", None):
            raise DatasetError("the data has chat `messages` rows, but the model's tokenizer has no chat template")
        messages = _validate_messages(row["messages"])
        try:
            refs = image_refs(messages)
        except ImageError as error:
            raise BadRow("bad image part", str(error)) from None
        full, spans = _chat_spans(tokenizer, messages)
        encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        mask = [any(start <= a and b <= end for start, end in spans) and b > a for a, b in encoded["offset_mapping"]]
        ids, mask = _expand_images(ids, mask, refs, vision)
    elif "prompt" in row or "completion" in row:
        prompt, completion = row.get("prompt"), row.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise BadRow("`prompt` and `completion` must both be strings")
        if not completion:
            raise BadRow("empty `completion`")
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
        completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            completion_ids = [*completion_ids, tokenizer.eos_token_id]
        ids = [*prompt_ids, *completion_ids]
        mask = [False] * len(prompt_ids) + [True] * len(completion_ids)
    else:
        raise BadRow("row has neither `messages` nor `prompt`/`completion`")
    if mask and mask[0]:
        mask[0] = False  # the first token has nothing before it to predict it from
    if not any(mask):
        raise BadRow("no tokens to learn from")
    return Sample(ids, mask, tuple(refs))


def load_samples(
    rows: Iterable[tuple[int, Any]], tokenizer: Any, seq_len: int, on_bad_row: str, vision: VisionTokens | None = None
) -> tuple[list[Sample], BadRowReport]:
    """Tokenise every row; a bad row is counted and skipped, or fails the run naming its row number."""
    samples: list[Sample] = []
    report = BadRowReport()
    for number, row in rows:
        try:
            if isinstance(row, BadRow):
                raise row
            sample = tokenize_row(row, tokenizer, vision)
            if len(sample) > seq_len:
                raise BadRow("longer than seq_len", f"{len(sample)} > {seq_len} tokens")
        except BadRow as error:
            if on_bad_row == "fail":
                raise DatasetError(f"row {number}: {error}") from None
            report.add(error.reason, number)
            continue
        samples.append(sample)
    if report.total:
        for reason, count in report.counts.items():
            rows_text = ", ".join(map(str, report.examples[reason]))
            logger.warning("skipped %d bad row(s): %s (rows %s%s)", count, reason, rows_text, "…" if count > 5 else "")
    if not samples:
        raise DatasetError("the dataset has no usable rows")
    return samples, report


@dataclass
class PackedRow:
    """One training row of exactly seq_len positions (padding at the end when not full)."""

    input_ids: torch.Tensor  # [seq_len] int64
    position_ids: torch.Tensor  # [seq_len] int64, restarting at 0 for each sample
    target_ids: torch.Tensor  # [seq_len] int64, the next token of the same sample (0 where unused)
    loss_mask: torch.Tensor  # [seq_len] bool, True where target_ids is trained
    num_real: int  # tokens that belong to samples (the rest is padding)
    images: tuple[str, ...] = ()  # the samples' image references, in the order of their placeholder spans


def _row(samples: list[Sample], seq_len: int, pad_id: int) -> PackedRow:
    input_ids = torch.full((seq_len,), pad_id, dtype=torch.long)
    position_ids = torch.zeros(seq_len, dtype=torch.long)
    target_ids = torch.zeros(seq_len, dtype=torch.long)
    loss_mask = torch.zeros(seq_len, dtype=torch.bool)
    offset = 0
    for sample in samples:
        n = len(sample)
        ids = torch.tensor(sample.input_ids, dtype=torch.long)
        input_ids[offset : offset + n] = ids
        position_ids[offset : offset + n] = torch.arange(n)
        target_ids[offset : offset + n - 1] = ids[1:]
        loss_mask[offset : offset + n - 1] = torch.tensor(sample.loss_mask[1:], dtype=torch.bool)
        offset += n
    # Padding positions continue counting so every position id is valid; they attend only to
    # themselves as one trailing "document" and carry no loss.
    pad = seq_len - offset
    if pad:
        position_ids[offset:] = torch.arange(pad)
    images = tuple(ref for sample in samples for ref in sample.images)
    return PackedRow(input_ids, position_ids, target_ids, loss_mask, offset, images)


def pack(samples: list[Sample], seq_len: int, pad_id: int) -> list[PackedRow]:
    """Greedy in-order packing: keeps dataset order (so a step's data is a function of the step)."""
    rows, current, used = [], [], 0
    for sample in samples:
        if used + len(sample) > seq_len and current:
            rows.append(_row(current, seq_len, pad_id))
            current, used = [], 0
        current.append(sample)
        used += len(sample)
    if current:
        rows.append(_row(current, seq_len, pad_id))
    return rows


def pad_each(samples: list[Sample], seq_len: int, pad_id: int) -> list[PackedRow]:
    """One sample per row, padded to seq_len (packing off)."""
    return [_row([sample], seq_len, pad_id) for sample in samples]
