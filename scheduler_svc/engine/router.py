"""Which executor a new sequence group goes to: the one that holds the longest prefix of its
prompt (so shared system prompts hit one prefix cache), then the one with most room.
Round robin, the baseline the routing benchmark compares with, ignores both."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Mapping
from typing import Protocol

from scheduler_svc.core.block_allocator import BlockHash, hash_block

AFFINITY_BLOCK = 16  # tokens per hashed chunk: affinity only, independent of any pool


class Router(Protocol):
    def choose(self, prompt: list[int], room: Mapping[str, int]) -> str:
        """The executor for ``prompt`` among ``room`` (executor -> free blocks, net of what
        is already queued there). Raises ValueError when ``room`` is empty."""
        ...

    def record(self, prompt: list[int], lane: str) -> None:
        """``prompt`` went to ``lane``."""
        ...

    def forget(self, lane: str) -> None:
        """``lane`` is gone."""
        ...


class PrefixRouter:
    """Remembers which executor each recently routed prompt chunk went to (bounded LRU)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[BlockHash, str] = OrderedDict()

    def choose(self, prompt: list[int], room: Mapping[str, int]) -> str:
        if not room:
            raise ValueError("no executor to route to")
        owner, matched = None, 0
        for chunk_hash in _chunk_hashes(prompt):
            lane = self._owner.get(chunk_hash)
            if lane is None or lane not in room or (owner is not None and lane != owner):
                break
            owner, matched = lane, matched + 1
        if owner is not None and matched > 0:
            return owner
        return max(room, key=lambda name: (room[name], name))

    def record(self, prompt: list[int], lane: str) -> None:
        for chunk_hash in _chunk_hashes(prompt):
            self._owner[chunk_hash] = lane
            self._owner.move_to_end(chunk_hash)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, lane: str) -> None:
        for chunk_hash in [h for h, owner in self._owner.items() if owner == lane]:
            del self._owner[chunk_hash]


class RoundRobinRouter:
    """Each executor in turn, whatever the prompt or the room."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, prompt: list[int], room: Mapping[str, int]) -> str:
        if not room:
            raise ValueError("no executor to route to")
        names = sorted(room)
        return names[next(self._turn) % len(names)]

    def record(self, prompt: list[int], lane: str) -> None:
        pass

    def forget(self, lane: str) -> None:
        pass


ROUTERS = {"prefix": PrefixRouter, "round-robin": RoundRobinRouter}


def _chunk_hashes(prompt: list[int]) -> list[BlockHash]:
    hashes, parent = [], None
    for start in range(0, len(prompt) - AFFINITY_BLOCK + 1, AFFINITY_BLOCK):
        parent = hash_block(parent, prompt[start : start + AFFINITY_BLOCK])
        hashes.append(parent)
    return hashes
