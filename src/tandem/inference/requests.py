"""The request side of the engine: the live requests, and what happens to them as the runner's tokens arrive.

`record` is the update of a step (after the scheduler planned it and the runner executed it): each sampled token
goes into its sample's record with its logprob, kept ids and policy version; stop conditions are checked (a stop
token, EOS, a stop string, `max_tokens`, the context) and a finished sequence leaves the scheduler; then each
request that progressed gets its update (streaming ones every step, others once at the end). An update's
callback runs here, on the engine thread, and one that raises is logged and costs nothing else.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tandem.inference.outputs import RequestUpdate, TopLogprobs
from tandem.inference.scheduler import Request, Scheduler, Sequence
from tandem.wire.kept_ids import encode_kept_ids
from tandem.wire.protocol import FinishReason

logger = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0


@dataclass
class Sampled:
    """One token for each of `seqs`, read back to the host: what the runner hands over to be recorded."""

    seqs: list[Sequence]
    tokens: list[int]
    logprobs: list[float]
    kept_ids: list[list[int] | None]
    """Per row, the ids truncated sampling kept; None where it kept the whole vocabulary."""
    top: list[TopLogprobs] | None
    """Per row, the most likely ids and their logprobs, when a row asked for them."""
    version: int
    """The policy version of the weights that computed them."""


class Requests:
    """The live requests by id; recording, stop checks and updates. Engine thread only, except `tokens_per_s`."""

    def __init__(
        self,
        scheduler: Scheduler,
        *,
        tokenizer: Any,
        eos_token_ids: Iterable[int],
        vocab_size: int,
        max_model_len: int,
    ) -> None:
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self.live: dict[str, Request] = {}
        self.generated = self.prompt_tokens = self.finished = self.aborted = 0
        self._rate: deque[tuple[float, int]] = deque()
        self._rate_lock = threading.Lock()

    def add(self, request: Request) -> None:
        """Queue a checked request; one the scheduler cannot take (a tokenizer that cannot decode its prompt)
        fails alone."""
        self.live[request.id] = request
        try:
            self.scheduler.add(request, self.tokenizer)
        except Exception as error:
            logger.exception("could not queue request %s", request.id)
            self.abort(request, f"could not queue the request: {type(error).__name__}: {error}")
            return
        self.prompt_tokens += len(request.prompt)

    def abort(self, request: Request, error: str | None = None) -> None:
        """End `request` now (finish reason "abort", `error` when the engine failed it) and free its cache."""
        self.scheduler.abort(request)
        for seq in request.sequences:
            if seq.record.finish_reason is None:
                seq.record.finish_reason = "abort"
        self.aborted += 1
        self.emit(request, error)

    def record(self, sampled: Sampled) -> None:
        """Append each token to its sample, stop the samples it ends, and update the requests that progressed."""
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for row, seq in enumerate(sampled.seqs):
            request, record, token = seq.request, seq.record, sampled.tokens[row]
            params = request.params
            if request.first_token_at is None:
                request.first_token_at = now
            place = len(request.prompt) + len(record.token_ids)  # tokens in flight hold a place after it
            if place < len(seq.tokens):
                seq.tokens[place] = token
            else:
                seq.tokens.append(token)
            record.token_ids.append(token)
            record.logprobs.append(sampled.logprobs[row])
            record.versions.append(sampled.version)
            if params.truncates:
                ids = sampled.kept_ids[row]
                record.encoded_kept_ids.append(None if ids is None else encode_kept_ids(ids, self.vocab_size))
            if params.top_logprobs and sampled.top is not None:
                record.top_logprobs.append(sampled.top[row][: params.top_logprobs])
            finish = self._finish(seq, token)
            if finish is not None:
                record.finish_reason, record.stop_reason = finish
                self.scheduler.finish(seq)
            if request.stream or finish is not None:
                touched[request.id] = request
        with self._rate_lock:
            self._rate.append((now, len(sampled.seqs)))
        self.generated += len(sampled.seqs)
        for request in touched.values():
            self.emit(request)

    def _finish(self, seq: Sequence, token: int) -> tuple[FinishReason, str | int | None] | None:
        """Why `token` ends `seq` (the reason and the stop string or token), or None if it goes on."""
        params = seq.request.params
        if token in params.stop_token_ids:
            return "stop", token
        if not params.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if seq.detokenizer is not None:
            stopped = seq.detokenizer.push(token)
            seq.record.text = seq.detokenizer.text
            if stopped:
                return "stop", seq.detokenizer.stopped_by
        generated = len(seq.record.token_ids)
        if generated >= seq.request.max_tokens or len(seq.request.prompt) + generated >= self.max_model_len:
            return "length", None
        return None

    def emit(self, request: Request, error: str | None = None) -> None:
        """Send `request` what its samples added since its last update (a request that is not streamed: only
        once it is done); a done request leaves the live ones."""
        done = request.done
        if not (request.stream or done):
            return
        samples = []
        for seq in request.sequences:
            record = seq.record
            finished = record.finish_reason is not None
            text_end = seq.detokenizer.stable_length(finished) if request.detokenize and seq.detokenizer else 0
            if len(record.token_ids) == seq.sent_tokens and text_end == seq.sent_chars and seq.sent_finish == finished:
                continue
            routed = None
            if finished and not seq.sent_finish and seq.routing is not None and record.finish_reason != "abort":
                routed = seq.routing.wire(len(request.prompt) + len(record.token_ids) - 1)
            samples.append(record.since(seq.sent_tokens, seq.sent_chars, text_end, seq.sample, routed))
            seq.sent_tokens, seq.sent_chars, seq.sent_finish = len(record.token_ids), text_end, finished
        if done:
            del self.live[request.id]
            self.finished += 1
        first_token_s = None
        if done and request.first_token_at is not None:
            first_token_s = request.first_token_at - request.arrival
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None or request.prompt_logprobs_sent or not prompt_logprobs.complete:
            prompt_logprobs = None
        request.prompt_logprobs_sent |= prompt_logprobs is not None
        update = RequestUpdate(request.id, samples, done, len(request.prompt), error, first_token_s, prompt_logprobs)
        try:
            request.on_update(update)
        except Exception:
            logger.exception("a request's update callback failed")

    def tokens_per_s(self) -> float:
        """Generated tokens per second over the last RATE_WINDOW_S seconds (any thread)."""
        now = time.monotonic()
        with self._rate_lock:
            while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
                self._rate.popleft()
            span = now - self._rate[0][0] if self._rate else 0.0
            return sum(count for _, count in self._rate) / span if span > 0 else 0.0
