"""The engine loop of one process: schedule, execute, apply outputs, repeat."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import structlog

from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import CacheConfig, PreemptionMode, SchedulerConfig
from pagedserve.step import ExecuteStep, ExecutorRestarted, SeqOutput, SeqStep, StepResult
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.output_processor import OutputProcessor, num_samples
from scheduler_svc.core.scheduler import ScheduledGroup, Scheduler, SchedulerOutput
from scheduler_svc.core.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_svc.engine.detokenizer import Detokenizer, find_stop
from scheduler_svc.engine.executor_client import ExecutorError, StepRefused
from scheduler_svc.engine.reconnect import ExecutorGone
from scheduler_svc.state.journal import Journal, restore_groups
from scheduler_svc.state.persistence import PendingStep, RestoredGroup, step_from_json, step_to_json
from scheduler_svc.state.state_store import StoredState
from scheduler_svc.state.streams import RequestDelta, StreamTracker

log = structlog.get_logger(__name__)
CALL_TIMES_WEIGHT = 0.1  # of the newest call in the running means of its times (about ten calls)
# A third call goes on the wire (two ahead of the one whose answer is read) while the
# engine's own time per call is at least this share of its wait for an answer: with an
# accelerator's few-millisecond steps the path from one answer to the call after next on
# the wire is about a step long, and one more step then hides it (docs/architecture.md,
# "Async scheduling"). A CPU's long steps keep two, so a newcomer waits no longer.
DEEP_AHEAD_SHARE = 0.5


class IdCounter:
    """A counter whose next value can be read and reset (ids survive a restart); safe to
    share between the engines of several executors, each stepped by its own thread."""

    def __init__(self, start: int = 0) -> None:
        self.value = start
        self._lock = threading.Lock()

    def __iter__(self) -> IdCounter:
        return self

    def __next__(self) -> int:
        with self._lock:
            self.value += 1
            return self.value - 1

    def advance_to(self, value: int) -> None:
        """Never hand out an id below ``value`` (ids restored from the store)."""
        with self._lock:
            self.value = max(self.value, value)


@dataclass(slots=True)
class EngineStats:
    """Counters since start, read by metrics and benchmarks."""

    num_steps: int = 0
    num_mixed_steps: int = 0  # steps holding prefill and decode sequences together
    num_prompt_tokens: int = 0  # prompt tokens computed (cached ones excluded)
    num_prompt_chunks: int = 0  # prompt chunks short of their prompt's end (chunked prefill)
    num_steps_ahead: int = 0  # calls sent before the answer of the one before (async)
    preemptions: dict[str, int] = field(default_factory=dict)  # by mode
    execute_seconds: float = 0.0  # sending each step to its answer (with a journal: its commit)
    num_quarantined: int = 0  # stored requests recovery had to drop


@dataclass(slots=True)
class StepOutcome:
    """What one step changed: the groups it ran and those that ended (done or refused)."""

    groups: list[SequenceGroup] = field(default_factory=list)
    finished: list[SequenceGroup] = field(default_factory=list)
    # The step's stream events; a call that shares a later commit makes none, and that
    # commit's step makes one a request for all the calls it covers (LLMEngine._untold).
    deltas: list[RequestDelta] = field(default_factory=list)
    preempted: list[tuple[SequenceGroup, PreemptionMode]] = field(default_factory=list)
    # The commit that holds ``deltas``, still on its way to the store or still to be made
    # (Journal.next_landing): publish them once it has landed, so that no client sees an
    # event a restart would not find, nor one it would make again in other bounds (a call
    # run past the journal is recomputed, its tokens one event a call). None: landed.
    durable: Future[None] | None = None


@dataclass(slots=True)
class _Call:
    """A step sent to the executor whose answer is not applied yet."""

    out: SchedulerOutput
    step: ExecuteStep
    wait: Callable[[], StepResult]
    in_a_row: bool = field(init=False)  # decodes several steps in a row (end_steps)

    def __post_init__(self) -> None:
        self.in_a_row = any(s.num_steps > 1 for s in self.step.seqs)


class StepExecutor(Protocol):
    """Anything that runs a step: the in-process executor or the gRPC client."""

    def execute(self, step: ExecuteStep) -> StepResult: ...

    def end_steps(self, step_id: int) -> None:
        """Ask step ``step_id`` to stop its decode steps in a row after the current one."""


@runtime_checkable
class PipelinedExecutor(StepExecutor, Protocol):
    """An executor that takes a step while the engine journals it, and fences a new
    leader's predecessor off (docs/architecture.md, "Journaling while the executor
    computes"): the gRPC client. Others get the step only once it is journaled."""

    def start(self, step: ExecuteStep) -> Callable[[], StepResult]:
        """Send ``step``; calling the result waits for its answer."""

    def fence(self, epoch: int) -> int | None:
        """Refuse steps of older epochs from now on; the last applied step id, if any."""


