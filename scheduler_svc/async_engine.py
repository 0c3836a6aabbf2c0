"""The engine loop under asyncio: front doors submit requests and read per-request streams
while the blocking steps run in a worker thread, one at a time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from pagedserve.sampling_params import SamplingParams
from scheduler_svc.engine import LLMEngine, StepOutcome
from scheduler_svc.metrics import SchedulerMetrics
from scheduler_svc.sequence import SequenceGroup

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class SeqDelta:
    """What one output (``index``) gained since the last delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None = None


@dataclass(slots=True)
class RequestDelta:
    request_id: str
    prompt_len: int
    outputs: list[SeqDelta] = field(default_factory=list)
    finished: bool = False


class EngineDeadError(RuntimeError):
    """The engine loop stopped; requests in flight cannot complete in this process."""


class AsyncEngine:
    """Feeds an LLMEngine from many coroutines and fans its steps out to request streams.

    Adds and aborts are queued and applied by the engine thread between steps, so the
    scheduler is only ever touched by one thread.
    """

    def __init__(self, engine: LLMEngine, metrics: SchedulerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._lock = threading.Lock()
        self._incoming: list[tuple[str, list[int], SamplingParams, float]] = []
        self._aborts: list[str] = []
        self._streams: dict[str, asyncio.Queue[RequestDelta | BaseException]] = {}
        self._sent: dict[int, tuple[int, bool]] = {}  # seq_id -> (tokens streamed, finish sent)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def check(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise RequestRejectedError now for a request that could never run."""
        self.engine.scheduler.check_fits(prompt_len, params)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestDelta]:
        """Submit a request and yield its deltas; closing the iterator early aborts it."""
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in flight")
        self.check(len(prompt_token_ids), params)
        queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        with self._lock:
            self._incoming.append((request_id, prompt_token_ids, params, self._loop.time()))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    async def _run(self) -> None:
        try:
            while True:
                if not self._has_work():
                    await self._wake.wait()
                self._wake.clear()
                outcome = await asyncio.to_thread(self._step)
                self._publish(outcome)
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
        for request_id in aborts:
            group = self.engine.abort(request_id)
            if group is not None:
                log.info("request aborted", request_id=request_id)
        if not self.engine.has_unfinished():
            return StepOutcome()
        return self.engine.step()

    def _publish(self, outcome: StepOutcome) -> None:
        finished = {id(g) for g in outcome.finished}
        for group in outcome.groups + [g for g in outcome.finished if g not in outcome.groups]:
            queue = self._streams.get(group.request_id)
            delta = self._delta(group, outcome, id(group) in finished)
            for seq in group.seqs:
                if id(group) in finished:
                    self._sent.pop(seq.seq_id, None)
            if queue is not None and (delta.outputs or delta.finished):
                queue.put_nowait(delta)

    def _delta(self, group: SequenceGroup, outcome: StepOutcome, finished: bool) -> RequestDelta:
        delta = RequestDelta(group.request_id, group.prompt_len, finished=finished)
        params = group.sampling_params
        if params.use_beam_search or params.width > params.n:
            if finished:  # only the final ranking is meaningful
                delta.outputs = [
                    SeqDelta(
                        i,
                        s.output_text,
                        list(s.output_token_ids),
                        list(s.output_logprobs),
                        list(s.output_top_logprobs),
                        s.status.finish_reason,
                    )
                    for i, s in enumerate(group.outputs())
                ]
            return delta
        for index, seq in enumerate(group.seqs):
            sent, finish_sent = self._sent.get(seq.seq_id, (0, False))
            ends_now = seq.status.is_finished and not finish_sent
            if sent == len(seq.output_token_ids) and not ends_now:
                continue
            self._sent[seq.seq_id] = (len(seq.output_token_ids), seq.status.is_finished)
            delta.outputs.append(
                SeqDelta(
                    index,
                    outcome.text_deltas.get(seq.seq_id, ""),
                    seq.output_token_ids[sent:],
                    seq.output_logprobs[sent:],
                    seq.output_top_logprobs[sent:],
                    seq.status.finish_reason,
                )
            )
        return delta
