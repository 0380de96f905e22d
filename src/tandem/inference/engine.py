"""The engine: continuous batching over the project's own model, on a background thread.

Each step: the scheduler picks the work (`scheduler.py`); one forward prefills every prompt chunk of the step
(`CausalLM.prefill`), requests with n > 1 fork once their prompt is cached, one forward decodes a token for
every running sequence (`decode.py`, under CUDA graphs when enabled), and one sampler call draws the next
token of every sequence that has its whole context cached (`sampling.py`). Tokens are then recorded with
their logprob, mask and policy version, stop conditions are checked, and updates go to the requests.

With `overlap_steps`, a decode step whose rows all sample from the whole vocabulary leaves its tokens on the
device: the next step, when it decodes exactly the same sequences, is launched with those tokens as inputs
before the host reads them, so scheduling, recording and stop checks run while the GPU computes. Each token
is recorded one step late; a sequence that stopped has its extra token dropped. A waiting request that can
join, prefill, a cache out of blocks, a sequence at its last token, a cancel, pause or stop, and an idle
engine land the step in flight first.

A step that fails fails only the request that made it fail: its requests wait again with their outputs and run
one at a time (the scheduler's probation) until each has sampled a token; a step that fails with one request
alone fails that request, unless the engine cannot even step without any request (a self-check), which stops it.

Only the engine thread touches the model, the cache and the scheduler. Other threads send commands
(`submit`, `cancel`, `pause`, `resume`, `swap_weights`, `stop`) through a queue that is drained between
steps, so a weight swap happens between two steps: in-flight requests pause, the weights change in place,
and they continue (their cached keys and values stay; every token records the version that produced it).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tandem.config.inference import InferenceConfig
from tandem.inference.cuda_graphs import GraphedDecoder
from tandem.inference.decode import EagerDecoder, StepFunction, decode_step
from tandem.inference.fused_decode import fused_decode_step, fused_decode_supported
from tandem.inference.kv_budget import block_bytes, kv_cache_blocks
from tandem.inference.masks import encode_mask
from tandem.inference.outputs import PromptLogprobs, RequestUpdate, SampleRecord, SampleUpdate
from tandem.inference.protocol import FinishReason, SamplingParams, context_room
from tandem.inference.sampling import Sampler, SamplingBatch
from tandem.inference.scheduler import SCRATCH_BLOCK, BlockAllocator, Request, Scheduler, Sequence
from tandem.inference.weights import copy_weights
from tandem.kernels import triton_available, triton_unavailable_reason
from tandem.models import CausalLM, KVCache
from tandem.models.logprobs import score_tokens

logger = logging.getLogger(__name__)

T = TypeVar("T")
RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class EngineStats:
    running: int
    """Sequences holding KV cache (decoding or part-way through their prompt)."""
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_per_s: float
    """Generated tokens per second over the last RATE_WINDOW_S seconds."""
    generated_tokens: int
    prompt_tokens: int
    requests_finished: int
    requests_aborted: int
    preemptions: int
    steps: int
    overlapped_steps: int
    """Decode steps launched before the host read the previous step's tokens (`overlap_steps`)."""
    policy_version: int
    paused: bool
    weight_swaps: int
    """Weight swaps done (`swap_weights`)."""
    swap_pause_s: float
    """Seconds generation paused for them, in total (each swap's in-place copy)."""
    busy_s: float
    """Seconds the engine thread spent running steps, in total; the rest it idled, waiting for work or paused."""
    peak_allocated_bytes: int | None
    """Peak GPU memory the allocator handed out in this process (`torch.cuda.max_memory_allocated`); None on CPU."""
    peak_reserved_bytes: int | None
    """Peak GPU memory the allocator held from the driver (`torch.cuda.max_memory_reserved`); None on CPU."""


@dataclass(frozen=True)
class Gauges:
    """Scheduler sizes, published by the engine thread after every step and command batch (safe to read)."""

    running: int = 0
    waiting_requests: int = 0
    kv_blocks_used: int = 0


class Collector:
    """A request's updates accumulated into its n samples (what a non-streaming caller waits for)."""

    def __init__(self, n: int) -> None:
        self.samples = [SampleRecord() for _ in range(n)]
        self.prompt_logprobs: PromptLogprobs | None = None
        self.finished = False
        self.error: str | None = None

    def add(self, update: RequestUpdate) -> list[SampleUpdate]:
        self.prompt_logprobs = update.prompt_logprobs or self.prompt_logprobs
        for sample in update.samples:
            self.samples[sample.sample].extend(sample)
        self.finished = update.finished
        self.error = update.error or self.error
        return update.samples


