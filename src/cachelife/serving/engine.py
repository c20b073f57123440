"""`cachelife.Engine`: concurrent requests on one model, decoded together in the rows of one pinned batch.

`submit(**kwargs)` takes what `cachelife.generate` takes for one sequence and returns a future of what it
would return for that request alone; `await engine.generate(**kwargs)` is the same for asyncio, and
`engine.stream(**kwargs)` yields its new tokens as they come (`streaming`; a request's own `streamer=` gets
them too). Each request runs transformers' `generate` in a thread of the engine (the encoder, the decoder
prompt, the processors, and afterwards Whisper's post-processing) with a decoding method that hands the
prepared request to the engine's scheduler thread and waits. The scheduler owns the device state: at each step
boundary it writes newcomers' prompts into free rows of its static cache (`window` says where; `slots` tracks
each row; `prefill` and `row_writes` do the writing), then runs one call of the step for all rows (`rows`;
compiled, and on CUDA replayed from one captured graph per program), and hands new tokens to streaming
requests and finished rows' tokens back. Requests wait in a bounded queue (`QueueFullError` past it), can be
cancelled (`future.cancel()`) or time out, fail alone when their own input, prefill or streamer fails, and get
`EngineClosedError` when the engine closes before they are served.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from cachelife.errors import EngineClosedError, InvalidArgumentError, QueueFullError, RequestTimeoutError
from cachelife.generation.api import check_generator, check_model, with_stop_string_criteria
from cachelife.generation.arguments import merged_config
from cachelife.generation.loop_settings import CudaGraphs, LoopSettings
from cachelife.integration.enabling import options_of
from cachelife.model_rewrites.row_positions import use_row_positions
from cachelife.serving.admission import Admission, plan
from cachelife.serving.batch import Batch
from cachelife.serving.deadlines import Deadlines
from cachelife.serving.encoder_calls import gather_encoder_calls
from cachelife.serving.joint_prefill import Prefilled, joint_groups
from cachelife.serving.model_facts import counts_positions_from_the_cache
from cachelife.serving.preparation import candidate, check_submitted, prepared_joining
from cachelife.serving.requests import Joining, Request, check_timeout, hand_back, own_copy, resolve, wait_for
from cachelife.serving.stats import EngineStats
from cachelife.serving.step_attention import StepAttention, check_attention, switch_attention
from cachelife.serving.streaming import tokens_as_they_come
from cachelife.serving.warm_up import AdmissionGate, warm_up
from cachelife.validate import check_int

logger = logging.getLogger(__name__)


class Engine:
    """Continuous batching of concurrent `generate` requests on one model (see the module docstring).

    `rows` sequences decode at once; `max_length` bounds each request's prompt plus new tokens; `queue_size`
    requests may wait beyond the rows; `prepare_ahead` requests run their encoder and preparation while
    the rows are full; `encoder_length` (encoder-decoder models but Whisper, whose encoder length is fixed)
    is the longest encoder output a request may have; `timeout` (seconds) is every request's default;
    `attention` is the attention the rows decode with (`step_attention`: "auto", the default, takes cachelife's
    decode kernel, which reads only the slots a row attends, on a CUDA device over SDPA models; "decode"
    wherever the model supports it; "model" keeps the model's own). `steps_per_call`,
    `compile_step` and `cuda_graphs` are `cachelife.generate`'s; the step compiles with the `compile_options` the
    model was enabled with, as `cachelife.generate`'s does."""

    def __init__(
        self, model: PreTrainedModel, *, rows: int = 8, max_length: int = 256, queue_size: int = 64,
        prepare_ahead: int = 2, steps_per_call: int = 1, compile_step: bool = True,
        cuda_graphs: CudaGraphs = "cachelife", encoder_length: int | None = None, timeout: float | None = None,
        attention: StepAttention = "auto",
    ) -> None:  # fmt: skip
        check_model(model)
        check_int("rows", rows)
        check_int("max_length", max_length)
        settings = LoopSettings(
            steps_per_call=steps_per_call, compile_step=compile_step, fallback=False, cuda_graphs=cuda_graphs,
            compile_options=options_of(model).compile_options if compile_step is True else {},
        )  # fmt: skip
        check_int("queue_size", queue_size, minimum=0)
        check_int("prepare_ahead", prepare_ahead, minimum=0)
        check_timeout(timeout)
        attention = check_attention(attention)
        self._model, self._timeout = model, timeout
        switched = switch_attention(model, attention)  # before the step compiles
        row_positions = use_row_positions(model, rows) if counts_positions_from_the_cache(model) else None
        self._encoders = gather_encoder_calls(model, most=rows)  # newcomers' encoders run together
        # What the engine changed on its model for its rows, undone (last first) when it ends.
        changes = (switched, row_positions, self._encoders)
        self._restores = [change.restore for change in changes if change is not None]
        try:
            with torch.no_grad():
                self._batch = Batch(model, rows=rows, max_length=max_length, settings=settings,
                                    encoder_length=encoder_length, row_positions=row_positions)  # fmt: skip
        except BaseException:
            self._restore_model()
            raise
        self._numbers = itertools.count()
        self._capacity = rows + queue_size
        self._held = 0
        self._join_seconds = self._step_seconds = self._collect_seconds = 0.0
        self._waiting: deque[Joining] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._gate = AdmissionGate(self._wake, lambda: len(self._waiting))
        self._closed = False
        self._failure: BaseException | None = None  # why the scheduler failed, once it has
        self._held_requests: dict[int, Request] = {}
        self._deadlines = Deadlines(self._expire)
        self._workers = ThreadPoolExecutor(rows + prepare_ahead, thread_name_prefix="cachelife-engine-request")
        self._scheduler = threading.Thread(target=self._serve, name="cachelife-engine", daemon=True)
        self._scheduler.start()

    # -- the caller's side ---------------------------------------------------------------------------------

    def submit(
        self, *, generator: torch.Generator | None = None, timeout: float | None = None, **kwargs: Any
    ) -> Future[Any]:
        """A future of `cachelife.generate(model, generator=generator, **kwargs)` for one sequence.

        Raises at once for what is wrong before any work (`InvalidArgumentError`, `UnsupportedGenerationError`),
        `QueueFullError` when the engine holds `rows + queue_size` requests, `EngineClosedError` once closed;
        what `generate`'s preparation finds wrong is set on the future. The request's tensors and generation
        config are copied: the caller may reuse its own at once."""
        check_generator(generator, self._model)
        check_timeout(timeout)
        check_submitted(self._model, kwargs, self._batch)
        kwargs = own_copy(kwargs)
        timeout = self._timeout if timeout is None else timeout
        with self._lock:
            if self._closed:
                raise self._closed_error("and takes no new requests")
            if self._held >= self._capacity:
                msg = (
                    f"the engine holds {self._held} requests, as many as its rows and queue take "
                    f"({self._capacity}); retry later, or make rows or queue_size larger"
                )
                raise QueueFullError(msg)
            self._held += 1
        request = Request(number=next(self._numbers), kwargs=kwargs, generator=generator, timeout=timeout)
        with self._lock:
            self._held_requests[request.number] = request
        # A cancelled request gives its place back at once, wherever it waits.
        request.future.add_done_callback(lambda done: self._release(request) if done.cancelled() else None)
        if request.deadline is not None:
            self._deadlines.watch(request.number, request.deadline)
        self._workers.submit(self._run, request)
        return request.future

    async def generate(
        self, *, generator: torch.Generator | None = None, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        """`submit` for asyncio: cancelling the awaiting task cancels the request."""
        return await asyncio.wrap_future(self.submit(generator=generator, timeout=timeout, **kwargs))

    def stream(
        self, *, generator: torch.Generator | None = None, timeout: float | None = None, **kwargs: Any
    ) -> AsyncGenerator[int, None]:
        """The request's new tokens (ints) for asyncio, each as its row produces it: `async for token in
        engine.stream(**kwargs)`. The stream raises what the request raises; closing it early (`aclose()`,
        `contextlib.aclosing`) cancels the request. Bad requests raise at once, as `submit` raises."""
        if "streamer" in kwargs:
            msg = "stream() brings its own streamer: pass streamer= to submit() or generate() instead"
            raise InvalidArgumentError(msg)
        check_submitted(self._model, kwargs, self._batch, streamed=True)  # before the first iteration runs
        return tokens_as_they_come(functools.partial(self.submit, generator=generator, timeout=timeout), **kwargs)

    def warm_up(self, **example: Any) -> None:
        """Compile (on CUDA, capture) what requests like `example` (what `submit` takes) will need, before they
        come: copies of it alone and in groups, as traffic reaches the engine (`warm_up`). Blocks until done."""
        warm_up(self.submit, self._gate, group_sizes=tuple(self._batch.joint.scratches), example=example)

    def stats(self) -> EngineStats:
        batch = self._batch
        with self._lock:
            return EngineStats(
                decoding=len(batch.seats), waiting=len(self._waiting), held=self._held,
                steps=batch.steps, slot=batch.slot, moves=batch.moves, joins=batch.joins,
                join_seconds=self._join_seconds,
                step_seconds=self._step_seconds,
                prefill_seconds=batch.prefill_seconds,
                collect_seconds=self._collect_seconds,
                programs=len(batch.programs),
                prefills=batch.prefills,
                encoder_calls=0 if self._encoders is None else self._encoders.calls,
                encoder_forwards=0 if self._encoders is None else self._encoders.forwards,
            )  # fmt: skip

    def close(self, *, wait: bool = True) -> None:
        """Take no new requests; requests already decoding finish, the others fail with `EngineClosedError`."""
        with self._wake:
            self._closed = True
            waiting = list(self._waiting)
            self._waiting.clear()
            self._wake.notify_all()
        for joining in waiting:
            hand_back(joining, error=EngineClosedError("the engine was closed before the request got a row"))
        self._deadlines.close(wait=wait)
        # Without waiting, the request threads still end once their requests have (none is left idle).
        self._workers.shutdown(wait=wait)
        if wait:
            self._scheduler.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        stats, batch = self.stats(), self._batch
        return (f"Engine({type(self._model).__name__}, rows={len(batch.slots)}, max_length={batch.max_length}, "
                f"decoding={stats.decoding}, waiting={stats.waiting})")  # fmt: skip

    # -- a request's thread ---------------------------------------------------------------------------------

    def _release(self, request: Request) -> None:
        """Give the request's place back (once): before its future resolves, so that a caller who submits
        again as soon as it has its result finds the place free."""
        with self._lock:
            if request.released:
                return
            request.released = True
            self._held -= 1
            self._held_requests.pop(request.number, None)
        self._deadlines.forget(request.number)

    def _expire(self, number: int) -> None:
        """The request's deadline has passed: its place is given back and its future fails now; its thread
        stops at its next look (its row is freed at the next step boundary)."""
        with self._lock:
            request = self._held_requests.get(number)
        if request is None:
            return
        self._release(request)
        msg = f"the request was not served within its timeout of {request.timeout} s"
        resolve(request.future, error=RequestTimeoutError(msg))

    def _run(self, request: Request) -> None:
        if request.future.done():  # cancelled or expired while it waited for a thread
            self._release(request)
            return
        try:
            if self._closed:
                raise self._closed_error("before the request started")

            def method(model: PreTrainedModel, input_ids: torch.Tensor, **arguments: Any) -> torch.Tensor:
                return self._decode(request, model, input_ids, **arguments)

            kwargs = with_stop_string_criteria(request.kwargs, merged_config(self._model, request.kwargs))
            with self._encoders.gathering() if self._encoders is not None else contextlib.nullcontext():
                output = type(self._model).generate(self._model, **kwargs, custom_generate=method)
        except BaseException as error:
            self._release(request)
            resolve(request.future, error=error)
            return
        self._release(request)
        resolve(request.future, result=output)

    def _decode(
        self,
        request: Request,
        model: PreTrainedModel,
        input_ids: torch.Tensor,
        *,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        synced_gpus: bool = False,
        **model_kwargs: Any,
    ) -> torch.Tensor:
        """The decoding method of the request's `generate`: check and convert what it prepared, queue it for a
        row, wait for its tokens."""
        joining = prepared_joining(
            request, model, input_ids, batch=self._batch, processors=logits_processor, criteria=stopping_criteria,
            config=generation_config, model_kwargs=model_kwargs,
        )  # fmt: skip
        with self._wake:
            if self._closed:
                raise self._closed_error("before the request got a row")
            self._waiting.append(joining)
            self._wake.notify_all()
        return wait_for(joining, self._lock, self._waiting)

    # -- the scheduler thread -------------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            with torch.no_grad():
                while self._next_boundary():
                    pass
        except BaseException as error:  # the scheduler itself failed: nothing would serve the held requests
            logger.exception("cachelife.Engine: the scheduler failed; the engine closes")
            self._fail_engine(error)
        finally:  # no step runs after this one
            self._restore_model()

    def _restore_model(self) -> None:
        """Undo what the engine changed on its model: the attention switch, the row positions, the encoder's
        gathering."""
        while self._restores:
            self._restores.pop()()

    def _fail_engine(self, cause: BaseException) -> None:
        """Close the engine for `cause`: new submits are refused, and every request it holds fails with an
        `EngineClosedError` naming the cause (chained to it), wherever it waits."""
        with self._wake:
            self._closed, self._failure = True, cause
            abandoned = [*self._waiting, *(seat.joining for seat in self._batch.seats.values())]
            self._waiting.clear()
            held = list(self._held_requests.values())
        for joining in abandoned:
            hand_back(joining, error=self._closed_error(""))
        for request in held:  # places given back first, as always
            self._release(request)
            resolve(request.future, error=self._closed_error(""))
        self._deadlines.close(wait=False)
        self._workers.shutdown(wait=False)

    def _closed_error(self, when: str) -> EngineClosedError:
        """The error of a request the closed engine cannot serve, naming the scheduler's failure if any."""
        cause = self._failure
        if cause is None:
            return EngineClosedError(f"the engine was closed {when}")
        error = EngineClosedError(f"the engine's scheduler failed ({type(cause).__name__}: {cause}); it is closed")
        error.__cause__ = cause
        return error

    def _next_boundary(self) -> bool:
        """Admit newcomers, run one call of the step, hand back what ended; False once closed and drained."""
        batch = self._batch
        with self._wake:
            while not (self._waiting and self._gate.open) and not batch.seats and not self._closed:
                self._wake.wait()
            admitting = self._gate.open
            if self._closed and not batch.seats:
                return False
        try:
            started = time.perf_counter()
            if admitting:
                self._admit()
            admitted = time.perf_counter()
            batch.advance()
            advanced = time.perf_counter()
            batch.collect()
            collected = time.perf_counter()
            self._join_seconds += admitted - started
            self._step_seconds += collected - admitted
            self._collect_seconds += collected - advanced
        except Exception as error:  # a step's failure is every decoding row's
            logger.exception("cachelife.Engine: a step failed; its %d rows fail with it", len(batch.seats))
            batch.fail_all(error)
        return True

    def _admit(self) -> None:
        """Newcomers join as `admission.plan` says: in submission order, each while it fits. A join that fails
        fails its request alone but leaves the batch otherwise than planned: the plan is drawn again."""
        while True:
            with self._lock:
                for joining in [joining for joining in self._waiting if joining.abandoned]:
                    self._waiting.remove(joining)
                by_number = {joining.request.number: joining for joining in self._waiting}
                admissions = plan([candidate(joining) for joining in self._waiting], self._batch.view())
                chosen = [(by_number[admission.number], admission) for admission in admissions]
                for joining, _ in chosen:
                    self._waiting.remove(joining)
            if not chosen or self._join_all(chosen):
                return

    def _join_all(self, chosen: list[tuple[Joining, Admission]]) -> bool:
        """Join each as planned, neighbours that the joint prefill takes prefilled together (one it takes alone as
        a group of one); False at the first
        join that failed, the ones after it back in the queue."""
        joined = 0
        try:
            for group in joint_groups([joining for joining, _ in chosen], self._batch.joint):
                joint = self._batch.joint.takes(group[0])
                prefilled = self._batch.prefill_jointly(group) if joint else None
                owns: list[Prefilled | None] = [*prefilled] if prefilled else [None] * len(group)
                for own in owns:
                    joining, admission = chosen[joined]
                    joins = self._batch.joins
                    self._batch.join(joining, admission.first, admission.placement, own)
                    if self._batch.joins == joins:
                        return False
                    joined += 1
        finally:
            with self._lock:
                self._waiting.extend(joining for joining, _ in chosen[joined + 1 :])
        return True
