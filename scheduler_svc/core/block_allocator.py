"""A fixed pool of physical KV blocks on one device: free list, reference counts, prefix cache."""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Sequence

BlockId = int
BlockHash = int


class NoFreeBlocksError(RuntimeError):
    """Raised when a pool has neither a free block nor an evictable cached one."""


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Content hash of a full block chained with its parent's, stable across processes.

    Python's ``hash`` is salted per process; the hash is persisted and compared by a
    restarted scheduler, so it comes from blake2b instead.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update((parent_hash if parent_hash is not None else 0).to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    return int.from_bytes(h.digest(), "little")


class BlockAllocator:
    """Hands out block ids of one device pool and tracks who holds them.

    A block is in exactly one of three places: the free list, held (ref_count > 0),
    or cached-and-idle (ref_count == 0 but its content hash is still registered, so a
    later prompt with the same prefix can take it back). Cached-idle blocks are evicted
    least recently freed first, only when the free list is empty.

    A table grows through ``allocate(after=its last block)``, which takes the block right
    after when it is free and otherwise starts a fresh run of ``RUN`` free blocks, so a
    sequence's K/V lies in physically contiguous runs, which the memory system streams
    faster than scattered blocks.
    """

    RUN = 8

    def __init__(self, device: str, num_blocks: int, enable_caching: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.device = device
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self._free: set[BlockId] = set(range(num_blocks))
        # Heaps over the free blocks and the wholly free runs, lowest first; an entry whose
        # block or run was taken since stays until it surfaces and is skipped there.
        self._lowest: list[BlockId] = list(range(num_blocks))
        num_runs = -(-num_blocks // self.RUN)
        self._run_free: list[int] = [self._run_size(run) for run in range(num_runs)]
        self._free_runs: list[int] = list(range(num_runs))
        self._evictable: OrderedDict[BlockId, None] = OrderedDict()
        self._hash_to_block: dict[BlockHash, BlockId] = {}
        self._block_to_hash: dict[BlockId, BlockHash] = {}
        self._block_tokens: dict[BlockId, tuple[int, ...]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out: free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, after: BlockId | None = None) -> BlockId:
        """Take a block with ref_count 1: the one after ``after`` when free, else the first of
        a wholly free run, else the lowest free one, else the least recently freed cached
        block (evicted). Raises NoFreeBlocksError when none exists."""
        if self._free:
            if after is not None and after + 1 in self._free:
                block_id = after + 1
            else:
                block_id = self._first_of_free_run()
                if block_id is None:
                    block_id = self._lowest_free()
            self._take(block_id)
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            self._forget(block_id)
        else:
            raise NoFreeBlocksError(f"no free {self.device} block among {self.num_blocks}")
        self.ref_counts[block_id] = 1
        return block_id

    def claim(self, block_id: BlockId) -> None:
        """Add a holder to a specific block, taking it from the free list if need be.

        Only for rebuilding the pools from persisted block tables after a restart.
        """
        if self.ref_counts[block_id] == 0 and block_id not in self._evictable:
            self._take(block_id)
            self.ref_counts[block_id] = 1
        else:
            self.incref(block_id)

    def incref(self, block_id: BlockId) -> None:
        """Add a holder; revives a cached-idle block."""
        if self.ref_counts[block_id] == 0:
            if block_id not in self._evictable:
                raise ValueError(f"{self.device} block {block_id} is free, not shareable")
            del self._evictable[block_id]
        self.ref_counts[block_id] += 1

    def free(self, block_id: BlockId) -> None:
        """Drop one holder; at zero the block returns to the pool (kept cached if hashed)."""
        if self.ref_counts[block_id] <= 0:
            raise ValueError(f"double free of {self.device} block {block_id}")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if block_id in self._block_to_hash:
                self._evictable[block_id] = None
            else:
                self._give(block_id)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> BlockId | None:
        """A cached block holding exactly these tokens after this chain, or None."""
        block_id = self._hash_to_block.get(block_hash)
        if block_id is None or self._block_tokens[block_id] != tuple(token_ids):
            return None
        return block_id

    def register(self, block_id: BlockId, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Publish a full, held block under its content hash (no-op with caching off or
        when another block already serves that hash)."""
        if not self.enable_caching or block_hash in self._hash_to_block:
            return
        if block_id in self._block_to_hash:
            return
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash
        self._block_tokens[block_id] = tuple(token_ids)

    def forget_cached(self) -> None:
        """Unpublish every hash; idle cached blocks become plain free blocks."""
        for block_id in self._evictable:
            self._give(block_id)
        self._evictable.clear()
        self._hash_to_block.clear()
        self._block_to_hash.clear()
        self._block_tokens.clear()

    def is_cached(self, block_id: BlockId) -> bool:
        return block_id in self._block_to_hash

    def cached_block_ids(self) -> list[BlockId]:
        """Blocks published under a content hash, held or idle (a copy, for readers)."""
        return list(self._block_to_hash)

    def _run_size(self, run: int) -> int:
        return min(self.RUN, self.num_blocks - run * self.RUN)

    def _take(self, block_id: BlockId) -> None:
        self._free.remove(block_id)
        self._run_free[block_id // self.RUN] -= 1

    def _give(self, block_id: BlockId) -> None:
        self._free.add(block_id)
        heapq.heappush(self._lowest, block_id)
        run = block_id // self.RUN
        self._run_free[run] += 1
        if self._run_free[run] == self._run_size(run):
            heapq.heappush(self._free_runs, run)
        # Stale entries pile up for blocks taken by ``after``: rebuild before they dominate.
        if len(self._lowest) > 2 * len(self._free) + self.RUN:
            self._lowest = sorted(self._free)
        if len(self._free_runs) > 2 * len(self._run_free):
            self._free_runs = sorted(set(self._free_runs))

    def _first_of_free_run(self) -> BlockId | None:
        while self._free_runs:
            run = self._free_runs[0]
            if self._run_free[run] == self._run_size(run):
                return run * self.RUN
            heapq.heappop(self._free_runs)
        return None

    def _lowest_free(self) -> BlockId:
        while self._lowest[0] not in self._free:
            heapq.heappop(self._lowest)
        return self._lowest[0]

    def _forget(self, block_id: BlockId) -> None:
        del self._hash_to_block[self._block_to_hash.pop(block_id)]
        del self._block_tokens[block_id]

    def check_integrity(self) -> None:
        """Every block is in exactly one state; the hash maps mirror each other."""
        free = self._free
        for run, count in enumerate(self._run_free):
            in_run = range(run * self.RUN, run * self.RUN + self._run_size(run))
            assert count == len(free.intersection(in_run)), f"run {run} miscounts its free blocks"
        for block_id, ref_count in enumerate(self.ref_counts):
            assert ref_count >= 0, f"negative ref_count on block {block_id}"
            states = (ref_count > 0) + (block_id in free) + (block_id in self._evictable)
            assert states == 1, f"{self.device} block {block_id} is in {states} states"
        for block_id in self._evictable:
            assert block_id in self._block_to_hash, f"evictable block {block_id} has no hash"
        for block_hash, block_id in self._hash_to_block.items():
            assert self._block_to_hash[block_id] == block_hash
            assert block_id not in free, f"free block {block_id} is still published"
