"""StoreStream against both stores, with a fake leader committing events from a thread."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine

import pytest

from pagedserve.sampling_params import SamplingParams
from scheduler_svc.engine.async_engine import RequestInFlightError
from scheduler_svc.state.state_store import StateStore, StepCommit
from scheduler_svc.state.store_stream import (
    EventOutOfRangeError,
    RequestIdConflictError,
    RequestVanishedError,
    StoreStream,
    request_owner,
    request_record,
    submit,
)
from scheduler_svc.state.streams import RequestDelta, SeqDelta
from scheduler_svc.state.wakeups import OnEvents

PARAMS = SamplingParams(max_tokens=4)


def run(body: Coroutine, timeout: float = 20.0) -> object:
    return asyncio.run(asyncio.wait_for(body, timeout))


def delta(request_id: str, event: int, last: int) -> str:
    out = SeqDelta(
        0, f"t{event}", [event], [-0.5], [{event: -0.5}], "length" if event == last else None
    )
    return RequestDelta(request_id, 3, event, [out], finished=event == last).to_json()


class FakeLeader(threading.Thread):
    """Takes the first submitted request and commits its events one by one, each `gap_s`
    apart, as the engine leader would; stops early when asked to abort it."""

    def __init__(self, target: StateStore, num_events: int = 4, gap_s: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.store, self.num_events, self.gap_s = target, num_events, gap_s
        self.epoch = target.begin_epoch()
        self.records: dict[str, str] = {}
        self.aborted: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.store.pending_requests():
            if self.stop.is_set():
                return
            self.store.wait_for_work(0.1)
        [(rid, record)] = self.store.pending_requests()
        self.records[rid] = record
        ids = iter(range(1, 1000))
        self.store.commit(
            StepCommit(
                self.epoch, next(ids), upsert_groups={rid: "{}"}, new_requests_consumed=[rid]
            )
        )
        for event in range(1, self.num_events + 1):
            time.sleep(self.gap_s)
            self.aborted += self.store.take_aborts(self.epoch)
            if rid in self.aborted or self.stop.is_set():
                return
            done = event == self.num_events
            self.store.commit(
                StepCommit(
                    self.epoch,
                    next(ids),
                    events=[(rid, delta(rid, event, self.num_events))],
                    delete_groups=[rid] if done else [],
                )
            )


async def collect(deltas: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
    return [d async for d in deltas]


def test_stream_yields_the_leaders_events_in_order(store: StateStore) -> None:
    leader = FakeLeader(store)
    leader.start()
    # A long poll: only the store's wakes can make this finish in time.
    stream = StoreStream(store, poll_s=60.0)
    start = time.monotonic()
    got = run(collect(stream.generate("r", [1, 2, 3], PARAMS)))
    assert time.monotonic() - start < 5.0
    leader.join(5)
    assert [(d.event, d.finished) for d in got] == [(1, False), (2, False), (3, False), (4, True)]
    assert [d.outputs[0].token_ids for d in got] == [[1], [2], [3], [4]]
    assert got[-1].outputs[0].finish_reason == "length"
    record = json.loads(leader.records["r"])
    assert record["prompt"] == [1, 2, 3] and record["params"]["max_tokens"] == 4
    assert leader.aborted == [] and store.take_aborts(leader.epoch) == []


def test_resume_after_an_event_and_reattach(store: StateStore) -> None:
    leader = FakeLeader(store, gap_s=0)
    leader.start()
    record = request_record([9], PARAMS, time.time())
    store.submit_request("r", record)
    leader.join(5)
    stream = StoreStream(store, poll_s=60.0)
    resumed = run(collect(stream.generate("r", [9], PARAMS, after_event=2)))
    assert [d.event for d in resumed] == [3, 4]
    again = run(collect(stream.generate("r", [9], PARAMS)))  # a known id: nothing resubmitted
    assert [d.event for d in again] == [1, 2, 3, 4]
    assert store.get_request("r") == record and store.pending_requests() == []


def test_early_close_asks_the_leader_to_abort(store: StateStore) -> None:
    leader = FakeLeader(store, num_events=50, gap_s=0.02)
    leader.start()
    stream = StoreStream(store, poll_s=60.0)

    async def first_two() -> list[int]:
        events = []
        deltas = stream.generate("r", [1], PARAMS)
        async for d in deltas:
            events.append(d.event)
            if len(events) == 2:
                break
        await deltas.aclose()
        return events

    assert run(first_two()) == [1, 2]
    leader.join(5)
    assert leader.aborted == ["r"]
    assert len(store.read_events("r")) < 50


def test_cancelled_consumer_asks_for_an_abort(store: StateStore) -> None:
    epoch = store.begin_epoch()
    stream = StoreStream(store, poll_s=60.0)

    async def cancel_while_waiting() -> None:
        task = asyncio.create_task(collect(stream.generate("r", [1], PARAMS)))
        await asyncio.sleep(0.2)  # submitted, waiting for a first event that never comes
        assert stream.abort("other") is False
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(cancel_while_waiting())
    assert store.take_aborts(epoch) == ["other", "r"]
    assert [rid for rid, _ in store.pending_requests()] == ["r"]


def test_one_door_streams_a_request_id_once(store: StateStore) -> None:
    stream = StoreStream(store, poll_s=60.0)

    async def twice() -> None:
        first = stream.generate("r", [1], PARAMS)
        task = asyncio.create_task(collect(first))
        await asyncio.sleep(0.1)
        assert stream.abort("r") is True
        with pytest.raises(RequestInFlightError):
            await collect(stream.generate("r", [1], PARAMS))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(twice())


def test_resuming_an_unknown_request_raises(store: StateStore) -> None:
    stream = StoreStream(store, poll_s=60.0)
    with pytest.raises(RequestVanishedError):
        run(collect(stream.generate("gone", [1], PARAMS, after_event=3)))
    assert store.pending_requests() == []  # a resume never submits


def test_a_request_that_vanishes_while_followed_raises(store: StateStore) -> None:
    epoch = store.begin_epoch()
    stream = StoreStream(store, poll_s=0.1)

    async def follow_then_drop() -> None:
        task = asyncio.create_task(collect(stream.generate("r", [1], PARAMS)))
        await asyncio.sleep(0.2)
        # The leader drops it without a single event (as an expiry would): the record goes.
        store.commit(StepCommit(epoch, 1, new_requests_consumed=["r"]))
        assert store.get_request("r") is None
        with pytest.raises(RequestVanishedError):
            await task

    run(follow_then_drop())


class LossyStore:
    """A real store whose pushes to followers get lost, as pub/sub loses them while a
    listener reconnects: every `keep`-th push arrives, or none when keep is 0."""

    def __init__(self, target: StateStore, keep: int) -> None:
        self.store, self.keep = target, keep
        self.num_pushes = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    def watch_events(self, request_id: str, on_events: OnEvents) -> Callable[[], None]:
        def lossy(events: list[tuple[int, str]] | None) -> None:
            self.num_pushes += 1
            if self.keep and self.num_pushes % self.keep == 0:
                on_events(events)

        return self.store.watch_events(request_id, lossy)


@pytest.mark.parametrize("keep", [2, 0])
def test_lost_pushes_are_read_from_the_list(store: StateStore, keep: int) -> None:
    """Every 2nd push lost: the next one shows a gap and the stream reads the list. None
    arriving: the stream reads after each `poll_s`."""
    leader = FakeLeader(store, num_events=8, gap_s=0.03)
    leader.start()
    stream = StoreStream(LossyStore(store, keep), poll_s=0.1)  # type: ignore[arg-type]
    got = run(collect(stream.generate("r", [1], PARAMS)))
    leader.join(5)
    assert [d.event for d in got] == list(range(1, 9))
    assert got[-1].finished


def test_a_resume_past_the_last_event_raises_at_once(store: StateStore) -> None:
    leader = FakeLeader(store, gap_s=0)
    leader.start()
    store.submit_request("r", request_record([9], PARAMS, time.time()))
    leader.join(5)  # events 1..4, the 4th finished
    stream = StoreStream(store, poll_s=60.0)  # a hang would outlast the test's timeout
    with pytest.raises(EventOutOfRangeError):
        run(collect(stream.generate("r", [9], PARAMS, after_event=4)), timeout=5)
    assert [d.event for d in run(collect(stream.generate("r", [9], PARAMS, 3)))] == [4]


def test_a_known_id_with_another_body_is_a_conflict(store: StateStore) -> None:
    assert submit(store, "r", [1, 2], PARAMS, time.time(), owner="alice")
    assert not submit(store, "r", [1, 2], PARAMS, time.time(), owner="alice")
    assert request_owner(store, "r") == "alice" and request_owner(store, "gone") is None
    stream = StoreStream(store, poll_s=60.0)
    for prompt, params in (([1, 3], PARAMS), ([1, 2], SamplingParams(max_tokens=5))):
        with pytest.raises(RequestIdConflictError):
            submit(store, "r", prompt, params, time.time())
        with pytest.raises(RequestIdConflictError):
            run(collect(stream.generate("r", prompt, params)))
        with pytest.raises(RequestIdConflictError):
            run(collect(stream.generate("r", prompt, params, after_event=1)))
    assert [rid for rid, _ in store.pending_requests()] == ["r"]
