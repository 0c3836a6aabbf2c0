"""The router's choices: longest remembered prefix first, then the most room; round robin."""

from __future__ import annotations

import pytest

from scheduler_svc.engine.router import AFFINITY_BLOCK, PrefixRouter, RoundRobinRouter

SYSTEM_A = list(range(100, 100 + 4 * AFFINITY_BLOCK))
SYSTEM_B = list(range(500, 500 + 4 * AFFINITY_BLOCK))


def test_a_shared_prefix_follows_the_first_request_whatever_the_room():
    router = PrefixRouter()
    first = router.choose([*SYSTEM_A, 1, 2, 3], {"x": 10, "y": 50})
    assert first == "y"  # nothing known yet: the most room
    router.record([*SYSTEM_A, 1, 2, 3], first)
    assert router.choose([*SYSTEM_A, 7, 8], {"x": 90, "y": 5}) == "y"
    assert router.choose([*SYSTEM_B, 7, 8], {"x": 90, "y": 5}) == "x"


def test_the_longest_prefix_wins_and_a_gone_executor_is_forgotten():
    router = PrefixRouter()
    router.record(SYSTEM_A[: 2 * AFFINITY_BLOCK], "x")
    router.record(SYSTEM_A, "y")  # the longer one, later: y holds every chunk now
    assert router.choose(SYSTEM_A, {"x": 50, "y": 1}) == "y"
    router.forget("y")
    assert router.choose(SYSTEM_A, {"x": 1, "z": 50}) == "z"  # x's chunks were taken by y
    assert router.choose(SYSTEM_A, {"x": 50, "y": 1}) == "x"


def test_an_executor_without_room_for_the_match_is_not_chosen_by_prefix():
    router = PrefixRouter()
    router.record(SYSTEM_A, "x")
    assert router.choose(SYSTEM_A, {"y": 3}) == "y"  # x is draining: not offered
    with pytest.raises(ValueError):
        router.choose(SYSTEM_A, {})


def test_round_robin_takes_each_executor_in_turn():
    router = RoundRobinRouter()
    picks = [router.choose(SYSTEM_A, {"x": 1, "y": 99}) for _ in range(4)]
    assert picks == ["x", "y", "x", "y"]