@dataclass
class InFlight:
    """A decode step sampled on the device that the host has not recorded yet: the next step's input tokens,
    and a copy of tokens and logprobs on its way to host memory."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    """`[R]` on the device, in `seqs` order."""
    host: torch.Tensor
    """`[2, R]` float64: tokens, logprobs (pinned memory on CUDA, filled without blocking)."""
    copied: torch.cuda.Event | None
    version: int
    batch: SamplingBatch
    """The step's sampling parameters; the next step's are these one token later."""

    @classmethod
    def launch(
        cls, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor, version: int, batch: SamplingBatch
    ) -> InFlight:
        values = torch.stack((tokens.double(), logprobs.double()))
        if not tokens.is_cuda:
            return cls(seqs, tokens, values, None, version, batch)
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(tokens.device))
        return cls(seqs, tokens, host, copied, version, batch)

    def results(self) -> tuple[list[int], list[float]]:
        if self.copied is not None:
            self.copied.synchronize()
        tokens, logprobs = self.host.tolist()
        return [int(token) for token in tokens], logprobs


class Engine:
    """Serves one model: `start()` it, `submit()` requests from any thread, `stop()` it."""

    def __init__(
        self,
        model: CausalLM,
        config: InferenceConfig,
        *,
        tokenizer: Any = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.config, self.tokenizer = config, tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        args = model.args
        self.device = model.lm_head_weight.device
        dtype = model.lm_head_weight.dtype
        self.vocab_size, self.max_model_len = args.vocab_size, config.seq_len
        num_blocks = kv_cache_blocks(config, args, dtype, self.device)
        self.cache = KVCache(
            args.num_layers, num_blocks, config.block_size, args.num_kv_heads, args.head_dim, dtype, self.device
        )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            num_blocks,
            config.block_size,
            num_blocks * block_bytes(args, config.block_size, dtype) / 2**30,
        )
        self.scheduler = Scheduler(
            BlockAllocator(num_blocks), config.block_size, config.max_running, config.max_prefill_tokens
        )
        self.usable_blocks = num_blocks - 1 - self.scheduler.watermark
        self.decoder = self._decoder()
        self.sampler = Sampler(triton=self.decoder.step is fused_decode_step)
        self.in_flight: InFlight | None = None
        self.version = 0
        self.paused = False
        self.error: str | None = None
        self._requests: dict[str, Request] = {}
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._rate: deque[tuple[float, int]] = deque()
        self._rate_lock = threading.Lock()
        names = ("generated", "prompt", "finished", "aborted", "steps", "overlapped", "swaps")
        self._counts = dict.fromkeys(names, 0)
        self._swap_s = self._busy_s = 0.0
        self.gauges = Gauges()

    def _decoder(self) -> EagerDecoder | GraphedDecoder:
        step = self._decode_step()
        compiled = step is not decode_step and step is not fused_decode_step
        if self.config.cuda_graphs and self.device.type == "cuda":
            max_blocks = -(-self.max_model_len // self.config.block_size)
            # Compiled, a batch of 1 would be a second compilation (size 1 is always specialised); a padded
            # row costs next to nothing in a memory-bound step.
            smallest = 2 if compiled else 1
            sizes = [max(b, smallest) for b in self.config.cuda_graph_batch_sizes if b <= self.config.max_running]
            return GraphedDecoder(self.model, self.cache, sizes, max_blocks, step)
        return EagerDecoder(self.model, self.cache, step)

    def _decode_step(self) -> StepFunction:
        """The Triton step where asked (auto: on CUDA with triton installed), else the module step, compiled if asked."""
        kernels = self.config.decode_kernels
        unsupported = fused_decode_supported(self.model)
        if kernels == "auto":
            kernels = "triton" if self.device.type == "cuda" and triton_available() and unsupported is None else "torch"
        if kernels == "triton":
            unsupported = unsupported or triton_unavailable_reason(self.device.type)
            if unsupported is not None:
                raise ValueError(f"inference.decode_kernels = triton: {unsupported}")
            if self.config.compile:
                logger.info("decode uses the Triton kernels; inference.compile applies to decode_kernels = torch only")
            logger.info("decode steps run on the Triton decode kernels")
            return fused_decode_step
        return torch.compile(decode_step, dynamic=True) if self.config.compile else decode_step

    # --- the public interface (any thread) ---

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Abort whatever is in flight and end the engine thread."""
        self._stopping = True
        self._commands.put(lambda: None)
        if self._thread.is_alive():
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(
        self,
        prompt: Iterable[int],
        params: SamplingParams,
        on_update: Callable[[RequestUpdate], None],
        *,
        n: int = 1,
        stream: bool = False,
        detokenize: bool = False,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raises ValueError (naming the problem) for one the engine cannot serve.

        `on_update` is called on the engine thread: every step the request progresses when `stream`, else once
        at the end; the last update has `finished=True`. `detokenize` adds text (stop strings cut it).
        """
        prompt = list(prompt)
        max_tokens = self.check(prompt, params, n=n, detokenize=detokenize)
        request = Request(
            id=request_id or uuid.uuid4().hex,
            prompt=prompt,
            params=params,
            n=n,
            seed=params.seed if params.seed is not None else secrets.randbits(64),
            max_tokens=max_tokens,
            stream=stream,
            detokenize=detokenize,
            on_update=on_update,
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = PromptLogprobs(len(prompt), params.prompt_logprobs)
        self._send(lambda: self._add(request))
        return request.id

    def cancel(self, request_id: str) -> None:
        """Abort a request (finish reason "abort") and free its cache; unknown or finished ids are ignored."""
        if self._thread.is_alive():  # a stopped engine has aborted everything already
            self._commands.put(lambda: self._abort(request_id))

    def pause(self) -> Future[None]:
        """Stop stepping (requests stay queued or in the batch with their cache); resolves once no step runs."""
        return self._call(self._pause)

    def resume(self) -> Future[None]:
        return self._call(lambda: setattr(self, "paused", False))

    def swap_weights(self, tensors: dict[str, torch.Tensor], version: int) -> Future[float]:
        """Copy `weights.read_weights` tensors into the model between two steps; resolves to the pause in s."""
        return self._call(lambda: self._swap(tensors, version))

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int = 1,
        *,
        detokenize: bool = False,
        timeout: float | None = None,
    ) -> list[list[SampleRecord]]:
        """Blocking convenience: run prompts to completion, returning `n` samples per prompt."""
        return [c.samples for c in self.collect(prompts, params, n, detokenize=detokenize, timeout=timeout)]

    def collect(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int = 1,
        *,
        detokenize: bool = False,
        timeout: float | None = None,
    ) -> list[Collector]:
        """Blocking: run prompts to completion (sharing steps), returning each one's collector (its `n` samples,
        and its prompt logprobs when asked for); RuntimeError if any failed."""
        for prompt in prompts:  # all of them, before anything is made for any
            self.check(prompt, params, n=n, detokenize=detokenize)
        collectors = [Collector(n) for _ in prompts]
        done = [threading.Event() for _ in prompts]

        def on_update(index: int) -> Callable[[RequestUpdate], None]:
            def add(update: RequestUpdate) -> None:
                collectors[index].add(update)
                if update.finished:
                    done[index].set()

            return add

        for index, prompt in enumerate(prompts):
            self.submit(prompt, params, on_update(index), n=n, detokenize=detokenize)
        deadline = None if timeout is None else time.monotonic() + timeout
        for event in done:
            if not event.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"generation did not finish within {timeout} s")
        errors = [c.error for c in collectors if c.error]
        if errors:
            raise RuntimeError(errors[0])
        return collectors

    def stats(self) -> EngineStats:
        now = time.monotonic()
        with self._rate_lock:
            while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
                self._rate.popleft()
            span = now - self._rate[0][0] if self._rate else 0.0
            rate = sum(count for _, count in self._rate) / span if span > 0 else 0.0
        gauges = self.gauges
        cuda = self.device.type == "cuda"
        return EngineStats(
            running=gauges.running,
            waiting_requests=gauges.waiting_requests,
            kv_blocks_used=gauges.kv_blocks_used,
            kv_blocks_total=self.scheduler.allocator.num_blocks - 1,
            tokens_per_s=rate,
            generated_tokens=self._counts["generated"],
            prompt_tokens=self._counts["prompt"],
            requests_finished=self._counts["finished"],
            requests_aborted=self._counts["aborted"],
            preemptions=self.scheduler.preemptions,
            steps=self._counts["steps"],
            overlapped_steps=self._counts["overlapped"],
            policy_version=self.version,
            paused=self.paused,
            weight_swaps=self._counts["swaps"],
            swap_pause_s=self._swap_s,
            busy_s=self._busy_s,
            peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device) if cuda else None,
            peak_reserved_bytes=torch.cuda.max_memory_reserved(self.device) if cuda else None,
        )

    def check(self, prompt: list[int], params: SamplingParams, *, n: int = 1, detokenize: bool = False) -> int:
        """Raise ValueError (naming the problem) for a request this engine cannot serve; returns its max_tokens.

        The limits the request models cannot know (vocabulary, context, KV blocks, max_running, max_logprobs),
        checked before anything is made for the request, so a bad one costs nothing and never reaches the
        engine thread. `submit` checks again."""
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size})")
        max_tokens = context_room(len(prompt), params.max_tokens, self.max_model_len)
        blocks = -(-(len(prompt) + max_tokens) // self.config.block_size)
        if blocks > self.usable_blocks:
            raise ValueError(
                f"prompt plus max_tokens ({len(prompt) + max_tokens} tokens) needs {blocks} KV-cache blocks; "
                f"the server has {self.usable_blocks} (raise kv_cache_blocks, or lower max_tokens)"
            )
        if n > self.config.max_running:
            raise ValueError(f"n={n} is more than the server runs at once (max_running={self.config.max_running})")
        admit = self.scheduler.blocks_to_admit(min(len(prompt), self.config.max_prefill_tokens), n)
        if admit > self.usable_blocks:  # it would wait forever, and every request queued after it too
            raise ValueError(
                f"n={n} samples of this prompt need {admit} KV-cache blocks free at once to start (its first prompt "
                f"chunk, and a block for each other sample); the server has {self.usable_blocks} (lower n)"
            )
        if params.top_logprobs > self.config.max_logprobs:
            raise ValueError(f"top_logprobs={params.top_logprobs} is above the server's max_logprobs")
        if (params.prompt_logprobs or 0) > self.config.max_logprobs:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} is above the server's max_logprobs")
        if (params.stop or detokenize) and self.tokenizer is None:
            raise ValueError("stop strings and text output need a tokenizer; this engine has none")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must lie in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias token ids must lie in [0, {self.vocab_size})")
        return max_tokens

    def _call(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as error:
                future.set_exception(error)

        self._send(run)
        return future

    def _send(self, command: Callable[[], None]) -> None:
        if self._stopping or not self._thread.is_alive():
            raise RuntimeError(f"the engine is not running ({self.error or 'stopped'})")
        self._commands.put(command)

    # --- the engine thread ---

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":  # graphs, Triton launches and events go to this device's streams
                torch.cuda.set_device(self.device)
            with torch.inference_mode():
                self._loop()
        except BaseException as error:
            self.error = f"engine thread died: {type(error).__name__}: {error}"
            logger.exception(self.error)
        finally:
            self._drain(block=False)  # commands sent before `stop()`: their requests are aborted below
            try:
                self._land()  # tokens already computed reach their requests before the aborts
            except Exception:
                logger.exception("could not record the last decode step")
            for request_id in list(self._requests):
                self._abort(request_id, self.error or "the engine stopped")

    def _loop(self) -> None:
        while not self._stopping:
            self._drain(block=(self.paused or not self._requests) and self.in_flight is None)
            if self._stopping:
                continue
            try:
                if self.paused or not self._requests:
                    self._land()  # the step in flight, if any; then idle until a command comes
                else:
                    started = time.monotonic()
                    stepped = self._step()
                    self._busy_s += time.monotonic() - started
                    if not stepped:
                        self._drain(block=True, timeout=0.01)
            except Exception as error:
                self._contain(error)
            self._publish()

    def _contain(self, error: Exception) -> None:
        """A step failed. With one request on probation it ran alone, so it is the cause and only it fails, once
        the engine has stepped without it (`_self_check`, which raises, ending the engine, if it cannot). Else the
        step's requests go on probation, keeping their outputs (the step in flight is recomputed, with the same
        seeded draws): no request is failed for another's fault."""
        message = f"engine step failed: {type(error).__name__}: {error}"
        self.in_flight = None
        scheduler = self.scheduler
        if scheduler.probation:
            probe = scheduler.probation[0]
            logger.error("%s; failing request %s, which ran alone", message, probe.id, exc_info=error)
            self._self_check()
            if probe.id in self._requests:
                self._abort(probe.id, message)
            else:
                scheduler.abort(probe)
        else:
            suspects = scheduler.requeue_running() or list(self._requests.values())
            suspects = [r for r in suspects if not r.done]  # a finished one has nothing left to run on probation
            logger.error("%s; retrying its %d requests one at a time", message, len(suspects), exc_info=error)
            scheduler.probation.extend(suspects)
        for request in [r for r in self._requests.values() if r.done]:
            self._emit(request)  # finished in the failed step before its update went out

    def _self_check(self) -> None:
        """Prefill one token into the scratch block and sample it, with no request involved: raises if the engine
        cannot step at all (a broken device), so that failure is reported as the engine's (/health: 503)."""
        batch = self.cache.batch([1], [0], [[SCRATCH_BLOCK]])
        logits = self.model.prefill(torch.zeros(1, dtype=torch.long, device=self.device), self.cache, batch)
        self.sampler(logits, SamplingBatch.build([SamplingParams(temperature=0)], [0], [0], [0], self.device))

    def _drain(self, block: bool, timeout: float | None = None) -> None:
        try:
            command = self._commands.get(timeout=timeout) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish()

    def _publish(self) -> None:
        scheduler = self.scheduler
        self.gauges = Gauges(len(scheduler.running), scheduler.num_waiting_requests, scheduler.allocator.num_used)

    def _add(self, request: Request) -> None:
        self._requests[request.id] = request
        try:
            self.scheduler.add(request, self.tokenizer)
        except Exception as error:  # e.g. a tokenizer that cannot decode the prompt: this request's, only
            logger.exception("could not queue request %s", request.id)
            self._abort(request.id, f"could not queue the request: {type(error).__name__}: {error}")
            return
        self._counts["prompt"] += len(request.prompt)

    def _abort(self, request_id: str, error: str | None = None) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        if self.in_flight is not None and any(seq.request is request for seq in self.in_flight.seqs):
            self._land()  # its tokens already computed are kept
            if request_id not in self._requests:  # they finished it
                return
        self.scheduler.abort(request)
        for seq in request.sequences:
            if seq.record.finish_reason is None:
                seq.record.finish_reason = "abort"
        self._counts["aborted"] += 1
        self._emit(request, error)

    def _pause(self) -> None:
        self.paused = True
        self._land()  # so a paused engine has recorded every token it sampled

    def _swap(self, tensors: dict[str, torch.Tensor], version: int) -> float:
        started = time.monotonic()
        try:
            copy_weights(self.model, tensors)
        except BaseException as error:
            self.error = f"a weight swap failed part-way; the model is inconsistent: {error}"
            raise
        self.version = version
        pause_s = time.monotonic() - started
        self._counts["swaps"] += 1
        self._swap_s += pause_s
        logger.info("policy version %d loaded", version)
        return pause_s

    def _step(self) -> bool:
        previous = self.in_flight
        if previous is not None and not self._continues(previous):
            self._land()
            previous = None
        plan = self.scheduler.schedule()  # a step that continues `previous` decodes its sequences: never empty
        if not plan:
            return False
        if previous is not None and (plan.prefill or plan.decode != previous.seqs):
            raise RuntimeError("an overlapped decode step must run the sequences of the step in flight, only")
        version = self.version
        logits: list[torch.Tensor] = []
        ready: list[Sequence] = []
        if plan.prefill:
            prefill_logits, prefill_ready = self._prefill(plan.prefill)
            if prefill_ready:
                logits.append(prefill_logits)
                ready += prefill_ready
        if plan.decode:
            logits.append(self._decode(plan.decode, None if previous is None else previous.tokens))
            ready += plan.decode
        if ready:  # a step continuing `previous` samples its rows, one token on
            batch = self._sampling_batch(ready) if previous is None else previous.batch.next_step()
            all_logits = torch.cat(logits) if len(logits) > 1 else logits[0]
            overlap = self.config.overlap_steps and not plan.prefill and not self.scheduler.probation
            if overlap and batch.stays_on_device:
                self.in_flight = InFlight.launch(ready, *self.sampler.on_device(all_logits, batch), version, batch)
                now = time.monotonic()
                for seq in ready:
                    seq.tokens.append(0)  # its place: the next step reads the token from the device
                    if seq.request.first_token_at is None:
                        seq.request.first_token_at = now
                if previous is not None:
                    self._counts["overlapped"] += 1
                    self._record_in_flight(previous)  # while the GPU runs the step just launched
            else:  # no `previous` here: its sequences, alone in this step, sample the same way again
                sampled = self.sampler(all_logits, batch)
                self._record(ready, sampled.tokens, sampled.logprobs, sampled.kept, sampled.top, version)
        self._counts["steps"] += 1
        if self.scheduler.probation:
            self.scheduler.passed(ready)
        return True

    def _sampling_batch(self, ready: list[Sequence]) -> SamplingBatch:
        return SamplingBatch.build(
            [seq.request.params for seq in ready],
            [seq.request.seed for seq in ready],
            [seq.sample for seq in ready],
            [len(seq.tokens) - len(seq.request.prompt) for seq in ready],  # tokens generated, in flight too
            self.device,
            [seq.record.token_ids for seq in ready],  # complete: no step is in flight when a batch is built
        )

    def _continues(self, previous: InFlight) -> bool:
        """Whether the next step can run on `previous`'s tokens unread: it decodes exactly `previous`'s sequences
        (no waiting request can join, no cache block runs out, none is at its last token), so no plan depends on
        them."""
        scheduler, block_size = self.scheduler, self.config.block_size
        if scheduler.running != previous.seqs:
            return False
        growing = sum(seq.num_cached + 1 > len(seq.blocks) * block_size for seq in previous.seqs)
        if growing > scheduler.allocator.num_free or scheduler.admits_next(reserved_blocks=growing):
            return False
        return all(
            len(seq.record.token_ids) + 2 <= seq.request.max_tokens
            and len(seq.request.prompt) + len(seq.record.token_ids) + 2 <= self.max_model_len
            for seq in previous.seqs
        )

    def _land(self) -> None:
        """Record the step in flight, if any."""
        if self.in_flight is not None:
            self._record_in_flight(self.in_flight)

    def _record_in_flight(self, step: InFlight) -> None:
        if self.in_flight is step:
            self.in_flight = None
        tokens, logprobs = step.results()
        live = [row for row, seq in enumerate(step.seqs) if seq.record.finish_reason is None]  # not stopped since
        if not live:
            return
        seqs = [step.seqs[row] for row in live]
        self._record(
            seqs, [tokens[row] for row in live], [logprobs[row] for row in live], [None] * len(live), None, step.version
        )

    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the step's prompt chunks; returns logits rows for the sequences now ready to sample."""
        seqs = [seq for seq, _ in chunks]
        ids = [token for seq, take in chunks for token in seq.tokens[seq.num_cached : seq.num_cached + take]]
        width = max(len(seq.blocks) for seq in seqs)
        tables = [seq.blocks + [-1] * (width - len(seq.blocks)) for seq in seqs]
        batch = self.cache.batch([take for _, take in chunks], [seq.num_cached for seq in seqs], tables)
        input_ids = torch.tensor(ids, device=self.device)
        scoring = self._prompt_targets(chunks)
        if scoring[0]:  # only requests that asked for prompt logprobs pay for the hidden states of every token
            hidden = self.model.cached_hidden_states(input_ids, self.cache, batch)
            logits = self.model.compute_logits(hidden[batch.last_index])
            self._score_prompts(hidden, *scoring)
        else:
            logits = self.model.prefill(input_ids, self.cache, batch)
        rows: list[int] = []
        ready: list[Sequence] = []
        for row, (seq, take) in enumerate(chunks):
            seq.num_cached += take
            if seq.pending:
                continue
            group = [seq]
            if seq.request.unforked:
                children, copies = self.scheduler.fork(seq, self.tokenizer)
                self._copy_blocks(copies)
                group += children
            rows += [row] * len(group)
            ready += group
        return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)], ready

    def _prompt_targets(self, chunks: list[tuple[Sequence, int]]) -> tuple[list[int], list[int], list[PromptLogprobs]]:
        """The packed rows of these prompt chunks that score prompt tokens not scored yet, the token each scores
        and the scores it goes to. The hidden state at position q predicts token q + 1; the last prompt token's
        predicts the completion, which the sampler scores."""
        rows: list[int] = []
        targets: list[int] = []
        owners: list[PromptLogprobs] = []
        start = 0
        for seq, take in chunks:
            scores = seq.request.prompt_logprobs
            if scores is not None and not scores.complete:
                if scores.filled <= seq.num_cached:
                    raise RuntimeError("prompt logprobs: a chunk starts past the first unscored prompt token")
                for position in range(scores.filled, min(seq.num_cached + take, scores.length - 1) + 1):
                    rows.append(start + position - 1 - seq.num_cached)
                    targets.append(seq.request.prompt[position])
                    owners.append(scores)
            start += take
        return rows, targets, owners

    def _score_prompts(
        self, hidden: torch.Tensor, rows: list[int], targets: list[int], owners: list[PromptLogprobs]
    ) -> None:
        """Score prompt tokens from the prefill's hidden states, with the model's chunked logprob code (temperature
        1, no truncation: the model's own distribution, as vLLM's prompt logprobs), and append to their owners."""
        top_n = max(owner.top_n for owner in owners)
        device = hidden.device
        scored = score_tokens(
            hidden[torch.tensor(rows, device=device)],
            self.model.lm_head_weight,
            torch.tensor(targets, device=device),
            top_n,
        )
        logprobs, top_logprobs, top_ids = (values.tolist() for values in scored)
        for row, owner in enumerate(owners):
            owner.logprobs.append(logprobs[row])
            n = owner.top_n
            owner.top.append(list(zip(top_ids[row][:n], top_logprobs[row][:n], strict=True)) if n else None)

    def _decode(self, seqs: list[Sequence], device_tokens: torch.Tensor | None) -> torch.Tensor:
        tokens = [seq.tokens[-1] for seq in seqs]  # a place-holder where `device_tokens` has the token
        logits = self.decoder(tokens, [seq.num_cached for seq in seqs], [seq.blocks for seq in seqs], device_tokens)
        for seq in seqs:
            seq.num_cached += 1
        return logits

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        source = torch.tensor([s for s, _ in copies], device=self.device)
        target = torch.tensor([t for _, t in copies], device=self.device)
        for layer in self.cache.k + self.cache.v:
            layer.index_copy_(0, target, layer[source])

    def _record(
        self,
        seqs: list[Sequence],
        tokens: list[int],
        logprobs: list[float],
        kept: list[list[int] | None],
        top: list[list[tuple[int, float]]] | None,
        version: int,
    ) -> None:
        now = time.monotonic()
        touched: dict[str, Request] = {}
        for row, seq in enumerate(seqs):
            request, record, token = seq.request, seq.record, tokens[row]
            params = request.params
            if request.first_token_at is None:
                request.first_token_at = now
            place = len(request.prompt) + len(record.token_ids)  # tokens in flight hold a place after it
            if place < len(seq.tokens):
                seq.tokens[place] = token
            else:
                seq.tokens.append(token)
            record.token_ids.append(token)
            record.logprobs.append(logprobs[row])
            record.versions.append(version)
            if params.truncates:
                ids = kept[row]
                record.masks.append(None if ids is None else encode_mask(ids, self.vocab_size))
            if params.top_logprobs and top is not None:
                record.top_logprobs.append(top[row][: params.top_logprobs])
            finish = self._finish(seq, token)
            if finish is not None:
                record.finish_reason, record.stop_reason = finish
                self.scheduler.finish(seq)
            if request.stream or finish is not None:
                touched[request.id] = request
        with self._rate_lock:
            self._rate.append((now, len(seqs)))
        self._counts["generated"] += len(seqs)
        for request in touched.values():
            self._emit(request)

    def _finish(self, seq: Sequence, token: int) -> tuple[FinishReason, str | int | None] | None:
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

    def _emit(self, request: Request, error: str | None = None) -> None:
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
            samples.append(record.since(seq.sent_tokens, seq.sent_chars, text_end, seq.sample))
            seq.sent_tokens, seq.sent_chars, seq.sent_finish = len(record.token_ids), text_end, finished
        if done:
            del self._requests[request.id]
            self._counts["finished"] += 1
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
