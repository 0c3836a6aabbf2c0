"""The lanes a leader drives during its term: which executor runs which request, and how
groups move when an executor drains, vanishes or comes back.

A group lives in exactly one store lane: the commit that writes a moved group to its new
lane deletes it from the old one, and a lane reopened for a returning executor takes back
from the store what had not moved yet. So a false alarm costs recomputation, never a
request run twice.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from pagedserve.model_info import ExecutorStats
from pagedserve.registry import ExecutorRegistry
from pagedserve.sampling_params import SamplingParams
from pagedserve.settings import TlsOptions
from scheduler_svc.engine.engine import LLMEngine, StepOutcome
from scheduler_svc.engine.executor_client import ExecutorClient, ExecutorError
from scheduler_svc.engine.lanes import Lane, Move, NewRequest
from scheduler_svc.engine.reconnect import PROBE_TIMEOUT_S, ReconnectingExecutor
from scheduler_svc.engine.router import ROUTERS, Router
from scheduler_svc.engine.step_observer import StepObserver
from scheduler_svc.state.journal import Journal, orphaned_groups
from scheduler_svc.state.persistence import params_from_dict
from scheduler_svc.state.state_store import StateStore

log = structlog.get_logger(__name__)

ROUTED_MEMORY = 1 << 16  # (request id, arrival) pairs remembered as already routed
DRAIN_MARGIN_S = 3.0  # a draining executor's groups move this long before its deadline
MOVES_WAIT_S = 5.0  # longest a returning executor's lane waits for its groups' moves to land


@dataclass(frozen=True)
class Fleet:
    """The executors a leader drives: named up front, found in the registry, or both."""

    open_engine: Callable[[str], LLMEngine]  # blocking: connect, InitCache, build the engine
    executors: tuple[str, ...] = ()
    registry: ExecutorRegistry | None = None
    tls: TlsOptions | None = None  # how executors are dialled (pagedserve/rpc/tls.py)


class LaneSet:
    """The open lanes, the router, and the requests and moves waiting for a lane.

    Coroutines of the event loop call it; only ``start_lane`` (given by the engine) runs
    a lane's steps, in a task of its own.
    """

    def __init__(
        self,
        fleet: Fleet,
        store: StateStore | None,
        observer: StepObserver | None,
        routing: str,
        start_lane: Callable[[Lane], asyncio.Task],
    ) -> None:
        self.fleet = fleet
        self.store = store
        self.observer = observer
        self.epoch = 0
        self.lanes: dict[str, Lane] = {}
        self._new_router = ROUTERS[routing]
        self.router: Router = self._new_router()
        self._start_task = start_lane
        self._where: dict[str, Lane] = {}  # request id -> the lane running it
        self._routed: OrderedDict[tuple[str, float], None] = OrderedDict()  # (id, arrival)
        self._unrouted: list[NewRequest | Move] = []
        self._retired: set[str] = set()  # store lanes no executor serves, dropped once moved
        self._unreadable: set[str] = set()  # submitted records that do not parse (logged once)
        self.no_lane_since: float | None = None

    def begin(self, epoch: int) -> None:
        self.epoch = epoch

    def end(self) -> list[asyncio.Task]:
        """Forget the term's lanes and queues; returns the lanes' tasks, to be cancelled.
        A lane's thread waiting for its executor stops waiting (a task's cancel does not
        reach into its thread, and the process would not exit while it waits)."""
        tasks = [lane.task for lane in self.lanes.values() if lane.task is not None]
        for lane in self.lanes.values():
            if isinstance(lane.engine.executor, ReconnectingExecutor):
                lane.engine.executor.halt()
        if self.observer is not None:
            for name in self.lanes:
                self.observer.forget(name)
        self.lanes.clear()
        self._where.clear()
        self._unrouted.clear()
        self._routed.clear()
        self._retired.clear()
        self.router = self._new_router()
        return tasks

    def has_unfinished(self) -> bool:
        """Work anywhere: queued for a lane, in a lane, or waiting for an executor."""
        return bool(self._unrouted) or any(lane.has_work() for lane in self.lanes.values())

    def all_away(self) -> bool:
        """Whether no lane's executor answers now (a call to it failed, none since passed)."""
        return all(_away(lane) > 0 for lane in self.lanes.values())

    def waiting(self) -> tuple[int, int]:
        """Requests, and their prompt tokens, that have not had a first step yet: queued
        for a lane, in one, or waiting in an engine's queue (read between its steps, so
        a count may be a step old)."""
        prompts = [i.prompt for i in self._unrouted if isinstance(i, NewRequest)]
        for lane in self.lanes.values():
            with lane.lock:
                prompts += [r.prompt for r in lane.incoming]
            prompts += [g.seqs[0].prompt_token_ids for g in list(lane.engine.scheduler.waiting)]
        return len(prompts), sum(map(len, prompts))

    def journaled(self) -> list[Lane]:
        return [lane for lane in self.lanes.values() if lane.engine.journal is not None]

    def unavailable_for(self) -> float:
        """Seconds no executor has been able to take work (0 while one answers)."""
        if not self.lanes:
            return 0.0 if self.no_lane_since is None else time.monotonic() - self.no_lane_since
        return min((_away(lane) for lane in self.lanes.values() if not lane.retiring), default=0.0)

    def check(self, prompt_len: int, params: SamplingParams, template: LLMEngine | None) -> None:
        """Raise RequestRejectedError now for a request no executor could ever run."""
        lanes = list(self.lanes.values())
        if lanes and not any(lane.fits(prompt_len, params) for lane in lanes):
            lanes[0].engine.scheduler.check_fits(prompt_len, params)
        elif not lanes and template is not None:
            template.scheduler.check_fits(prompt_len, params)

    # -- lanes opening and closing -----------------------------------------------------

    async def open_lane(self, name: str, engine: LLMEngine, start: bool = True) -> Lane | None:
        """Recover the lane's state from the store under this term's epoch and run it.

        A lane that had been retired takes back what its store lane still holds: the
        groups that had not moved on (they leave the unrouted list). Returns None, opening
        nothing, while moves out of it are still landing elsewhere.
        """
        replayed = StepOutcome()  # what the step in flight, sent again, made
        if engine.journal is not None:
            source = engine.journal.store.lane_name
            if not await self._moves_landed(source):
                log.warning("executor back before its groups moved; retrying", executor=name)
                return None
            replayed = await asyncio.to_thread(engine.recover, self.epoch)
            await asyncio.to_thread(engine.flush)
            self._retired.discard(source)
            self._unrouted = [
                i for i in self._unrouted if not (isinstance(i, Move) and i.source == source)
            ]
        lane = Lane(name, engine)
        self.lanes[name] = lane
        if self.observer is not None:  # its pools show before its first step
            self.observer.after_step(name, engine, replayed)
        sched = engine.scheduler
        for group in sched.running + sched.waiting + sched.swapped:
            self._where[group.request_id] = lane
            self.router.record(group.seqs[0].prompt_token_ids, name)
        if start:
            self.start_lane(lane)
        log.info("executor.joined", executor=name, lanes=len(self.lanes))
        return lane

    def start_lane(self, lane: Lane) -> None:
        lane.task = self._start_task(lane)
        self.no_lane_since = None
        unrouted, self._unrouted = self._unrouted, []
        for item in unrouted:
            self.route(item)

    async def retire(self, lane: Lane, moved: list[Move]) -> None:
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
            self.route(item)
        for request_id in aborts:
            self.abort(request_id)
        log.info("executor.left", executor=lane.name, moved=len(moved), lanes=len(self.lanes))
        if lane.engine.journal is not None:
            self._retired.add(lane.engine.journal.store.lane_name)
        if self.fleet.registry is not None:
            await asyncio.to_thread(self.fleet.registry.release, lane.name)
        if not self.lanes:
            self.no_lane_since = time.monotonic()

    async def sync_fleet(self, start: bool = True) -> None:
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
                    _give_up(lane)
        for name, record in records.items():
            if name in self.lanes or record.draining:
                continue
            if name in gone and not await asyncio.to_thread(probe_stats, name, self.fleet.tls):
                continue
            try:
                engine = await asyncio.to_thread(self.fleet.open_engine, name)
            except Exception as e:
                log.warning("executor not usable", executor=name, error=str(e))
                continue
            await self.open_lane(name, engine, start=start)

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
        _give_up(lane)

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

    async def drop_retired(self) -> None:
        """Delete the store lanes whose groups have all landed elsewhere."""
        for name in list(self._retired):
            if not self._moving_from(name):
                await asyncio.to_thread(self.store.drop_lane, name)
                self._retired.discard(name)

    # -- requests ----------------------------------------------------------------------

    def route(self, item: NewRequest | Move) -> None:
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
        lane.engine.end_steps()  # the newcomer waits one decode step, not a whole call

    def abort(self, request_id: str) -> None:
        """Have the lane running the request stop it before its next step, or drop it
        from the requests waiting for a lane."""
        lane = self._where.get(request_id)
        if lane is not None:
            with lane.lock:
                lane.aborts.append(request_id)
            lane.wake.set()
        else:
            self._unrouted = [i for i in self._unrouted if _request_id(i) != request_id]

    def finished(self, request_id: str) -> None:
        self._where.pop(request_id, None)

    async def take_submissions(self) -> None:
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
            if (request_id, request.arrival) in self._routed or any(
                _request_id(item) == request_id for item in self._unrouted
            ):
                continue
            self.route(request)

    async def adopt_orphans(self) -> None:
        """Lanes left in the store by executors that do not answer: recompute their groups
        on the live executors; each store lane goes once its groups have landed."""
        served = {lane.engine.journal.store.lane_name for lane in self.journaled()}
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
                self.route(Move(group, len(events), name))
            log.info("executor.orphans_adopted", executor=name, groups=len(groups))
            self._retired.add(name)


def _give_up(lane: Lane) -> None:
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


def probe_stats(address: str, tls: TlsOptions | None) -> ExecutorStats | None:
    """The executor's stats at ``address`` by a short GetStats, None if it does not answer."""
    client = ExecutorClient(address, tls=tls)
    try:
        return client.get_stats(timeout=PROBE_TIMEOUT_S)
    except ExecutorError:
        return None
    finally:
        client.close()


def _away(lane: Lane) -> float:
    """Seconds the lane's executor has not answered (0 while it does)."""
    executor = lane.engine.executor
    return executor.unavailable_for() if isinstance(executor, ReconnectingExecutor) else 0.0
