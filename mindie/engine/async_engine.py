"""The engine for an asyncio server: `add_request` returns an async stream of outputs.

The engine loop runs in its own thread. A model step spends nearly all its time in torch and in
`mindie._C`, both of which release the GIL, so the event loop keeps serving HTTP while a step runs;
a separate process would add a copy of every output across a pipe for no gain at this size. The
engine itself is touched only by its thread: typed commands (mindie/engine/commands.py) reach it
through one inbox, outputs come back through `loop.call_soon_threadsafe` into one queue per
request, and its state goes out as an immutable `EngineStats` snapshot replaced after each step.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable

from mindie.engine.commands import (
    AbortRequest,
    AddRequest,
    DropReserved,
    EngineCommand,
    OutputSink,
    ReleaseKV,
    ReserveKV,
    ResumeRequest,
)
from mindie.engine.engine import LLMEngine
from mindie.engine.request import EngineRequest, RequestOutput
from mindie.engine.stats import EngineStats


class AsyncEngine:
    def __init__(self, engine: LLMEngine, queue_delay_s: float = 0.005) -> None:
        """`queue_delay_s` (MindIE's maxQueueDelayMicroseconds): when requests arrive at an idle
        engine, how long it waits for more before the first step, so that a burst of clients is
        prefilled in one batch rather than one step per arrival."""
        self.engine = engine
        self.queue_delay_s = queue_delay_s
        self._inbox: deque[EngineCommand] = deque()
        self._sinks: dict[str, OutputSink] = {}  # request id -> where its outputs go
        self._wake = threading.Condition()
        self._stopped = False
        self.last_error: BaseException | None = None  # of the last step, cleared by a good one
        # Replaced, never mutated, by the engine thread: a reader on another thread gets one whole
        # snapshot by reading the attribute once.
        self.stats: EngineStats = engine.stats()
        self._thread = threading.Thread(target=self._run, name="mindie-engine", daemon=True)
        self._thread.start()

    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Queues the request (raising ValueError if the engine refuses it) and returns its
        outputs as they are produced (one per sample and step, tagged with the sample's index);
        the last one has `request_done` set. Closing the stream early (a client that went away)
        aborts the request."""
        loop = asyncio.get_running_loop()
        sink = OutputSink(loop, asyncio.Queue(), loop.create_future())
        self.submit(AddRequest(request, sink))
        return await self._accepted(request.request_id, sink)

    def abort(self, request_id: str) -> None:
        self.submit(AbortRequest(request_id))

    async def reserve_kv(self, request_id: str, token_ids: list[int], num_tokens: int) -> list[int] | None:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[list[int] | None] = loop.create_future()
        self.submit(ReserveKV(request_id, token_ids, num_tokens, loop, reply))
        return await reply

    async def resume_request(self, request: EngineRequest, num_cached_prompt_tokens: int) -> RequestStream:
        """`add_request` for a request P handed off, into the blocks `reserve_kv` gave it."""
        loop = asyncio.get_running_loop()
        sink = OutputSink(loop, asyncio.Queue(), loop.create_future())
        self.submit(ResumeRequest(request, num_cached_prompt_tokens, sink))
        return await self._accepted(request.request_id, sink)

    async def _accepted(self, request_id: str, sink: OutputSink) -> RequestStream:
        """The request's outputs once the engine has taken it. A caller cancelled while it waits
        (its client went away during a step) aborts it there and then: the abort follows the
        request in the inbox, so both are applied before the next step and no step runs it.
        Waiting for the acceptance first would let that step run every such request of a burst."""
        try:
            await sink.accepted
        except asyncio.CancelledError:
            with contextlib.suppress(RuntimeError):  # shut down: nothing runs any more
                self.abort(request_id)
            raise
        return RequestStream(self, request_id, sink.queue)

    def submit(self, command: EngineCommand) -> None:
        """Queues a command for the engine thread, which applies it before its next step; raises
        RuntimeError once the engine has shut down. Safe from any thread."""
        with self._wake:
            if self._stopped:
                raise RuntimeError("the engine has shut down")
            self._inbox.append(command)
            self._wake.notify()

    @property
    def healthy(self) -> bool:
        """The loop runs and its last step with work did not fail."""
        return self._thread.is_alive() and self.last_error is None

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join()

    # --- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self._inbox and not self.engine.has_unfinished():
                    self._wake.wait()
                if self._stopped:  # what is queued still runs (a late abort frees its blocks), no step does
                    leftover = list(self._inbox)
                    self._inbox.clear()
                    break
                if not self.engine.has_unfinished() and self.queue_delay_s > 0:
                    self._wake.wait_for(lambda: self._stopped, timeout=self.queue_delay_s)
                commands = list(self._inbox)
                self._inbox.clear()
            outputs = [out for command in commands for out in self._apply(command)]
            try:
                stepped = self.engine.step() if self.engine.has_unfinished() else []
            except Exception as exc:  # a failed step fails its requests, never the thread
                self.last_error = exc
                self._publish(outputs)
                self._fail_all(exc)
                continue
            if stepped:
                self.last_error = None
            self._publish(outputs + stepped)
        self._publish([out for command in leftover for out in self._apply(command)])
        self._fail_all(RuntimeError("the engine has shut down"))

    def _apply(self, command: EngineCommand) -> list[RequestOutput]:
        """Runs one command on the engine; returns the outputs it produced (an abort's last ones)."""
        if isinstance(command, AbortRequest):
            return self.engine.abort(command.request_id)
        if isinstance(command, ReleaseKV):
            self.engine.handoff.release_kv(command.lease_id)
            return []
        if isinstance(command, DropReserved):
            self.engine.handoff.drop_reserved(command.request_id)
            return []
        if isinstance(command, ReserveKV):
            try:
                blocks: list[int] | None | BaseException = self.engine.handoff.reserve_kv(
                    command.request_id, command.token_ids, command.num_tokens)
            except ValueError as exc:
                blocks = exc
            _notify(command.loop, _answer, command.reply, blocks)
            return []
        sink = command.sink
        try:
            if isinstance(command, ResumeRequest):
                self.engine.handoff.resume(command.request, command.num_cached_prompt_tokens)
            else:
                self.engine.add_request(command.request)
        except Exception as exc:
            _notify(sink.loop, _settle, sink.accepted, exc)
            return []
        self._sinks[command.request.request_id] = sink
        if not _notify(sink.loop, _settle, sink.accepted, None):
            del self._sinks[command.request.request_id]
            self.engine.abort(command.request.request_id)
        return []

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """The new stats first, then the outputs: a client that has seen its request end finds it
        gone from the stats too."""
        self.stats = self.engine.stats()
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hands a step's outputs to their queues with one wake-up per event loop, not one per
        output: at 32 streams that is one self-pipe write per step instead of 32."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.request_done:
                del self._sinks[out.request_id]
            batches.setdefault(sink.loop, []).append((sink.queue, out))
        for loop, batch in batches.items():
            if not _notify(loop, _put_all, batch):
                # The loop its caller waited on has closed: nobody reads these requests any more.
                for request_id in [rid for rid, sink in self._sinks.items() if sink.loop is loop]:
                    del self._sinks[request_id]
                    self.engine.abort(request_id)

    def _fail_all(self, exc: BaseException) -> None:
        failure = exc if isinstance(exc, RuntimeError) else RuntimeError(f"engine step failed: {exc!r}")
        for request_id, sink in list(self._sinks.items()):
            self.engine.abort(request_id)
            _notify(sink.loop, sink.queue.put_nowait, failure)
        self._sinks.clear()
        self.stats = self.engine.stats()


class RequestStream:
    """One request's outputs as the engine thread hands them over. Leaving early, by aclose() or
    by being cancelled while waiting for an output, aborts the request, whether or not any output
    was read yet (an async generator never started would run no cleanup at all)."""

    def __init__(self, engine: AsyncEngine, request_id: str,
                 queue: asyncio.Queue[RequestOutput | BaseException]) -> None:
        self._engine = engine
        self._request_id = request_id
        self._queue = queue
        self._finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        if isinstance(item, BaseException):  # the engine failed the request, which is gone already
            self._finished = True
            raise item
        self._finished = item.request_done
        return item

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            with contextlib.suppress(RuntimeError):  # shut down: nothing runs any more
                self._engine.abort(self._request_id)


def _notify(loop: asyncio.AbstractEventLoop, callback: Callable[..., object], *args: object) -> bool:
    """Schedules callback(*args) on loop from the engine thread; False when the loop has closed (its
    caller is gone), which must not end the engine thread."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        return False
    return True


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in batch:
        queue.put_nowait(out)


def _answer(future: asyncio.Future[list[int] | None], value: list[int] | None | BaseException) -> None:
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
