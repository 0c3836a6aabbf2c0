"""The engine loop under asyncio: front doors submit requests and read per-request streams
while the blocking steps run in a worker thread, one at a time."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator

import structlog

from pagedserve.sampling_params import SamplingParams
from scheduler_svc.engine import LLMEngine, StepOutcome
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.persistence import params_from_dict, params_to_dict
from scheduler_svc.streams import RequestDelta

log = structlog.get_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; requests in flight cannot complete in this process."""


class RequestInFlightError(ValueError):
    """Another client is already streaming this request id."""


class AsyncEngine:
    """Feeds an LLMEngine from many coroutines and fans its steps out to request streams.

    Adds and aborts are queued and applied by the engine thread between steps, so the
    scheduler is only ever touched by one thread. With a journal, a request is written to
    the store before it is accepted, and a client that comes back with the same request id
    (after a restart, or a dropped connection) resumes from the events it already got.
    """

    def __init__(self, engine: LLMEngine, metrics: SchedulerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.store = engine.journal.store if engine.journal is not None else None
        self._lock = threading.Lock()
        self._incoming: list[tuple[str, list[int], SamplingParams, float]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, asyncio.Queue[RequestDelta | BaseException]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Recover what the store holds (replaying a step in flight), then start the loop."""
        self._loop = asyncio.get_running_loop()
        if self.store is not None:
            await asyncio.to_thread(self.engine.recover)
            await asyncio.to_thread(self.engine.flush)  # the replayed step's results
            for request_id, record in self.store.pending_requests():
                data = json.loads(record)
                params = params_from_dict(data["params"])
                self._incoming.append((request_id, data["prompt"], params, data["arrival"]))
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def executor_unavailable_for(self) -> float:
        """Seconds the executor has been unreachable (0 when it answers, or in process)."""
        away = getattr(self.engine.executor, "unavailable_for", None)
        return away() if away is not None else 0.0

    def check(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise RequestRejectedError now for a request that could never run."""
        self.engine.scheduler.check_fits(prompt_len, params)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        after_event: int = 0,
    ) -> AsyncIterator[RequestDelta]:
        """Submit a request (or re-attach to it) and yield its events after ``after_event``.

        Closing the iterator early (the client went away) aborts the request.
        """
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        if request_id in self._streams:
            raise RequestInFlightError(f"request id {request_id!r} is already being streamed")
        queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        arrival = self._loop.time()
        finished, last = False, after_event
        try:
            if self._submit(request_id, prompt_token_ids, params, arrival):
                with self._lock:
                    self._incoming.append((request_id, prompt_token_ids, params, arrival))
                self._wake.set()
            else:  # known: replay what was already produced, then follow live
                for index, text in self.store.read_events(request_id, after_event):
                    delta = RequestDelta.from_json(text)
                    finished, last = delta.finished, index
                    yield delta
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.event <= last:
                    continue
                finished, last = item.finished, item.event
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def _submit(
        self, request_id: str, prompt: list[int], params: SamplingParams, arrival: float
    ) -> bool:
        """Record the request before accepting it; False when the id is already known."""
        if self.store is None:
            return True
        record = {"prompt": prompt, "params": params_to_dict(params), "arrival": arrival}
        return self.store.submit_request(request_id, json.dumps(record))

    def abort(self, request_id: str) -> bool:
        """Stop a request within one step; its stream, if any, ends with finish reason
        "abort". Returns whether a client was following it here."""
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()
        return request_id in self._streams

    async def _run(self) -> None:
        try:
            while True:
                if not self._has_work():
                    await self._wake.wait()
                self._wake.clear()
                outcome = await asyncio.to_thread(self._step)
                if not self._has_work():
                    await asyncio.to_thread(self.engine.flush)
                for delta in outcome.deltas:
                    queue = self._streams.get(delta.request_id)
                    if queue is not None:
                        queue.put_nowait(delta)
                if self.metrics is not None:
                    self.metrics.update(self.engine)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the loop is dead: fail every stream instead of hanging it
            log.exception("engine loop failed")
            for queue in self._streams.values():
                queue.put_nowait(EngineDeadError(f"engine failed: {e}"))
            raise

    def _has_work(self) -> bool:
        with self._lock:
            pending = bool(self._incoming or self._aborts)
        return pending or self.engine.has_unfinished()

    def _step(self) -> StepOutcome:
        """Engine thread: apply queued adds and aborts, then one step."""
        with self._lock:
            incoming, self._incoming = self._incoming, []
            aborts, self._aborts = self._aborts, []
        for request_id, prompt, params, arrival in incoming:
            self.engine.add_request(request_id, prompt, params, arrival)
        ended = []
        for request_id in aborts:
            group = self.engine.abort(request_id)
            if group is not None:
                log.info("request aborted", request_id=request_id)
                ended.append(self.engine.streams.delta(group, {}, finished=True))
        outcome = self.engine.step() if self.engine.has_unfinished() else StepOutcome()
        outcome.deltas[:0] = [d for d in ended if d is not None]
        return outcome
