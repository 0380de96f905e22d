"""The engine: continuous batching over the project's own model, on a background thread.

A step is three calls, as vLLM's `EngineCore.step` is: the scheduler plans the work (`scheduler.py`), the runner
executes it on the model (`runner.py`: prefill, decode, sampling, the overlapped step), and the request side
records the sampled tokens, checks stop conditions and sends the requests their updates (`requests.py`). This
module is the loop around them and the public interface.

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
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tandem.config.inference import InferenceConfig
from tandem.images import ImageError, PixelEncoder
from tandem.inference.kv_budget import kv_cache_blocks, state_slots
from tandem.inference.limits import BatchLimits, RequestRefused, ServerLimits, check_prompt
from tandem.inference.outputs import Collector, PromptLogprobs, RequestUpdate, SampleRecord
from tandem.inference.prompt_images import MAX_IMAGES, PromptImages
from tandem.inference.prompt_images import expand as expand_prompt
from tandem.inference.requests import Requests, Sampled
from tandem.inference.runner import Runner
from tandem.inference.scheduler import BlockAllocator, Request, Scheduler
from tandem.inference.weights import copy_weights
from tandem.models import CausalLM
from tandem.models.lora import lora_args
from tandem.wire.protocol import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class EngineStats:
    running: int
    """Sequences holding KV cache (decoding or part-way through their prompt)."""
    waiting_requests: int
    kv_blocks_used: int
    kv_blocks_total: int
    tokens_per_s: float
    """Generated tokens per second over the last `requests.RATE_WINDOW_S` seconds."""
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


class Engine:
    """Serves one model: `start()` it, `submit()` requests from any thread, `stop()` it."""

    def __init__(
        self,
        model: CausalLM,
        config: InferenceConfig,
        *,
        tokenizer: Any = None,
        eos_token_ids: Iterable[int] = (),
        pixels: PixelEncoder | None = None,
    ) -> None:
        self.model = model.eval().requires_grad_(False)
        self.pixels = pixels
        """A vision-language model's image processor: requests with images need it."""
        self.max_request_image_pixels = config.max_request_image_pixels
        self.device = model.lm_head_weight.device
        self.vocab_size, self.max_model_len = model.args.vocab_size, config.seq_len
        num_blocks = kv_cache_blocks(config, model.args, model.lm_head_weight.dtype, self.device)
        self.scheduler = Scheduler(
            BlockAllocator(num_blocks),
            config.block_size,
            config.max_running,
            config.max_prefill_tokens,
            state_slots(config, model.args),
        )
        self.runner = Runner(self.model, config, self.scheduler, tokenizer)
        self.requests = Requests(
            self.scheduler,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )
        batch = BatchLimits(
            block_size=config.block_size,
            usable_blocks=num_blocks - 1 - self.scheduler.watermark,
            max_running=config.max_running,
            max_prefill_tokens=config.max_prefill_tokens,
            blocks_to_admit=self.scheduler.blocks_to_admit,
        )
        self.limits = ServerLimits(
            self.vocab_size, self.max_model_len, config.max_logprobs, text=tokenizer is not None, batch=batch
        )
        self.version = 0
        self.paused = False
        self.error: str | None = None
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._steps = self._swaps = 0
        self._swap_s = self._busy_s = 0.0
        self.gauges = Gauges()

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
        adapter: bool = True,
        images: PromptImages | None = None,
    ) -> str:
        """Queue a request; raises RequestRefused (a ValueError naming the problem) for one the engine cannot serve.

        `on_update` is called on the engine thread: every step the request progresses when `stream`, else once
        at the end; the last update has `finished=True`. `detokenize` adds text (stop strings cut it).
        `adapter=False` runs a model served with unfolded LoRA adapters without them (the base model).
        `images`: a vision-language prompt's images, from `expand_images` (which gave `prompt` too).
        """
        prompt = list(prompt)
        if images is not None and images.positions.shape[1] != len(prompt):
            raise RequestRefused("images: expand the prompt with expand_images and submit what it returns")
        max_tokens = self.check(prompt, params, n=n, detokenize=detokenize)
        if not adapter and self.runner.adapter_gates is None and lora_args(self.model) is not None:
            raise RequestRefused("this server's LoRA adapters are folded into its weights: it cannot serve the base")
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
            adapter=adapter,
            images=images,
        )
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = PromptLogprobs(len(prompt), params.prompt_logprobs)
        self._send(lambda: self.requests.add(request))
        return request.id

    def check_images(self, refs: list[list[str]], stop: Callable[[], bool] | None = None) -> int:
        """Check a request's images (one list of references per prompt) before any is decoded and return their
        pixels together: RequestRefused for a model without images, more than `MAX_IMAGES` for a prompt, a
        reference other than a data URL, or an image that is unreadable or over the pixel limits, each image's and
        the request's together (from the headers, asking `stop` before each)."""
        every = [ref for urls in refs for ref in urls]
        pixels = self._pixels(every)
        if any(len(urls) > MAX_IMAGES for urls in refs):
            raise RequestRefused(f"{max(map(len, refs))} images for one prompt; at most {MAX_IMAGES}")
        try:
            return pixels.check(every, self.max_request_image_pixels, stop)
        except ImageError as error:
            raise RequestRefused(f"bad image: {error}") from None

    def expand_images(
        self, prompt: list[int], refs: list[str], stop: Callable[[], bool] | None = None
    ) -> tuple[list[int], PromptImages]:
        """A vision-language prompt with one placeholder token per image and the images' data URLs: the prompt
        with each placeholder expanded to the image's merged patches, and the images read and processed for
        `submit`, here on the caller's thread (the engine thread only runs the vision tower), one at a time,
        asking `stop` before each. RequestRefused for a model without images, a reference other than a data URL,
        placeholders that do not match, or an image that is unreadable or too large (`check_images` checks a
        whole request's first)."""
        pixels = self._pixels(refs)
        assert self.model.args.image_token_id is not None
        try:
            return expand_prompt(prompt, refs, pixels, self.model.args.image_token_id, stop)
        except ValueError as error:
            raise RequestRefused(str(error)) from None

    def _pixels(self, refs: list[str]) -> PixelEncoder:
        """The image processor, for data URLs `refs`: RequestRefused for a model without images or other refs."""
        if self.model.visual is None or self.pixels is None or self.model.args.image_token_id is None:
            raise RequestRefused(f"{self.model.args.architecture} takes no images")
        if not all(ref.startswith("data:") for ref in refs):
            raise RequestRefused("images: the server takes data URLs only (data:image/png;base64,...)")
        return self.pixels

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
        adapters: list[bool] | None = None,
    ) -> list[list[SampleRecord]]:
        """Blocking convenience: run prompts to completion, returning `n` samples per prompt."""
        collectors = self.collect(prompts, params, n, detokenize=detokenize, timeout=timeout, adapters=adapters)
        return [c.samples for c in collectors]

    def collect(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        n: int = 1,
        *,
        detokenize: bool = False,
        timeout: float | None = None,
        adapters: list[bool] | None = None,
    ) -> list[Collector]:
        """Blocking: run prompts to completion (sharing steps), returning each one's collector (its `n` samples,
        and its prompt logprobs when asked for); RuntimeError if any failed. `adapters`: per prompt, whether it runs
        the LoRA adapters (`submit`'s `adapter`; default: all do)."""
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
            adapter = True if adapters is None else adapters[index]
            self.submit(prompt, params, on_update(index), n=n, detokenize=detokenize, adapter=adapter)
        deadline = None if timeout is None else time.monotonic() + timeout
        for event in done:
            if not event.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"generation did not finish within {timeout} s")
        errors = [c.error for c in collectors if c.error]
        if errors:
            raise RuntimeError(errors[0])
        return collectors

    def stats(self) -> EngineStats:
        gauges, requests = self.gauges, self.requests
        cuda = self.device.type == "cuda"
        return EngineStats(
            running=gauges.running,
            waiting_requests=gauges.waiting_requests,
            kv_blocks_used=gauges.kv_blocks_used,
            kv_blocks_total=self.scheduler.allocator.num_blocks - 1,
            tokens_per_s=requests.tokens_per_s(),
            generated_tokens=requests.generated,
            prompt_tokens=requests.prompt_tokens,
            requests_finished=requests.finished,
            requests_aborted=requests.aborted,
            preemptions=self.scheduler.preemptions,
            steps=self._steps,
            overlapped_steps=self.runner.overlapped_steps,
            policy_version=self.version,
            paused=self.paused,
            weight_swaps=self._swaps,
            swap_pause_s=self._swap_s,
            busy_s=self._busy_s,
            peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device) if cuda else None,
            peak_reserved_bytes=torch.cuda.max_memory_reserved(self.device) if cuda else None,
        )

    def check(self, prompt: list[int], params: SamplingParams, *, n: int = 1, detokenize: bool = False) -> int:
        """RequestRefused (a ValueError naming the problem) for a request this engine cannot serve; returns its
        max_tokens. The limits the request models cannot know (`limits.check_prompt`), checked before anything is
        made for the request, so a bad one costs nothing and never reaches the engine thread. `submit` checks
        again."""
        return check_prompt(prompt, params, self.limits, n=n, detokenize=detokenize)

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
            for request_id in list(self.requests.live):
                self._abort(request_id, self.error or "the engine stopped")

    def _loop(self) -> None:
        while not self._stopping:
            idle = self.paused or not self.requests.live
            self._drain(block=idle and self.runner.in_flight is None)
            if self._stopping:
                continue
            try:
                if self.paused or not self.requests.live:
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

    def _step(self) -> bool:
        """Schedule, execute, update; False when there was nothing to run."""
        self._update(self.runner.settle())
        plan = self.scheduler.schedule()  # a step that continues the one in flight decodes its sequences
        if not plan:
            return False
        ready, sampled = self.runner.execute(plan, self.version)
        self._update(sampled)
        self._steps += 1
        if self.scheduler.probation:
            self.scheduler.passed(ready)
        return True

    def _update(self, sampled: Sampled | None) -> None:
        if sampled is not None:
            self.requests.record(sampled)

    def _land(self) -> None:
        """Record the step in flight, if any."""
        self._update(self.runner.land())

    def _contain(self, error: Exception) -> None:
        """A step failed. With one request on probation it ran alone, so it is the cause and only it fails, once
        the engine has stepped without it (`Runner.self_check`, which raises, ending the engine, if it cannot).
        Else the step's requests go on probation, keeping their outputs (the step in flight is recomputed, with
        the same seeded draws): no request is failed for another's fault."""
        message = f"engine step failed: {type(error).__name__}: {error}"
        self.runner.discard()
        scheduler, live = self.scheduler, self.requests.live
        if scheduler.probation:
            probe = scheduler.probation[0]
            logger.error("%s; failing request %s, which ran alone", message, probe.id, exc_info=error)
            self.runner.self_check()
            if probe.id in live:
                self._abort(probe.id, message)
            else:
                scheduler.abort(probe)
        else:
            suspects = scheduler.requeue_running() or list(live.values())
            suspects = [r for r in suspects if not r.done]  # a finished one has nothing left to run on probation
            logger.error("%s; retrying its %d requests one at a time", message, len(suspects), exc_info=error)
            scheduler.probation.extend(suspects)
        for request in [r for r in live.values() if r.done]:
            self.requests.emit(request)  # finished in the failed step before its update went out

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

    def _abort(self, request_id: str, error: str | None = None) -> None:
        request = self.requests.live.get(request_id)
        if request is None:
            return
        if self.runner.holds(request):
            self._land()  # its tokens already computed are kept
            if request_id not in self.requests.live:  # they finished it
                return
        self.requests.abort(request, error)

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
        self._swaps += 1
        self._swap_s += pause_s
        logger.info("policy version %d loaded", version)
        return pause_s
