"""The request tracker behind the request metrics: each request counted once."""

from __future__ import annotations

from scheduler_svc.core.sequence import Sequence, SequenceGroup, SequenceStatus
from scheduler_svc.engine.engine import StepOutcome
from scheduler_svc.engine.request_stats import REMEMBERED_FINISHED, RequestTracker
from scheduler_svc.state.streams import RequestDelta, SeqDelta


def finishing(request_id: str, now: float) -> StepOutcome:
    """A step in which ``request_id`` draws its last two tokens and ends by length."""
    seq = Sequence(0, [1, 2, 3], [7, 8], status=SequenceStatus.FINISHED_LENGTH)
    group = SequenceGroup(request_id, [seq], arrival_time=now - 1.0)
    out = SeqDelta(0, "ab", [7, 8], [0.0, 0.0], [{}, {}], "length")
    delta = RequestDelta(request_id, 3, 1, [out], finished=True)
    return StepOutcome(groups=[group], finished=[group], deltas=[delta])


def test_a_request_a_new_term_finishes_again_is_counted_once() -> None:
    """The old term observed the step that finished it, whose commit never landed; the new
    term recomputes and finishes it again, with new objects."""
    tracker = RequestTracker()
    first = tracker.observe(finishing("a", 10.0), 10.0)
    assert [f.request_id for f in first.finished] == ["a"] and first.generation_tokens == 2
    again = tracker.observe(finishing("a", 11.0), 11.0)
    assert again.finished == [] and again.generation_tokens == 0
    assert tracker.num_live == 0
    other = tracker.observe(finishing("b", 11.0), 11.0)
    assert [f.request_id for f in other.finished] == ["b"]


def test_only_the_latest_finished_requests_are_remembered() -> None:
    tracker = RequestTracker()
    for i in range(REMEMBERED_FINISHED + 1):
        tracker.observe(finishing(str(i), 1.0), 1.0)
    assert tracker.observe(finishing("1", 2.0), 2.0).finished == []
    assert len(tracker.observe(finishing("0", 2.0), 2.0).finished) == 1  # forgotten