class LLMEngine:
    """Owns the scheduler and drives an executor one step at a time."""

    def __init__(
        self,
        executor: StepExecutor,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        eos_token_id: int | None,
        detokenizer: Detokenizer | None = None,
        journal: Journal | None = None,
        executor_instance: str = "",
        seq_ids: IdCounter | None = None,
    ) -> None:
        """Args:
        seq_ids: the sequence id counter, shared by the engines of one leader's executors
            so that a group keeps its ids when it moves to another executor.
        """
        self.executor = executor
        self.detokenizer = detokenizer
        self.journal = journal
        self.executor_instance = executor_instance
        self.scheduler = Scheduler(scheduler_config, BlockManager.from_config(cache_config))
        self.seq_ids = seq_ids if seq_ids is not None else IdCounter()
        self.processor = OutputProcessor(self.scheduler, eos_token_id, self.seq_ids)
        self._step_ids = IdCounter()
        self._steps_in_a_row: int | None = None  # the newest call in flight running several
        # Async scheduling: the call sent while the one before it runs (see step).
        self.async_scheduling = scheduler_config.async_scheduling and isinstance(
            executor, PipelinedExecutor
        )
        # Calls sent ahead of the one whose answer ``step`` reads, oldest first: the next
        # one, and the one after it, sent once the call before was applied unless a
        # request arrived during the step (``_arrived``, set from other threads).
        self._ahead: deque[_Call] = deque()
        self._arrived = False
        # Running means of the engine's own time per call and of its wait for an answer
        # (see _ahead_pays), and when the last answer came while work went on.
        self._own_s = self._wait_s = 0.0
        self._answered_at: float | None = None
        self._applied_at: float | None = None  # the last call applied, while groups ran
        self.epoch = 0
        self.stats = EngineStats()
        self.streams = StreamTracker()
        # Groups that calls sharing a later commit ran: their text and events wait for it.
        self._untold: dict[str, SequenceGroup] = {}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> SequenceGroup:
        """Queue a request. Raises RequestRejectedError when it can never run, ValueError
        when it cannot be journaled."""
        seq = Sequence(next(self.seq_ids), list(prompt_token_ids))
        arrival = time.time() if arrival_time is None else arrival_time  # wall clock
        group = SequenceGroup(request_id, [seq], arrival, params)
        if self.journal is not None:
            self.journal.check_storable(group)
        self.scheduler.add_seq_group(group)
        if self.journal is not None:
            self.journal.touch(group)
            self.journal.consumed(request_id)
        return group

    def drop(
        self,
        request_id: str,
        prompt_len: int,
        error: str,
        num_events: int = 0,
        source: str | None = None,
    ) -> RequestDelta:
        """End a request that could not enter this engine: its error event is journaled and
        its submission (or its copy in the store lane ``source`` it moved from) goes."""
        delta = self.streams.failed(request_id, prompt_len, error, num_events)
        if self.journal is not None:
            self.journal.consumed(request_id)
            if source is not None:
                self.journal.take_over(request_id, source)
            self.journal.remove(request_id)
            self.journal.defer([delta])
        return delta

    def expire(self, now: float) -> tuple[list[SequenceGroup], list[RequestDelta]]:
        """End the groups whose ``timeout`` has passed since arrival (wall clock): aborted,
        their blocks freed, each stream ended by a ``deadline_exceeded`` error event."""
        sched = self.scheduler
        late = [
            g
            for g in [*sched.waiting, *sched.running, *sched.swapped]
            if g.sampling_params.timeout is not None
            and now > g.arrival_time + g.sampling_params.timeout
        ]
        told = self.catch_up([g.request_id for g in late])  # what they drew, before the end
        deltas = []
        for group in late:
            self.abort(group.request_id)
            timeout = group.sampling_params.timeout
            deltas.append(
                self.streams.failed(
                    group.request_id,
                    group.prompt_len,
                    f"the request's timeout of {timeout:g} s passed before it finished",
                    self.streams.forget(group),
                    code="deadline_exceeded",
                )
            )
        if self.journal is not None:
            self.journal.defer(deltas)
        return late, told + deltas

    def abort(self, request_id: str) -> SequenceGroup | None:
        group = self.scheduler.abort(request_id)
        if group is None:
            return None
        if self._untold.pop(request_id, None) is not None and self.detokenizer is not None:
            self._detokenize([group])  # its last event carries its text
        if self.journal is not None:
            self.journal.remove(request_id)
        return group

    def has_unfinished(self) -> bool:
        """Groups to run, or a call sent ahead whose answer is still to be read."""
        return self.scheduler.has_unfinished() or bool(self._ahead)

    def evacuate(self) -> tuple[list[RequestDelta], list[tuple[SequenceGroup, int]]]:
        """Take every unfinished group off this executor, reset to be recomputed elsewhere.
        Returns the events made for them here last, to publish, and the groups with the
        number of stream events each has emitted so far.

        The groups stay in this engine's journal until the caller drops its lane, so a
        crash while they move loses none of them.
        """
        self._ahead.clear()  # redone where they go
        self._applied_at = None
        told = self.catch_up()
        self.scheduler.recompute_all()
        moved, self.scheduler.waiting = self.scheduler.waiting, []
        self.flush()  # the last step's events, before another engine continues the stream
        return told, [(group, self.streams.forget(group)) for group in moved]

    def attach(self, group: SequenceGroup, num_events: int, source: str) -> None:
        """Continue a group evacuated from another executor (it waits to be recomputed).

        Args:
            source: the store lane the group leaves; the commit that writes it here
                deletes it there, so no store ever holds it twice.
        """
        self.scheduler.add_seq_group(group)
        self.streams.restore(group, num_events)
        if self.journal is not None:
            self.journal.touch(group)
            self.journal.take_over(group.request_id, source)

    def step(self) -> StepOutcome:
        """Run one step: schedule, persist, execute, append tokens, detokenize, persist.

        With async scheduling the next call is decided and sent before this one's answer
        is read, so that the executor finds it waiting when it finishes, and applying this
        answer and journaling it overlap the next call (docs/architecture.md, "Async
        scheduling"). Each call is then answered on the next ``step``.
        """
        journal = self.journal
        if journal is not None:
            journal.crash_if_asked("before_persist")
        start = time.perf_counter()
        self._arrived = False  # the lane added what came before the step
        call = self._ahead.popleft() if self._ahead else None
        if call is None:
            out = self.scheduler.schedule()
            if out.is_empty:
                self._answered_at = None  # idle until work comes
                return self._apply(out, None, None)
            call = self._send(out)
        try:
            if self.async_scheduling and self._ahead_pays():
                while len(self._ahead) < self._max_on_wire() - 1:
                    ahead = self._send_ahead([call, *self._ahead])
                    if ahead is None:
                        break
                    self._ahead.append(ahead)
            self._steps_in_a_row = self._newest_in_a_row(call)
            result = self._timed_wait(call)
        except ExecutorRestarted as e:
            self._ahead.clear()
            self._applied_at = None
            return self._recompute_all(e.instance_id)
        except BaseException:
            self._ahead.clear()  # their answers, if any, follow a call that failed
            raise
        finally:
            self._steps_in_a_row = self._newest_in_a_row()
        self.stats.execute_seconds += time.perf_counter() - start
        if journal is not None:
            journal.crash_if_asked("after_execute")
        outcome = self._apply_tokens(call.out, call.step, result)
        self._time_tokens(call.step, result)
        if not self.has_unfinished():
            self._answered_at = None
        self._send_early()
        if not self._ahead or journal is None:
            self._apply_text(outcome)
            return outcome
        due, told = self._commit_due(outcome)
        if not due:
            self._untold.update((group.request_id, group) for group in outcome.groups)
            return outcome
        self._apply_text(outcome, told)
        # The state after this call, while the next one runs; the next is not pending
        # (a new leader finds the executor past this commit and recomputes). The round
        # trip to the store overlaps the next call's scheduling too.
        meta = self._meta(call.step.step_id)
        outcome.durable = journal.commit(self.scheduler, meta, wait=False, groups=told)
        journal.crash_if_asked("after_persist", settle=journal.settle)
        return outcome

    def _send_early(self) -> None:
        """Send the call after the newest in flight now that the call before them is
        applied, rather than at the start of the next step: the executor then finds it waiting
        although the engine's loop, the commit below and the lane's next turn come in
        between. Not when a request arrived during the step: sent at the start of the
        next step, that call admits it, one call sooner."""
        if not self._ahead or not self.async_scheduling or self._arrived:
            return
        if len(self._ahead) >= self._max_on_wire() or not self._ahead_pays():
            return
        try:
            if (early := self._send_ahead(list(self._ahead))) is not None:
                self._ahead.append(early)
        except ExecutorGone:
            return  # the next step meets it, and the lane retires with this outcome out
        finally:
            self._steps_in_a_row = self._newest_in_a_row()

    def _ahead_pays(self) -> bool:
        """Whether to send the next call ahead: always while no request arrived for
        ``decode_steps_quiet_s``, else while the engine's own time per call is at least
        ``ahead_min_share`` of its wait for the answer (an accelerator's short steps). Where
        steps are long (a CPU's) the overlap gains little, and a request that arrives waits
        for the call sent ahead of it too (docs/architecture.md, "Async scheduling")."""
        share = self.scheduler.config.ahead_min_share
        if not share or self.scheduler.is_quiet():
            return True
        return self._own_s >= share * self._wait_s

    def _max_on_wire(self) -> int:
        """The most calls on the wire once an answer is applied: two, or three while the
        engine's own time per call is at least ``DEEP_AHEAD_SHARE`` of its wait for an
        answer (before both are measured, two)."""
        deep = self._own_s > 0 and self._own_s >= DEEP_AHEAD_SHARE * self._wait_s
        return 3 if deep else 2

    def _timed_wait(self, call: _Call) -> StepResult:
        """``_wait``, timing it and the engine's own time since the answer before."""
        start = time.perf_counter()
        result = self._wait(call)
        end = time.perf_counter()
        if self._answered_at is not None:
            self._own_s += CALL_TIMES_WEIGHT * (start - self._answered_at - self._own_s)
            self._wait_s += CALL_TIMES_WEIGHT * (end - start - self._wait_s)
        self._answered_at = end
        return result

    def _commit_due(self, outcome: StepOutcome) -> tuple[bool, set[str] | None]:
        """Whether the call just applied, sent ahead of the next, is committed now, and the
        groups that commit tells (None: all). One that only continued streams waits for a
        later commit while the last began less than ``commit_interval_s`` ago: its groups'
        text and events are made with that commit (``_untold``), and a crash before it
        finds the executor past the journal, which recomputes (docs/architecture.md,
        "Async scheduling"). A first token or an end is committed at once, with only the
        groups it starts or ends: the others wait for the interval all the same. An event
        made between steps (an abort, a deadline), or a table that changed other than by
        taking free blocks since the last commit (``Journal.can_write_some``), commits
        all."""
        journal = self.journal
        interval = self.scheduler.config.commit_interval_s
        if not interval or outcome.deltas or journal.has_events:
            return True, None
        if time.monotonic() - journal.committed_at >= interval:
            return True, None
        streams = self.streams
        told = {
            group.request_id
            for group in outcome.groups
            if not streams.has_events(group.request_id) and group.seqs[0].output_token_ids
        }
        if not told and not outcome.finished:
            return False, None
        if not journal.can_write_some(self.scheduler):
            return True, None
        return True, told | {group.request_id for group in outcome.finished}

    def _time_tokens(self, step: ExecuteStep, result: StepResult) -> None:
        """Tell the scheduler's pace how long the running streams waited per token since
        the call before this one was applied (nothing after an idle spell)."""
        now = time.perf_counter()
        if self._applied_at is not None:
            num_steps = max(_steps_run(step, result), 1)
            self.scheduler.pace.observe((now - self._applied_at) / num_steps)
        self._applied_at = now if self.scheduler.running else None

    def _send(self, out: SchedulerOutput) -> _Call:
        """Journal the step ``out`` decides and send it. A pipelined executor computes
        while the commit is written (a successor's ``recover`` fences it and finds a step
        run past the journal); any other executor gets the step once it is journaled, and
        has answered when this returns."""
        step = self._build_step(out)
        journal = self.journal
        if journal is not None:
            for group in [s.group for s in out.scheduled] + [g for g, _ in out.preempted]:
                journal.touch(group)
        pipelined = isinstance(self.executor, PipelinedExecutor)
        wait = self.executor.start(step) if pipelined else None
        if journal is not None:
            if wait is not None:
                journal.crash_if_asked("after_send", settle=wait)
            journal.commit(self.scheduler, self._meta(step.step_id), step_to_json(step))
            journal.crash_if_asked("after_persist")
        if wait is None:
            result = self.executor.execute(step)
            wait = lambda: result  # noqa: E731
        return _Call(out, step, wait)

    def _send_ahead(self, unapplied: list[_Call]) -> _Call | None:
        """Decide and send the call after the last of ``unapplied`` (the calls whose
        answers are not applied yet, oldest first) while they run; None when the next call
        depends on their outcome (Scheduler.schedule_ahead). Sequences the last one draws
        for go on from its last token, which the executor feeds in."""
        *before, call = unapplied
        drawn = {s.seq_id: s for s in call.step.seqs if s.num_samples == 1}
        drawing = {i: s.num_steps for i, s in drawn.items()}
        earlier: dict[int, int] = {}  # tokens the calls before ``call`` draw
        for older in before:
            for s in older.step.seqs:
                if s.num_samples == 1:
                    earlier[s.seq_id] = earlier.get(s.seq_id, 0) + s.num_steps
        for seq_id, num in earlier.items():
            drawing[seq_id] = drawing.get(seq_id, 0) + num
        out = self.scheduler.schedule_ahead(drawing, drawn.keys())
        if out is None:
            return None
        step = self._build_step(out, call.step.step_id, drawn, earlier)
        if self.journal is not None:
            for scheduled in out.scheduled:
                self.journal.touch(scheduled.group)
        wait = self.executor.start(step)
        self.stats.num_steps_ahead += 1
        if self.journal is not None:
            self.journal.crash_if_asked("after_send", settle=wait)
        return _Call(out, step, wait)

    def _wait(self, call: _Call) -> StepResult:
        """The answer of ``call``. A call sent ahead that the executor refused because it
        reached it before the call it follows (resent after the connection dropped) is
        sent again once that one is answered."""
        try:
            return call.wait()
        except StepRefused:
            if call.step.follows_step_id is None:
                raise
            log.warning("a call sent ahead was refused; sending it again", step=call.step.step_id)
            return self.executor.execute(call.step)

    def _newest_in_a_row(self, call: _Call | None = None) -> int | None:
        """The id of the newest call in flight that decodes several steps in a row."""
        for pending in (*reversed(self._ahead), call):
            if pending is not None and pending.in_a_row:
                return pending.step.step_id
        return None

    def end_steps(self) -> None:
        """A request arrived: have the calls in flight decoding several steps in a row stop
        after the step running, so the newcomer waits one decode step, not all of them,
        and send no call early in this step (``_send_early``).
        Called from other threads while ``step`` runs; a call that already answered is
        left be."""
        self._arrived = True
        step_id = self._steps_in_a_row
        if step_id is not None:
            self.executor.end_steps(step_id)

    def _recompute_all(self, instance_id: str) -> StepOutcome:
        """The executor came back empty: the step in flight is void, all groups restart."""
        self.executor_instance = instance_id
        told = self.catch_up()
        moved = self.scheduler.recompute_all()
        if self.journal is not None:
            for group in moved:
                self.journal.touch(group)
            self.journal.commit(self.scheduler, self._meta(self._step_ids.value - 1))
        return StepOutcome(deltas=told)

    def _apply(
        self, out: SchedulerOutput, step: ExecuteStep | None, result: StepResult | None
    ) -> StepOutcome:
        """Everything after Execute: tokens, forks, stops, text, events, commit 2."""
        outcome = self._apply_tokens(out, step, result)
        self._apply_text(outcome)
        return outcome

    def _apply_tokens(
        self, out: SchedulerOutput, step: ExecuteStep | None, result: StepResult | None
    ) -> StepOutcome:
        """What the next call's decision needs: tokens, forks, stops, blocks. Only groups
        with stop strings have their text decoded here (a completed one ends a sequence)."""
        outcome = StepOutcome(finished=list(out.ignored), preempted=list(out.preempted))
        # Ended while the call ran (aborted, expired, or stopped by the call before a
        # call sent ahead): what was drawn for them is dropped.
        out.scheduled = [s for s in out.scheduled if not s.group.is_finished()]
        if step is not None and result is not None:
            refused = self._end_refused(out, result)
            self._count(out, step)
            outcome.groups = [s.group for s in out.scheduled]
            if self.processor.can_process_run(out):
                by_seq = {o.seq_id: o for o in result.outputs}
                outcome.finished += self.processor.process_run(out, by_seq)
            else:
                stops = [g for g in outcome.groups if g.sampling_params.stop]
                for samples in _one_step_at_a_time(step, result):
                    outcome.finished += self.processor.process(out, samples)
                    if self.detokenizer is not None and stops:  # may end a run mid-way
                        outcome.finished += self._detokenize(stops)
            if self.detokenizer is not None:  # a run's tokens decoded at once
                stops = [g for g in outcome.groups if g.sampling_params.stop]
                outcome.finished += self._detokenize(stops)
            # Slots mapped ahead that no call in flight will use (ended early, or the call
            # sent ahead left the sequence out) go back.
            ahead = {s.seq_id for pending in self._ahead for s in pending.step.seqs}
            for group in outcome.groups:
                for seq in group.get_seqs(SequenceStatus.RUNNING):
                    if seq.seq_id not in ahead:
                        self.scheduler.block_manager.unmap_ahead(seq)
            outcome.deltas += refused
        return outcome

    def _apply_text(self, outcome: StepOutcome, told: set[str] | None = None) -> None:
        """The text of the groups without stop strings, the events, the journal's share:
        of the groups the call ran, and of those calls that shared this commit ran; only
        of the groups ``told`` when given, the others waiting for a later commit."""
        groups = outcome.groups
        if told is not None:
            earlier = [g for r in told if (g := self._untold.pop(r, None)) is not None]
            self._untold.update((g.request_id, g) for g in groups if g.request_id not in told)
            groups = [g for g in groups if g.request_id in told]
            ran = {g.request_id for g in groups}
            groups += [g for g in earlier if g.request_id not in ran]
        elif self._untold:
            ran = {g.request_id for g in groups}
            groups = groups + [g for r, g in self._untold.items() if r not in ran]
            self._untold.clear()
        if self.detokenizer is not None:
            self._detokenize([g for g in groups if not g.sampling_params.stop])
        ended = {id(g) for g in outcome.finished}
        ran = {id(g) for g in groups}
        for group in groups + [g for g in outcome.finished if id(g) not in ran]:
            delta = self.streams.delta(group, id(group) in ended)
            if delta is not None:
                outcome.deltas.append(delta)
        if self.journal is not None:  # written with the next step's commit, or flush()
            for group in groups:
                self.journal.touch(group)
            for group in outcome.finished:
                self.journal.remove(group.request_id)
            self.journal.defer(outcome.deltas)
            if outcome.deltas:  # published once it lands: see StepOutcome.durable
                outcome.durable = self.journal.next_landing()

    def _end_refused(self, out: SchedulerOutput, result: StepResult) -> list[RequestDelta]:
        """End the requests the executor left out of the step (a grammar it cannot use):
        taken out of ``out`` and ``result``, aborted (blocks freed), each stream ended by
        an ``invalid_grammar`` error event. Their grammar is the client's mistake, so every
        other request goes on."""
        refused = {o.seq_id: o.error for o in result.outputs if o.error}
        if not refused:
            return []
        result.outputs = [o for o in result.outputs if not o.error]
        deltas = []
        for scheduled in list(out.scheduled):
            group = scheduled.group
            why = next((refused[s.seq_id] for s in group.seqs if s.seq_id in refused), None)
            if why is None:
                continue
            out.scheduled.remove(scheduled)
            self.abort(group.request_id)
            num_events = self.streams.forget(group)
            deltas.append(
                self.streams.failed(
                    group.request_id, group.prompt_len, why, num_events, code="invalid_grammar"
                )
            )
        return deltas

    def flush(self) -> list[RequestDelta]:
        """Commit what the last step left (the engine is going idle, or groups moved in).
        The journal's step id is the last call applied: a call sent ahead is not in it.
        Returns the events made for the calls that had shared this commit (``catch_up``),
        for the caller to publish (none after a recovery)."""
        told = self.catch_up()
        if self.journal is not None and self.journal.has_deferred:
            newest = self._ahead[0].step.step_id if self._ahead else self._step_ids.value
            self.journal.commit(self.scheduler, self._meta(newest - 1))
        return told

    def catch_up(self, request_ids: list[str] | None = None) -> list[RequestDelta]:
        """Make now the text and events that calls sharing a commit still to come left to
        it (all, or those of ``request_ids``): before a commit outside a step, or before
        the groups end or leave between steps. The events go with the journal's next
        commit; the caller publishes them."""
        if request_ids is None:
            groups, self._untold = list(self._untold.values()), {}
        else:
            groups = [g for r in request_ids if (g := self._untold.pop(r, None)) is not None]
        if not groups:
            return []
        if self.detokenizer is not None:
            self._detokenize(groups)
        deltas = [d for g in groups if (d := self.streams.delta(g, finished=False)) is not None]
        if self.journal is not None:
            for group in groups:
                self.journal.touch(group)
            self.journal.defer(deltas)
        return deltas

    def _meta(self, step_id: int) -> dict[str, str]:
        return {
            "step_id": str(step_id),
            "next_seq_id": str(self.seq_ids.value),
            "executor_instance": self.executor_instance,
        }

    def recover(self, epoch: int | None = None) -> StepOutcome:
        """Rebuild from the journal after a restart; replay the step in flight, if any.

        Args:
            epoch: the leader's fencing epoch; None takes a new one from the store.

        Returns what the replayed step made (empty when none was): its events go to the
        journal with the next commit, where resuming clients read them, and the requests
        it finished are to be counted like any step's.
        """
        state = self.journal.begin(epoch)
        self.epoch = self.journal.epoch
        known = state.meta.get("executor_instance", self.executor_instance)
        last_step_id = self._fence(state)
        ran_ahead = last_step_id > int(state.meta.get("step_id", -1))
        if ran_ahead:
            log.warning("the executor ran a step past the journal; recomputing every group")
        kv_lost = ran_ahead or known != self.executor_instance
        restored, broken = restore_groups(self.scheduler, state, kv_lost)
        for request_id, error in broken.items():
            self._quarantine(request_id, f"its stored state does not restore: {error}")
        seq_ids = [s.seq_id for r in restored for s in r.group.seqs]
        self.seq_ids.advance_to(
            max([int(state.meta.get("next_seq_id", 0)), *(i + 1 for i in seq_ids)])
        )
        self._step_ids.value = int(state.meta.get("step_id", -1)) + 1
        self._step_ids.advance_to(last_step_id + 1)  # no id the executor already ran
        for r in restored:
            events = self.journal.store.read_events(r.group.request_id)
            self.streams.restore(r.group, len(events))
        if state.pending_step is None or kv_lost:
            return StepOutcome()
        return self._replay(step_from_json(state.pending_step), restored)

    def _fence(self, state: StoredState) -> int:
        """Fence the predecessor off; the last step id the executor applied (-1: none).

        A step past the journal's was sent before its commit landed: its cache operations
        and writes may have gone into blocks the journal counts as another sequence's, or
        free, or cached, so no stored table is trusted and every group is recomputed. Only
        a pipelined executor can run ahead, and only a store with groups has tables.
        """
        if not state.groups or not isinstance(self.executor, PipelinedExecutor):
            return -1
        last_step_id = self.executor.fence(self.epoch)
        return -1 if last_step_id is None else last_step_id

    def _replay(self, pending: PendingStep, restored: list[RestoredGroup]) -> StepOutcome:
        """Send the step in flight again, rebuilt from the restored groups: the executor
        answers a step it applied with its stored result, and applies one it never got.

        A step that cannot be replayed (a group of it was quarantined, or the executor
        refuses it) may have been applied in part: every group is recomputed instead.
        """
        by_seq = {s.seq_id: (r.group, i, s) for r in restored for i, s in enumerate(r.group.seqs)}
        if not all(seq_id in by_seq for seq_id in pending.seq_ids):
            self._abandon_replay("a sequence of it could not be restored")
            return StepOutcome()
        seqs = [self._seq_step(*by_seq[seq_id]) for seq_id in pending.seq_ids]
        step = ExecuteStep(
            pending.step_id,
            self.epoch,
            seqs,
            pending.blocks_to_swap_out,
            pending.blocks_to_swap_in,
            pending.blocks_to_copy,
        )
        scheduled: dict[int, ScheduledGroup] = {}
        for seq_step in seqs:
            group = by_seq[seq_step.seq_id][0]
            entry = scheduled.setdefault(id(group), ScheduledGroup(group, False))
            entry.is_prefill |= len(seq_step.new_token_ids) > 1
        out = SchedulerOutput(scheduled=list(scheduled.values()))
        try:
            result = self.executor.execute(step)
        except ExecutorError as e:  # refused, or failed inside the executor
            if self.journal.store.current_epoch() > self.epoch:  # fenced: not ours to fix
                raise
            self._abandon_replay(repr(e))
            return StepOutcome()
        self._step_ids.value = step.step_id + 1
        return self._apply(out, step, result)

    def _abandon_replay(self, why: str) -> None:
        log.error("the step in flight cannot be replayed; recomputing every group", why=why)
        for group in self.scheduler.recompute_all():
            self.journal.touch(group)

    def _quarantine(self, request_id: str, why: str) -> None:
        """Drop a stored request that recovery cannot restore, so that the others can be."""
        log.error("request quarantined", request_id=request_id, why=why)
        self.stats.num_quarantined += 1
        events = self.journal.store.read_events(request_id)
        self.drop(request_id, 0, f"the request could not be recovered: {why}", len(events))

    def _detokenize(self, groups: list[SequenceGroup]) -> list[SequenceGroup]:
        """Extend each sequence's text; a completed stop string ends the sequence there.
        Returns the groups that ended so, their blocks freed."""
        stopped = False
        for group in groups:
            stop = group.sampling_params.stop
            for seq in group.seqs:
                if seq.read_offset == len(seq.output_token_ids):
                    continue
                delta = self.detokenizer.update(seq)
                cut = find_stop(seq.output_text, len(delta), stop) if stop and delta else None
                if cut is not None:
                    seq.output_text.cut(cut)
                    if not seq.status.is_finished:
                        self.processor.finish(seq, SequenceStatus.FINISHED_STOPPED)
                        stopped = True
        return self.scheduler.free_finished() if stopped else []

    def _count(self, out: SchedulerOutput, step: ExecuteStep) -> None:
        stats = self.stats
        stats.num_steps += 1
        kinds = {s.is_prefill for s in out.scheduled}
        stats.num_mixed_steps += len(kinds) == 2
        stats.num_prompt_tokens += sum(
            len(s.new_token_ids) for s in step.seqs if len(s.new_token_ids) > 1
        )
        stats.num_prompt_chunks += sum(
            self.scheduler.block_manager.num_slots(seq) < seq.get_len()
            for scheduled in out.scheduled
            if scheduled.is_prefill  # a decode's slots reach its length
            for seq in scheduled.group.get_seqs(SequenceStatus.RUNNING)
        )
        for _, mode in out.preempted:
            stats.preemptions[mode.value] = stats.preemptions.get(mode.value, 0) + 1

    def _build_step(
        self,
        out: SchedulerOutput,
        follows_step_id: int | None = None,
        drawn: dict[int, SeqStep] | None = None,
        earlier: dict[int, int] | None = None,
    ) -> ExecuteStep:
        """The step ``out`` decides. Sent ahead of the call ``follows_step_id`` (``drawn``:
        its steps of the sequences it draws one sample for), a decode of a sequence it
        draws for follows it: the executor fills in the token and position. Followers
        come last, where the wire carries them in columns (step_to_pb)."""
        seqs, followers = [], []
        admits = any(scheduled.is_prefill for scheduled in out.scheduled)
        for scheduled in out.scheduled:
            group = scheduled.group
            for index, seq in enumerate(group.seqs):
                if seq.status != SequenceStatus.RUNNING:
                    continue
                if drawn is not None and not scheduled.is_prefill:
                    follower = self._follower(
                        group, index, seq, drawn[seq.seq_id], earlier.get(seq.seq_id, 0), admits
                    )
                    followers.append(follower)
                else:
                    seqs.append(self._seq_step(group, index, seq))
        return ExecuteStep(
            step_id=next(self._step_ids),
            epoch=self.journal.epoch if self.journal is not None else self.epoch,
            seqs=seqs + followers,
            blocks_to_swap_out=out.blocks_to_swap_out,
            blocks_to_swap_in=out.blocks_to_swap_in,
            blocks_to_copy=out.blocks_to_copy,
            follows_step_id=follows_step_id,
        )

    def _follower(
        self,
        group: SequenceGroup,
        index: int,
        seq: Sequence,
        before: SeqStep,
        earlier: int,
        admits: bool,
    ) -> SeqStep:
        """A sequence going on from the call in flight (``before``: its step there, which
        draws ``before.num_steps`` tokens): its table maps the slots of both calls
        (Scheduler.schedule_ahead), and the entries it shares with ``before``'s go unsent
        (all are sent when a sliding window freed some since). It runs the steps its slots
        hold past ``before``'s, which include those of calls ended early (EndSteps), or one
        when the call ``admits`` a prompt: the newcomer's first token waits for no steps in
        a row, and the slots past that one go to the next call."""
        bm = self.scheduler.block_manager
        table = list(bm.get_block_table(seq))
        kept = len(before.block_table)
        num_steps = bm.num_slots(seq) - (seq.get_len() + earlier + before.num_steps) + 1
        return SeqStep(
            seq_id=seq.seq_id,
            new_token_ids=[],
            num_computed_tokens=0,
            block_table=table,
            sampling_params=group.sampling_params,
            sample_index=index,
            num_steps=1 if admits else num_steps,
            follows=True,
            table_start=kept if table[:kept] == before.block_table else 0,
        )

    def _seq_step(self, group: SequenceGroup, index: int, seq: Sequence) -> SeqStep:
        """What the executor needs of one running sequence, from the scheduler's state alone:
        recovery rebuilds the pending step with it, equal to the step that was sent."""
        params = group.sampling_params
        history = params.has_penalties
        scoring = group.needs_prompt_logprobs
        num_slots = self.scheduler.block_manager.num_slots(seq)
        end = min(num_slots, seq.get_len())  # short of the length: a prompt chunk
        return SeqStep(
            seq_id=seq.seq_id,
            new_token_ids=seq.get_token_ids_between(seq.num_computed_tokens, end),
            num_computed_tokens=seq.num_computed_tokens,
            block_table=list(self.scheduler.block_manager.get_block_table(seq)),
            sampling_params=params,
            num_samples=num_samples(group) if end == seq.get_len() else 0,
            sample_index=index,
            prompt_token_ids=seq.prompt_token_ids if history or scoring else [],
            # a copy: the sequence grows
            output_token_ids=list(seq.output_token_ids) if params.needs_output_tokens else [],
            num_steps=max(1, num_slots - seq.get_len() + 1),  # slots mapped ahead: see Scheduler
        )


def _steps_run(step: ExecuteStep, result: StepResult) -> int:
    """Decode steps ``result`` answers: one, or its longest run of steps in a row
    (fewer than asked when the call ended early)."""
    if max((s.num_steps for s in step.seqs), default=1) == 1:
        return 1
    return max((len(o.token_ids) for o in result.outputs), default=0)


def _one_step_at_a_time(step: ExecuteStep, result: StepResult) -> Iterator[dict[int, SeqOutput]]:
    """The samples of each decode step of ``result`` by seq_id, in order: sequences run
    ``num_steps`` in a row answer one token per step, applied (and stopped) as if each had
    come back on its own; prompt tokens scored go with the first."""
    outputs = result.outputs
    num_steps = _steps_run(step, result)
    if num_steps == 1:
        yield {o.seq_id: o for o in outputs}
        return
    for i in range(num_steps):
        yield {
            o.seq_id: SeqOutput(
                o.seq_id,
                o.token_ids[i : i + 1],
                o.logprobs[i : i + 1],
                o.top_logprobs[i : i + 1],
                o.prompt_logprobs if i == 0 else [],
            )
            for o in outputs
            if i < len(o.token_ids)
        }
