"""The engine loop under asyncio, over one or many executors.

Each executor has a lane (scheduler_svc/lanes.py) stepped by its own task in a worker
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
import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import structlog

from pagedserve.registry import ExecutorRegistry
from pagedserve.sampling_params import SamplingParams
from scheduler_svc.engine import LLMEngine, StepOutcome
from scheduler_svc.executor_client import ExecutorClient, ExecutorError, StepRefused
from scheduler_svc.journal import Journal, orphaned_groups
from scheduler_svc.lanes import Lane, Move, NewRequest
from scheduler_svc.leader import Lease, LeaseKeeper
from scheduler_svc.persistence import params_from_dict
from scheduler_svc.reconnect import PROBE_TIMEOUT_S, ReconnectingExecutor
from scheduler_svc.router import ROUTERS, Router
from scheduler_svc.state_store import StaleEpochError, StateStore
from scheduler_svc.step_observer import StepObserver
from scheduler_svc.store_stream import StoreStream, request_owner, request_record
from scheduler_svc.streams import EngineDeadError, RequestDelta, RequestInFlightError

log = structlog.get_logger(__name__)

WATCH_S = 0.5  # longest an idle leader waits before looking at the registry again
ROUTED_MEMORY = 1 << 16  # (request id, arrival) pairs remembered as already routed
DRAIN_MARGIN_S = 3.0  # a draining executor's groups move this long before its deadline
MOVES_WAIT_S = 5.0  # longest a returning executor's lane waits for its groups' moves to land
RETAKE_PAUSE_S = 1.0  # between attempts to lead after one failed


@dataclass(frozen=True)
class Fleet:
    """The executors a leader drives: named up front, found in the registry, or both."""

    open_engine: Callable[[str], LLMEngine]  # blocking: connect, InitCache, build the engine
    executors: tuple[str, ...] = ()
    registry: ExecutorRegistry | None = None


class _SteppedDown:
    """Put in the local streams when this replica stops leading: follow the store now."""


STEPPED_DOWN = _SteppedDown()


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
        self._new_router = ROUTERS[routing]
        self.router: Router = self._new_router()
        self.lanes: dict[str, Lane] = {}
        self.epoch = 0
        self.leading = False
        self._where: dict[str, Lane] = {}  # request id -> the lane running it
        self._routed: OrderedDict[tuple[str, float], None] = OrderedDict()  # (id, arrival)
        self._unrouted: list[NewRequest | Move] = []
        self._streams: dict[str, asyncio.Queue[RequestDelta | BaseException | _SteppedDown]] = {}
        self._retired: set[str] = set()  # store lanes no executor serves, dropped once moved
        self._unreadable: set[str] = set()  # submitted records that do not parse (logged once)
        self._term_tasks: list[asyncio.Task] = []
        self._campaign_task: asyncio.Task | None = None
        self._lost = asyncio.Event()
        self._stop_campaign = threading.Event()
        self._started = False
        self._dead: BaseException | None = None
        self.died = asyncio.Event()  # set when an engine loop fails: the process should exit
        self._no_lane_since: float | None = None
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
        self.epoch = epoch
        self.leading = True
        for address in self.fleet.executors:
            engine = await asyncio.to_thread(self.fleet.open_engine, address)
            await self._open_lane(address, engine, start=False)
        if self.fleet.registry is not None:
            await self._sync_fleet(start=False)
        if self.store is not None:
            await self._adopt_orphans()
            await self._take_submissions()
        for lane in self.lanes.values():
            self._start_lane(lane)
        self._term_tasks.append(asyncio.create_task(self._watch(), name="engine-watch"))
        self._no_lane_since = None if self.lanes else time.monotonic()
        log.info("leading", epoch=epoch, executors=sorted(self.lanes))

    async def _end_term(self) -> None:
        """Stop the loops; clients streaming here continue from the store."""
        if not self.leading:
            return
        self.leading = False
        for lane in self._journaled_lanes():  # a thread resending a commit gives up
            lane.engine.journal.halt.set()
        tasks = self._term_tasks + [lane.task for lane in self.lanes.values() if lane.task]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._term_tasks.clear()
        if self.observer is not None:
            for name in self.lanes:
                self.observer.forget(name)
        self.lanes.clear()
        self._where.clear()
        self._unrouted.clear()
        self._routed.clear()
        self._retired.clear()
        self.router = self._new_router()
        for queue in self._streams.values():
            queue.put_nowait(STEPPED_DOWN)
        log.info("stepped down", epoch=self.epoch)

    def engines(self) -> dict[str, LLMEngine]:
        return {name: lane.engine for name, lane in self.lanes.items()}

    def has_unfinished(self) -> bool:
        """Work anywhere: queued for a lane, in a lane, or waiting for an executor."""
        return bool(self._unrouted) or any(lane.has_work() for lane in self.lanes.values())

    async def _open_lane(self, name: str, engine: LLMEngine, start: bool = True) -> Lane | None:
        """Recover the lane's state from the store under this leader's epoch and run it.

        A lane that had been retired takes back what its store lane still holds: the
        groups that had not moved on (they leave the unrouted list). Returns None, opening
        nothing, while moves out of it are still landing elsewhere.
        """
        if engine.journal is not None:
            source = engine.journal.store.lane_name
            if not await self._moves_landed(source):
                log.warning("executor back before its groups moved; retrying", executor=name)
                return None
            await asyncio.to_thread(engine.recover, self.epoch)
            await asyncio.to_thread(engine.flush)
            self._retired.discard(source)
            self._unrouted = [
                i for i in self._unrouted if not (isinstance(i, Move) and i.source == source)
            ]
        lane = Lane(name, engine)
        self.lanes[name] = lane
        if self.observer is not None:  # its pools show before its first step
            self.observer.after_step(name, engine, StepOutcome())
        sched = engine.scheduler
        for group in sched.running + sched.waiting + sched.swapped:
            self._where[group.request_id] = lane
            self.router.record(group.seqs[0].prompt_token_ids, name)
        if start:
            self._start_lane(lane)
        log.info("executor.joined", executor=name, lanes=len(self.lanes))
        return lane

    def _start_lane(self, lane: Lane) -> None:
        lane.task = asyncio.create_task(self._run_lane(lane), name=f"lane-{lane.name}")
        self._no_lane_since = None
        unrouted, self._unrouted = self._unrouted, []
        for item in unrouted:
            self._route(item)

    def _moving_from(self, source: str) -> bool:
        """Whether a group taken from store lane ``source`` has not landed in another yet."""
        pending = [*self._unrouted]
        for lane in self.lanes.values():
            pending += lane.in_flight()
        return any(isinstance(i, Move) and i.source == source for i in pending)

    async def _moves_landed(self, source: str) -> bool:
        """Wait (a while) until no group is on its way out of store lane ``source`` to an
        open lane; groups with no lane to go to do not count (they come back with it)."""
        deadline = time.monotonic() + MOVES_WAIT_S
        while True:
            moves = [m for lane in self.lanes.values() for m in lane.in_flight()]
            if not any(m.source == source for m in moves):
                return True
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)

    async def _drop_retired(self) -> None:
        """Delete the store lanes whose groups have all landed elsewhere."""
        for name in list(self._retired):
            if not self._moving_from(name):
                await asyncio.to_thread(self.store.drop_lane, name)
                self._retired.discard(name)

    # -- requests in -----------------------------------------------------------------

    def executor_unavailable_for(self) -> float:
        """Seconds no executor has been able to take work (0 while one answers, or while
        another replica leads)."""
        if not self.leading:
            return 0.0
        if not self.lanes:
            return 0.0 if self._no_lane_since is None else time.monotonic() - self._no_lane_since
        return min((_away(lane) for lane in self.lanes.values() if not lane.retiring), default=0.0)

    def check(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise RequestRejectedError now for a request no executor could ever run."""
        lanes = list(self.lanes.values())
        if lanes and not any(lane.fits(prompt_len, params) for lane in lanes):
            lanes[0].engine.scheduler.check_fits(prompt_len, params)
        elif not lanes and self.template is not None:
            self.template.scheduler.check_fits(prompt_len, params)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        after_event: int | None = None,
        owner: str = "",
    ) -> AsyncIterator[RequestDelta]:
        """Submit a request (or re-attach to it) and yield its events.

        Without ``after_event`` the request is new, recorded with its ``owner`` (see
        request_record), or its id is known and it is answered from the store. With
        ``after_event`` it is a resume: never submitted, it yields the events after that one.
        A resume, a known id, and any request while another replica leads are followed
        through the store, which raises RequestIdConflictError for a known id sent with
        another body, RequestVanishedError for a resume of an unknown id and
        EventOutOfRangeError for a resume past the request's end. Closing the iterator
        early (the client went away) aborts the request.
        """
        if not self.is_running:
            raise EngineDeadError("the engine loop is not running")
        if request_id in self._streams:
            raise RequestInFlightError(f"request id {request_id!r} is already being streamed")
        arrival = time.time()  # wall clock: comparable between replicas and restarts
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
        queue: asyncio.Queue[RequestDelta | BaseException | _SteppedDown] = asyncio.Queue()
        self._streams[request_id] = queue
        self._route(NewRequest(request_id, prompt_token_ids, params, arrival))
        finished, last, handed_over = False, 0, False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, _SteppedDown):
                    handed_over = True
                    break
                if isinstance(item, BaseException):
                    raise item
                if item.event <= last:
                    continue
                finished, last = item.finished, item.event
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished and not handed_over:
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
            yield delta

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
        lane = self._where.get(request_id)
        if lane is not None:
            with lane.lock:
                lane.aborts.append(request_id)
            lane.wake.set()
        else:
            self._unrouted = [i for i in self._unrouted if _request_id(i) != request_id]
        return request_id in self._streams

    def _route(self, item: NewRequest | Move) -> None:
        """Queue a new request, or a group moved off another executor, on the best lane."""
        request_id = _request_id(item)
        if isinstance(item, NewRequest):
            prompt, params = item.prompt, item.params
        else:
            prompt, params = item.group.seqs[0].prompt_token_ids, item.group.sampling_params
        open_lanes = [
            lane
            for lane in self.lanes.values()
            if not (lane.draining or lane.retiring) and lane.fits(len(prompt), params)
        ]
        answering = [lane for lane in open_lanes if not _away(lane)]
        room = {lane.name: lane.free_room() for lane in answering or open_lanes}
        if not room:
            self._unrouted.append(item)
            return
        lane = self.lanes[self.router.choose(prompt, room)]
        self.router.record(prompt, lane.name)
        self._where[request_id] = lane
        with lane.lock:
            if isinstance(item, NewRequest):
                lane.incoming.append(item)
                self._routed[(request_id, item.arrival)] = None
                while len(self._routed) > ROUTED_MEMORY:
                    self._routed.popitem(last=False)
            else:
                lane.arriving.append(item)
        lane.wake.set()

    async def _take_submissions(self) -> None:
        """Requests other replicas (or a previous leader) accepted that no lane holds yet."""
        for request_id, record in await asyncio.to_thread(self.store.pending_requests):
            try:
                request = _new_request(request_id, record)
            except Exception as e:  # left queued, logged once: never replayed into a crash
                if request_id not in self._unreadable:
                    log.error("submitted request unreadable", request_id=request_id, error=repr(e))
                    self._unreadable.add(request_id)
                continue
            # Routed here already (the queue entry goes with the lane's next commit).
            if (request_id, request.arrival) in self._routed or self._is_unrouted(request_id):
                continue
            self._route(request)

    def _is_unrouted(self, request_id: str) -> bool:
        return any(_request_id(item) == request_id for item in self._unrouted)

    async def _adopt_orphans(self) -> None:
        """Lanes left in the store by executors that do not answer: recompute their groups
        on the live executors; each store lane goes once its groups have landed."""
        served = {lane.engine.journal.store.lane_name for lane in self._journaled_lanes()}
        for name in await asyncio.to_thread(self.store.lane_names):
            if name in served:
                continue
            journal = Journal(self.store.lane(name))
            state = await asyncio.to_thread(journal.begin, self.epoch)
            groups = [g for g in orphaned_groups(state) if g.request_id not in self._where]
            for group in groups:
                events = await asyncio.to_thread(self.store.read_events, group.request_id)
                for lane in self.lanes.values():
                    lane.engine.seq_ids.advance_to(max(s.seq_id for s in group.seqs) + 1)
                self._route(Move(group, len(events), name))
            log.info("executor.orphans_adopted", executor=name, groups=len(groups))
            self._retired.add(name)

    def _journaled_lanes(self) -> list[Lane]:
        return [lane for lane in self.lanes.values() if lane.engine.journal is not None]

    # -- the loops -------------------------------------------------------------------

    async def _run_lane(self, lane: Lane) -> None:
        try:
            while True:
                if not lane.has_work():
                    await lane.wake.wait()
                lane.wake.clear()
                outcome, moved = await asyncio.to_thread(lane.step)
                if not lane.has_work():
                    await asyncio.to_thread(lane.engine.flush)
                self._publish(outcome)
                if lane.retiring:
                    await self._retire(lane, moved)
                    return
                if self.observer is not None:  # the lane's thread is between steps here
                    self.observer.after_step(lane.name, lane.engine, outcome)
        except asyncio.CancelledError:
            raise
        except (StaleEpochError, StepRefused) as e:
            if await self._fenced():  # a newer leader took over while we were away
                log.warning("fenced off by a newer leader", executor=lane.name, error=str(e))
                self._lost.set()
                return
            self._die(lane, e)
            raise
        except Exception as e:
            self._die(lane, e)
            raise

    async def _fenced(self) -> bool:
        if self.keeper is None or self.store is None:
            return False
        return await asyncio.to_thread(self.store.current_epoch) > self.epoch

    def _die(self, lane: Lane, e: Exception) -> None:
        """The loop is dead: fail every stream instead of hanging it, and tell the process
        (``died``), which exits non-zero so that its supervisor restarts it."""
        log.error("engine loop failed", executor=lane.name, error=repr(e), exc_info=e)
        self._dead = e
        for queue in self._streams.values():
            queue.put_nowait(EngineDeadError(f"engine failed: {e}"))
        self.died.set()

    def _publish(self, outcome: StepOutcome) -> None:
        for delta in outcome.deltas:
            queue = self._streams.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)
            if delta.finished:
                self._where.pop(delta.request_id, None)

    async def _retire(self, lane: Lane, moved: list[Move]) -> None:
        """The lane's executor is gone or drained: its groups go to the others. Its store
        lane keeps each group until the commit that writes it to its new lane."""
        del self.lanes[lane.name]
        self.router.forget(lane.name)
        if self.observer is not None:
            self.observer.forget(lane.name)
        with lane.lock:  # queued here while its last step ran: never entered the engine
            leftovers = [*lane.incoming, *lane.arriving]
            aborts = lane.aborts
            lane.incoming, lane.arriving, lane.aborts = [], [], []
        for item in [*moved, *leftovers]:
            self._where.pop(_request_id(item), None)
            self._route(item)
        for request_id in aborts:
            self.abort(request_id)
        log.info("executor.left", executor=lane.name, moved=len(moved), lanes=len(self.lanes))
        if lane.engine.journal is not None:
            self._retired.add(lane.engine.journal.store.lane_name)
        if self.fleet.registry is not None:
            await asyncio.to_thread(self.fleet.registry.release, lane.name)
        if not self.lanes:
            self._no_lane_since = time.monotonic()

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
                    await self._sync_fleet()
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
        await self._take_submissions()
        for request_id in aborts:
            self.abort(request_id)
        await self._drop_retired()

    async def _sync_fleet(self, start: bool = True) -> None:
        """Open lanes for new executors; drain or give up on the ones that go. Raises when
        the registry cannot be read: nobody is given up, or adopted, on no evidence."""
        records, gone = await asyncio.to_thread(self.fleet.registry.executors)
        for name, lane in list(self.lanes.items()):
            record = records.get(name)
            if lane.retiring or (name not in records and name in self.fleet.executors):
                continue
            if record is None or name in gone:
                await self._check_vanished(lane)
            elif record.draining:
                lane.draining = True
                late = time.time() > record.drain_deadline - DRAIN_MARGIN_S
                if late or not lane.has_work():
                    self._give_up(lane)
        for name, record in records.items():
            if name in self.lanes or record.draining:
                continue
            if name in gone and not await asyncio.to_thread(_answers, name):
                continue
            try:
                engine = await asyncio.to_thread(self.fleet.open_engine, name)
            except Exception as e:
                log.warning("executor not usable", executor=name, error=str(e))
                continue
            await self._open_lane(name, engine, start=start)

    async def _check_vanished(self, lane: Lane) -> None:
        """The lane's heartbeat lapsed: give it up only on evidence (its executor fails to
        answer) and only when another lane can take its groups; otherwise its engine keeps
        waiting for the executor, which may come back at the same address."""
        executor = lane.engine.executor
        if isinstance(executor, ReconnectingExecutor) and await asyncio.to_thread(executor.answers):
            return
        others = [o for o in self.lanes.values() if o is not lane and not o.retiring]
        if not any(not (o.draining or _away(o)) for o in others):
            return
        log.warning("executor vanished; recomputing its requests", executor=lane.name)
        self._give_up(lane)

    def _give_up(self, lane: Lane) -> None:
        lane.retiring = True
        if isinstance(lane.engine.executor, ReconnectingExecutor):
            lane.engine.executor.abandon()
        lane.wake.set()


def _new_request(request_id: str, record: str) -> NewRequest:
    data = json.loads(record)
    params = params_from_dict(data["params"])
    return NewRequest(request_id, [int(t) for t in data["prompt"]], params, float(data["arrival"]))


def _request_id(item: NewRequest | Move) -> str:
    return item.request_id if isinstance(item, NewRequest) else item.group.request_id


def _answers(address: str) -> bool:
    """Whether an executor answers at ``address`` now (a short GetStats)."""
    client = ExecutorClient(address)
    try:
        client.get_stats(timeout=PROBE_TIMEOUT_S)
    except ExecutorError:
        return False
    finally:
        client.close()
    return True


def _away(lane: Lane) -> float:
    """Seconds the lane's executor has not answered (0 while it does)."""
    executor = lane.engine.executor
    return executor.unavailable_for() if isinstance(executor, ReconnectingExecutor) else 0.0
