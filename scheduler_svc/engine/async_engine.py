"""The engine loop under asyncio, over one or many executors.

Each executor has a lane (scheduler_svc/engine/lanes.py) stepped by its own task in a worker
thread, so executors run their steps concurrently and a slow one holds up no other. Front
doors submit requests and read per-request streams; the router sends each new request to a
lane, and a lane whose executor drains, or is gone on evidence while another lane can take
its work, hands its groups to the others, to be recomputed there.

A group lives in exactly one store lane: the commit that writes a moved group to its new
lane deletes it from the old one, and a lane reopened for a returning executor takes back
from the store what had not moved yet. So a false alarm costs recomputation, never a
request run twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from pagedserve.sampling_params import SamplingParams
from scheduler_svc.engine.admission import DEFAULT_LIMITS, Admission, AdmissionLimits
from scheduler_svc.engine.engine import LLMEngine, StepOutcome
from scheduler_svc.engine.executor_client import StepRefused
from scheduler_svc.engine.lane_set import Fleet, LaneSet, probe_stats
from scheduler_svc.engine.lanes import Lane, Move, NewRequest
from scheduler_svc.engine.step_observer import StepObserver
from scheduler_svc.state.leader import Lease, LeaseKeeper
from scheduler_svc.state.state_store import StaleEpochError, StateStore, StoreBehindError
from scheduler_svc.state.store_stream import StoreStream, request_owner, request_record
from scheduler_svc.state.streams import (
    Choice,
    EngineDeadError,
    QueueFullError,
    RequestDelta,
    RequestFailedError,
    RequestInFlightError,
    SeqDelta,
)

log = structlog.get_logger(__name__)

WATCH_S = 0.5  # longest an idle leader waits before looking at the registry again
RETAKE_PAUSE_S = 1.0  # between attempts to lead after one failed


class _SteppedDown:
    """Put in the local streams when this replica stops leading: follow the store now."""


STEPPED_DOWN = _SteppedDown()


class _Stranded:
    """Put in the local streams when the server stops with its executors gone: the streams
    cannot finish here, and their requests stay where they are (in the store, with one)."""


STRANDED = _Stranded()

_InboxItem = RequestDelta | BaseException | _SteppedDown | _Stranded


class AsyncEngine:
    """Feeds the lanes from many coroutines and fans their steps out to request streams.

    With a store, a request is written there before it is accepted, and a client that
    comes back with the same request id (after a restart, or a dropped connection)
    resumes from the events it already got. With a lease, only the replica holding it runs
    the lanes; the others (and this one, once it stops leading) serve their clients from
    the store: requests in through the submission queue, tokens out through the events.
    """

    def __init__(
        self,
        fleet: Fleet | LLMEngine,
        observer: StepObserver | None = None,
        store: StateStore | None = None,
        lease: Lease | None = None,
        template: LLMEngine | None = None,
        routing: str = "prefix",
        store_budget_s: float = 30.0,
        limits: AdmissionLimits = DEFAULT_LIMITS,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        """Args:
        fleet: the executors, or one ready engine (in-process tests, no lease).
        observer: sees each engine between its steps (metrics, the block map).
        store: the shared state store; None keeps nothing (tests).
        lease: leadership among replicas; None leads from the start.
        template: an engine whose limits judge requests while no lane is open here.
        routing: how new requests pick an executor: "prefix" or "round-robin".
        store_budget_s: how long a stream followed through the store waits out a store
            that does not answer.
        limits: what may wait for a first step (requests, prompt tokens, expected seconds).
        on_refused: told the reason of each request refused at admission (metrics).
        """
        if isinstance(fleet, LLMEngine):
            engine = fleet
            fleet = Fleet(lambda _: engine, ("",))
            store = store or (engine.journal.store if engine.journal is not None else None)
        self.fleet = fleet
        self.observer = observer
        self.store = store
        self.template = template
        self.keeper = LeaseKeeper(lease, self._on_lost) if lease is not None else None
        self.follower = None if store is None else StoreStream(store, budget_s=store_budget_s)
        self.lane_set = LaneSet(fleet, store, observer, routing, self._start_loop)
        self.admission = Admission(limits)
        self.on_refused = on_refused
        self.epoch = 0
        self.leading = False
        self._streams: dict[str, _Inbox] = {}
        self._term_tasks: list[asyncio.Task] = []
        self._campaign_task: asyncio.Task | None = None
        self._lost = asyncio.Event()
        self._stop_campaign = threading.Event()
        self._started = False
        self._dead: BaseException | None = None
        self.died = asyncio.Event()  # set when an engine loop fails: the process should exit
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Lead at once (no lease), or campaign for the lease in the background."""
        self._loop = asyncio.get_running_loop()
        self._started = True
        if self.keeper is None:
            epoch = await asyncio.to_thread(self.store.begin_epoch) if self.store else 0
            await self._lead(epoch)
        else:
            self._campaign_task = asyncio.create_task(self._campaign(), name="campaign")

    async def stop(self) -> None:
        self._stop_campaign.set()
        tasks = [self._campaign_task] if self._campaign_task is not None else []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._end_term()
        if self.keeper is not None:
            await asyncio.to_thread(self.keeper.step_down)

    @property
    def is_running(self) -> bool:
        return self._started and self._dead is None

    async def _campaign(self) -> None:
        """Standby until the lease is ours, lead until it is lost, and again."""
        while True:
            epoch = await asyncio.to_thread(self.keeper.wait_for_leadership, self._stop_campaign)
            if epoch is None:
                return
            self._lost.clear()
            try:
                await self._lead(epoch)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # fenced, or the store or an executor failed meanwhile
                log.warning("could not take over", epoch=epoch, error=repr(e))
                self._lost.set()
                await asyncio.sleep(RETAKE_PAUSE_S)
            await self._lost.wait()
            await self._end_term()
            await asyncio.to_thread(self.keeper.step_down)

    def _on_lost(self) -> None:
        """Keeper thread: the lease is gone; stop stepping and follow the new leader."""
        self._loop.call_soon_threadsafe(self._lost.set)

    async def _lead(self, epoch: int) -> None:
        """Open every executor's lane, recover what the store holds (replaying steps in
        flight), take the requests waiting in the store, then start the loops."""
        seen = await asyncio.to_thread(self._newest_epoch_seen)
        if self.store is not None and seen >= epoch:
            # The store forgot its epochs (Redis restarted empty): every step under this
            # one would be refused as stale, so take one past what the executors saw.
            epoch = await asyncio.to_thread(self.store.begin_epoch, seen + 1)
            log.warning("epoch raised past the executors'", seen=seen, epoch=epoch)
        self.epoch = epoch
        self.leading = True
        lane_set = self.lane_set
        lane_set.begin(epoch)
        for address in self.fleet.executors:
            engine = await asyncio.to_thread(self.fleet.open_engine, address)
            await lane_set.open_lane(address, engine, start=False)
        if self.fleet.registry is not None:
            await lane_set.sync_fleet(start=False)
        if self.store is not None:
            await lane_set.adopt_orphans()
            await lane_set.take_submissions()
        for lane in self.lanes.values():
            lane_set.start_lane(lane)
        self._term_tasks.append(asyncio.create_task(self._watch(), name="engine-watch"))
        lane_set.no_lane_since = None if self.lanes else time.monotonic()
        log.info("leading", epoch=epoch, executors=sorted(self.lanes))

    def _newest_epoch_seen(self) -> int:
        """The newest epoch any known executor has run a step of (0 for those that do not
        answer now: a step they refuse later raises the epoch then, see _epoch_behind)."""
        addresses = set(self.fleet.executors)
        if self.fleet.registry is not None:
            addresses |= set(self.fleet.registry.executors()[0])
        return max((self._epoch_seen_by(address) for address in addresses), default=0)

    def _epoch_seen_by(self, address: str) -> int:
        """The newest epoch the executor at ``address`` has seen, 0 if it does not answer."""
        stats = probe_stats(address, self.fleet.tls)
        return stats.epoch if stats is not None else 0

    async def _end_term(self) -> None:
        """Stop the loops; clients streaming here continue from the store."""
        if not self.leading:
            return
        self.leading = False
        for lane in self.lane_set.journaled():  # a thread resending a commit gives up
            lane.engine.journal.halt.set()
        tasks = self._term_tasks + self.lane_set.end()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._term_tasks.clear()
        for inbox in self._streams.values():
            inbox.put(STEPPED_DOWN)
        log.info("stepped down", epoch=self.epoch)

    def end_stranded_streams(self) -> bool:
        """While the server stops: when every executor of this leader's lanes is gone (those
        of `pagedserve serve` stop under the same Ctrl-C), end each stream served here with
        an error instead of waiting for tokens that will not come. Returns whether it did."""
        if not self.lanes or not self.lane_set.all_away():
            return False
        for inbox in self._streams.values():
            inbox.put(STRANDED)
        return True

    @property
    def lanes(self) -> dict[str, Lane]:
        return self.lane_set.lanes

    def engines(self) -> dict[str, LLMEngine]:
        return {name: lane.engine for name, lane in self.lanes.items()}

    def has_unfinished(self) -> bool:
        """Work anywhere: queued for a lane, in a lane, or waiting for an executor."""
        return self.lane_set.has_unfinished()

    # -- requests in -----------------------------------------------------------------

    def executor_unavailable_for(self) -> float:
        """Seconds no executor has been able to take work (0 while one answers, or while
        another replica leads)."""
        return self.lane_set.unavailable_for() if self.leading else 0.0

    def check(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise RequestRejectedError now for a request no executor could ever run."""
        self.lane_set.check(prompt_len, params, self.template)

    def _admit(self, prompt_len: int) -> None:
        """Raise QueueFullError when the leader's waiting queue has no room for another
        request of ``prompt_len`` tokens (checked and routed with no await between, so a
        burst cannot overfill it)."""
        try:
            self.admission.check(*self.lane_set.waiting(), prompt_len)
        except QueueFullError as e:
            if self.on_refused is not None:
                self.on_refused(e.reason)
            raise

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        after_event: int | None = None,
        owner: str = "",
        stream: bool = True,
    ) -> AsyncIterator[RequestDelta]:
        """Submit a request (or re-attach to it) and yield its events; without ``stream``
        the caller wants only the whole answer, and this wakes once, at the request's end.

        Without ``after_event`` the request is new, recorded with its ``owner`` (see
        request_record), or its id is known and it is answered from the store. With
        ``after_event`` it is a resume: never submitted, it yields the events after that one.
        A resume, a known id, and any request while another replica leads are followed
        through the store, which raises RequestIdConflictError for a known id sent with
        another body, RequestVanishedError for a resume of an unknown id and
        EventOutOfRangeError for a resume past the request's end. On the leader a request
        the waiting queue has no room for raises QueueFullError, before it is stored.
        Closing the iterator early (the client went away) aborts the request.
        """
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        if request_id in self._streams:
            raise RequestInFlightError(f"request id {request_id!r} is already being streamed")
        arrival = time.time()  # wall clock: comparable between replicas and restarts
        if after_event is None and self.leading:  # a replica that does not lead passes it on
            self._admit(len(prompt_token_ids))
        new = after_event is None and self._submit(
            request_id, prompt_token_ids, params, arrival, owner
        )
        if not (new and self.leading):
            # Live events are published a step before they are committed, so one published
            # before this client came would be missed here; the store has every committed
            # event in order.
            async for delta in self._follow(request_id, prompt_token_ids, params, after_event):
                yield delta
            return
        inbox = self._streams[request_id] = _Inbox(each_event=stream)
        self.lane_set.route(NewRequest(request_id, prompt_token_ids, params, arrival))
        finished, last, handed_over, stranded = False, 0, False, False
        try:
            while not (finished or handed_over):
                for item in await inbox.take():
                    if isinstance(item, _SteppedDown):
                        handed_over = True
                    elif isinstance(item, _Stranded):
                        stranded = True
                        raise EngineDeadError(
                            "the server is stopping and its executor is gone: the request "
                            "did not finish here"
                        )
                    elif isinstance(item, BaseException):
                        raise item
                    elif item.event > last:
                        finished, last = item.finished, item.event
                        yield _checked(item)
                    if finished or handed_over:
                        break
        finally:
            self._streams.pop(request_id, None)
            if not (finished or handed_over or stranded):
                self.abort(request_id)
        if handed_over:  # another replica leads now: its events come through the store
            async for delta in self._follow(request_id, prompt_token_ids, params, last):
                yield delta

    async def _follow(
        self, request_id: str, prompt: list[int], params: SamplingParams, after_event: int
    ) -> AsyncIterator[RequestDelta]:
        if self.follower is None:
            raise EngineDeadError("this replica does not lead and has no store to follow")
        async for delta in self.follower.generate(request_id, prompt, params, after_event):
            yield _checked(delta)

    def _submit(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        arrival: float,
        owner: str,
    ) -> bool:
        """Record the request before accepting it; False when the id is already known."""
        if self.store is None:
            return True
        record = request_record(prompt, params, arrival, owner)
        return self.store.submit_request(request_id, record)

    def abort(self, request_id: str, owner: str | None = None) -> bool:
        """Stop a request within one step; its stream, if any, ends with finish reason
        "abort". Returns whether a client was following it here.

        With ``owner``, only a request recorded with that owner stops (without a store no
        owners are recorded, and any request does).
        """
        checks_owner = owner is not None and self.store is not None
        if checks_owner and request_owner(self.store, request_id) != owner:
            return False
        if not self.leading:
            return self.follower is not None and self.follower.abort(request_id)
        self.lane_set.abort(request_id)
        return request_id in self._streams

    # -- the loops -------------------------------------------------------------------

    def _start_loop(self, lane: Lane) -> asyncio.Task:
        return asyncio.create_task(self._run_lane(lane), name=f"lane-{lane.name}")

    async def _run_lane(self, lane: Lane) -> None:
        unpublished: deque[StepOutcome] = deque()  # in step order, waiting for their commit
        loop = asyncio.get_running_loop()
        stop = threading.Event()  # the task ended: no step after the one running

        def landed(_: object) -> None:  # on the journal's writer thread
            loop.call_soon_threadsafe(self._publish_durable, unpublished)

        def publish(outcome: StepOutcome) -> None:
            unpublished.append(outcome)
            self._publish_durable(unpublished)
            if outcome.durable is not None and not outcome.durable.done():
                outcome.durable.add_done_callback(landed)

        def steps() -> tuple[StepOutcome, list[Move]]:
            """The lane's steps back to back on one thread while it has work, each observed
            right after it (StepObserver), then handed to this loop to publish: the next
            step does not wait for the loop. Returns the last, with the groups it moved,
            once the lane runs out of work or retires, or the task ended."""
            while True:
                outcome, moved = lane.step()
                # Counted before its clients see it, and before a flush that the term's
                # end may cut short: the step's commit can land all the same, ending
                # streams that the next term will not run again.
                self._observe(lane, outcome)
                if stop.is_set() or lane.retiring or not lane.has_work():
                    return outcome, moved
                loop.call_soon_threadsafe(publish, outcome)

        try:
            while True:
                if not lane.has_work():
                    await lane.wake.wait()
                lane.wake.clear()
                outcome, moved = await asyncio.to_thread(steps)
                if not lane.has_work():  # what it commits has landed when it returns
                    told = await asyncio.to_thread(lane.engine.flush)
                    self._observe(lane, StepOutcome(deltas=told))
                    outcome.deltas += told
                publish(outcome)
                if lane.retiring:
                    await self.lane_set.retire(lane, moved)
                    return
        except asyncio.CancelledError:
            raise
        except (StaleEpochError, StepRefused) as e:
            if await self._fenced():  # a newer leader took over while we were away
                log.warning("fenced off by a newer leader", executor=lane.name, error=str(e))
                self._lost.set()
                return
            if isinstance(e, StepRefused) and await self._epoch_behind(lane, e):
                self._lost.set()  # lead again, under an epoch past the executor's
                return
            self._die(lane, e)
            raise
        except StoreBehindError as e:  # the store lost its state: the lease went with it
            if self.keeper is None:
                self._die(lane, e)
                raise
            log.warning("the store lost its state; leading again", executor=lane.name)
            self._lost.set()
        except Exception as e:
            self._die(lane, e)
            raise
        finally:
            stop.set()

    def _observe(self, lane: Lane, outcome: StepOutcome) -> None:
        if self.observer is not None:
            self.observer.after_step(lane.name, lane.engine, outcome)

    async def _fenced(self) -> bool:
        if self.keeper is None or self.store is None:
            return False
        return await asyncio.to_thread(self.store.current_epoch) > self.epoch

    async def _epoch_behind(self, lane: Lane, e: StepRefused) -> bool:
        """Whether the lane's executor refused a step out of order having seen this epoch
        or a newer one, which only a store that lost its data (Redis restarted empty)
        allows: epochs and step ids count from the start again. If so, raise the store's
        epoch past the executor's, fencing this term too, so that the next term's steps
        run (a new epoch may restart its step ids)."""
        if self.keeper is None or self.store is None:
            return False
        if e.code != grpc.StatusCode.FAILED_PRECONDITION:
            return False
        seen = await asyncio.to_thread(self._epoch_seen_by, lane.name)
        if seen < self.epoch:
            return False
        epoch = await asyncio.to_thread(self.store.begin_epoch, seen + 1)
        log.warning("the store's epoch was behind an executor's", seen=seen, epoch=epoch)
        return True

    def _die(self, lane: Lane, e: Exception) -> None:
        """The loop is dead: fail every stream instead of hanging it, and tell the process
        (``died``), which exits non-zero so that its supervisor restarts it."""
        log.error("engine loop failed", executor=lane.name, error=repr(e), exc_info=e)
        self._dead = e
        for inbox in self._streams.values():
            inbox.put(EngineDeadError(f"engine failed: {e}"))
        self.died.set()

    def _publish_durable(self, unpublished: deque[StepOutcome]) -> None:
        """Publish a lane's outcomes in step order, each once its commit has landed. One
        whose commit failed ends the lot: the term is over (the lane's next commit raises
        why), and its clients go on from the store."""
        while unpublished and (unpublished[0].durable is None or unpublished[0].durable.done()):
            outcome = unpublished.popleft()
            if outcome.durable is not None and outcome.durable.exception() is not None:
                unpublished.clear()
                return
            self._publish(outcome)

    def _publish(self, outcome: StepOutcome) -> None:
        for delta in outcome.deltas:
            inbox = self._streams.get(delta.request_id)
            if inbox is not None:
                inbox.put(delta)
            if delta.event == 1:
                self.admission.started()
            if delta.finished:
                self.lane_set.finished(delta.request_id)

    async def _watch(self) -> None:
        """Other replicas' submissions and aborts, and the registry's executors coming and
        going, until the term ends."""
        registry = self.fleet.registry
        next_sync = 0.0
        while True:
            try:
                if self.store is not None:
                    await self._watch_store()
                else:
                    await asyncio.sleep(WATCH_S)
                if registry is not None and time.monotonic() >= next_sync:
                    next_sync = time.monotonic() + registry.ttl_s / 3
                    await self.lane_set.sync_fleet()
            except StaleEpochError:  # a newer leader: the lanes learn it at their next commit
                await asyncio.sleep(WATCH_S)
            except Exception as e:  # the store or the registry away: look again shortly
                log.warning("watch failed; retrying", error=repr(e))
                await asyncio.sleep(WATCH_S)

    async def _watch_store(self) -> None:
        """One round: wait for work, take aborts and submissions, drop drained lanes."""
        await asyncio.to_thread(self.store.wait_for_work, WATCH_S)
        # Aborts first, applied after the adds: an abort may name a request that was
        # submitted an instant before it.
        aborts = await asyncio.to_thread(self.store.take_aborts, self.epoch)
        await self.lane_set.take_submissions()
        for request_id in aborts:
            self.abort(request_id)
        await self.lane_set.drop_retired()


class _Inbox:
    """What the lanes publish for one request a client follows here. A client that reads
    only the whole answer is woken once, when the request ends, rather than at each step:
    with hundreds of requests running, those wake-ups cost the event loop milliseconds a
    step, which it takes from the lanes' threads. Its events are folded into one as they
    come (``_Fold``): kept one by one, a long answer's thousand events, a handful of
    objects each, filled the garbage collector's young generations, whose passes then
    took milliseconds and set off full passes of a tenth of a second."""

    def __init__(self, each_event: bool) -> None:
        self.each_event = each_event
        self._items: deque[_InboxItem] = deque()
        self._ready = asyncio.Event()
        self._fold: _Fold | None = None  # folding the last of _items

    def put(self, item: _InboxItem) -> None:
        if self.each_event:
            self._items.append(item)
            self._ready.set()
            return
        delta = item if isinstance(item, RequestDelta) else None
        if delta is None or self._fold is None or not self._fold.absorb(delta):
            self._end_fold()
            if delta is not None and delta.error is None:
                self._fold = _Fold(delta)
                item = self._fold.delta
            self._items.append(item)
        if delta is None or delta.finished:
            self._ready.set()

    async def take(self) -> list[_InboxItem]:
        """Everything put since the last take, once something woke it."""
        await self._ready.wait()
        self._ready.clear()
        self._end_fold()
        items = list(self._items)
        self._items.clear()
        return items

    def _end_fold(self) -> None:
        if self._fold is not None:
            self._fold.close()
            self._fold = None


class _Fold:
    """Consecutive events of one request as one: each output accumulated (``Choice``, as
    the front door accumulates a whole answer), the last event's number and end. The
    events published are shared, so nothing of theirs is changed."""

    def __init__(self, first: RequestDelta) -> None:
        self.delta = dataclasses.replace(first, outputs=[])
        self._choices: dict[int, Choice] = {}  # by output index, in order of appearance
        self._add(first)

    def absorb(self, delta: RequestDelta) -> bool:
        """Fold ``delta`` in, or drop it when already folded (an event sent again after a
        restart, under its number); False when it is not the next event, or ends the
        request with an error, which then follows as an item of its own."""
        folded = self.delta
        if delta.event <= folded.event:
            return True
        if delta.event != folded.event + 1 or delta.error is not None:
            return False
        self._add(delta)
        folded.event, folded.finished = delta.event, delta.finished
        return True

    def close(self) -> None:
        """The folded event's outputs, from what each accumulated."""
        self.delta.outputs = [
            SeqDelta(index, c.text, c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason)
            for index, c in self._choices.items()
        ]

    def _add(self, delta: RequestDelta) -> None:
        for out in delta.outputs:
            choice = self._choices.get(out.index)
            if choice is None:
                choice = self._choices[out.index] = Choice()
            choice.add(out)


def _checked(delta: RequestDelta) -> RequestDelta:
    """``delta``, unless it ends its request with an error: then RequestFailedError, which
    the front doors send as an error (an error event on a stream)."""
    if delta.error is not None:
        raise RequestFailedError(delta.error, delta.error_code)
    return delta
