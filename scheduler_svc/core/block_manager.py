"""Block tables of every sequence over the GPU and CPU pools: the paper's §4 memory manager."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedserve.settings import CacheConfig
from pagedserve.step import NO_BLOCK, num_freed
from scheduler_svc.core.block_allocator import BlockAllocator, BlockHash, BlockId, hash_block
from scheduler_svc.core.sequence import Sequence, SequenceGroup, SequenceStatus

BlockMapping = list[tuple[BlockId, BlockId]]


class AllocStatus(enum.Enum):
    """Answer of an admission check: fits now, fits once blocks free up, or never fits."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


@dataclass(slots=True)
class BlockManagerCounters:
    """Monotonic counters, read by metrics."""

    prefix_cache_queries: int = 0  # prompt tokens looked up
    prefix_cache_hits: int = 0  # prompt tokens found computed
    cow_copies: int = 0
    window_freed_blocks: int = 0  # table entries freed as they fell out of the window
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0


class BlockManager:
    """Maps each sequence's logical blocks to physical ones, allocating on demand.

    A running sequence's table holds GPU block ids, a swapped one's CPU block ids. A
    block shared by several tables (fork, prefix cache) has one reference per table.

    With ``sliding_window`` W > 0 (the model's every layer attends to at most the last W
    positions), a block that lies wholly before the window of the next position to compute
    goes back to the pool and its entry becomes ``NO_BLOCK``; entries keep their positions:

        positions:  0 .. 15 | 16 .. 31 | 32 .. 47 | 48 ..       block_size 16, W 20
        table:      NO_BLOCK  NO_BLOCK   b2         b3          next position 52 sees 33..52

    A model with any global layer (Gemma 3's) reads every position in that layer, so W is
    0 there and nothing is freed early: pools per layer group would be needed for that.
    """

    @classmethod
    def from_config(cls, config: CacheConfig) -> BlockManager:
        return cls(
            config.block_size,
            config.num_gpu_blocks,
            config.num_cpu_blocks,
            config.watermark,
            config.enable_prefix_caching,
            config.sliding_window,
        )

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        sliding_window: int = 0,
    ) -> None:
        if block_size < 1:  # CacheConfig limits users to 8-128; the paper's figures use 4
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")
        self.block_size = block_size
        self.gpu = BlockAllocator("gpu", num_gpu_blocks, enable_prefix_caching)
        self.cpu = BlockAllocator("cpu", num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.block_tables: dict[int, list[BlockId]] = {}
        self.counters = BlockManagerCounters()
        self._num_slots: dict[int, int] = {}  # token slots mapped per sequence
        self._hashes: dict[int, list[BlockHash]] = {}  # chained hashes of full blocks
        self._swapped: set[int] = set()  # sequences whose table holds CPU block ids
        # Times a table changed other than by taking free blocks: a table that stays gave
        # entries back (copy on write, a sliding window, slots mapped ahead unused, a swap,
        # a preemption), or a new one took a block that another holds (a prefix cache hit,
        # a fork). The journal writes every group after one (Journal.can_write_some).
        self.num_table_changes = 0

    # -- admission -------------------------------------------------------------------

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, group: SequenceGroup, step_tokens: int | None = None) -> AllocStatus:
        """Whether the waiting sequences fit, keeping the watermark free. With
        ``step_tokens`` (the most positions of a sequence one step computes, its prompt going
        in chunks) a sequence needs at most ``max_blocks_held`` blocks. No side effects."""
        required = total = 0
        reuse = not group.needs_prompt_logprobs
        for token_ids in self._distinct_prompts(group):
            hits = self._reusable_prefix(token_ids) if reuse else []
            num_blocks = self.blocks_for(len(token_ids))
            if step_tokens is not None:
                num_blocks = self.max_blocks_held(len(token_ids), step_tokens)
            total += num_blocks
            live = hits[self._num_outside_window(len(hits) * self.block_size) :]
            required += num_blocks - sum(self.gpu.ref_counts[b] > 0 for b in live)
        return self._admission(total, required)

    def max_blocks_held(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks a sequence of ``num_tokens`` holds at once when no step computes
        more than ``step_tokens`` of its positions: all of them, or under a sliding window
        those covering the window of a step's first position and the step's own (a span of
        W - 1 + step_tokens positions, one block more for where it starts)."""
        every = self.blocks_for(num_tokens)
        if self.sliding_window == 0:
            return every
        return min(every, self.blocks_for(self.sliding_window - 1 + step_tokens) + 1)

    def _admission(self, total: int, required: int) -> AllocStatus:
        """NEVER when ``total`` blocks exceed the pool less the watermark; OK when taking
        ``required`` more keeps the watermark free; LATER otherwise."""
        if total > self.gpu.num_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        if self.gpu.num_free_blocks - required >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup, max_new_tokens: int | None = None) -> int:
        """Map the waiting sequences' tokens, taking prefix-cached blocks where they match.

        Waiting sequences with the same tokens (a fresh prompt, before sampling forks it)
        share one table. With ``max_new_tokens`` only that many tokens past the cached
        prefix are mapped (the first chunk of a prompt computed in chunks; see
        ``map_chunk``). A prompt still to be scored takes no cached block: its positions'
        logits are needed. Mutates the GPU pool and sets each sequence's
        ``num_computed_tokens``.

        Returns:
            The number of tokens whose K/V was found in the cache.
        """
        tables: dict[tuple[int, ...], tuple[list[BlockId], int, int, list[BlockHash]]] = {}
        num_cached = 0
        reuse = not group.needs_prompt_logprobs
        for seq in group.get_seqs(SequenceStatus.WAITING):
            token_ids = seq.get_token_ids()
            key = tuple(token_ids)
            if key in tables:
                for block_id in _held(tables[key][0]):
                    self.gpu.incref(block_id)
            else:
                tables[key] = self._allocate_table(token_ids, max_new_tokens, reuse)
                num_cached += tables[key][1]
            table, seq.num_computed_tokens, num_slots, hashes = tables[key]
            self.block_tables[seq.seq_id] = list(table)
            self._num_slots[seq.seq_id] = num_slots
            self._hashes[seq.seq_id] = list(hashes)
        return num_cached

    def _allocate_table(
        self, token_ids: list[int], max_new_tokens: int | None, reuse: bool
    ) -> tuple[list[BlockId], int, int, list[BlockHash]]:
        """A new table for these tokens, how many leading tokens it found computed (none
        unless ``reuse``), how many slots it maps, and the hashes of the full blocks among
        them. Cached blocks wholly before the window of the first position to compute are
        not taken: their entries are NO_BLOCK from the start."""
        hits = self._reusable_prefix(token_ids) if reuse else []
        num_hit_tokens = len(hits) * self.block_size
        num_outside = self._num_outside_window(num_hit_tokens)
        for block_id in hits[num_outside:]:
            self.gpu.incref(block_id)
            if self.gpu.ref_counts[block_id] > 1:
                self.num_table_changes += 1
        num_slots = len(token_ids)
        if max_new_tokens is not None:
            num_slots = min(num_slots, num_hit_tokens + max_new_tokens)
        table = [NO_BLOCK] * num_outside + hits[num_outside:]
        self.counters.window_freed_blocks += num_outside
        for _ in range(self.blocks_for(num_slots) - len(hits)):
            table.append(self.gpu.allocate(after=_before(table, len(table))))
        # Only blocks this step fills are published: a later chunk's are not computed yet.
        hashes = self._chain_hashes(token_ids[:num_slots])
        for index, block_hash in enumerate(hashes[num_outside:], num_outside):
            self.gpu.register(table[index], block_hash, self._block_tokens(token_ids, index))
        if self.enable_prefix_caching and reuse:
            self.counters.prefix_cache_queries += len(token_ids)
            self.counters.prefix_cache_hits += num_hit_tokens
        return table, num_hit_tokens, num_slots, hashes

    def chunk_room(self, seq: Sequence) -> int:
        """Slots ``map_chunk`` can still add: the mapped tail block's and free blocks'."""
        table = self.block_tables[seq.seq_id]
        return (len(table) + self.gpu.num_free_blocks) * self.block_size - self._num_slots[
            seq.seq_id
        ]

    def map_chunk(self, seq: Sequence, num_tokens: int) -> None:
        """Map the next ``num_tokens`` prompt slots of a sequence computed in chunks (its
        mapped slots end where its computed tokens do)."""
        target = self._num_slots[seq.seq_id] + num_tokens
        if target > seq.get_len():
            raise ValueError(f"seq {seq.seq_id}: chunk past its {seq.get_len()} tokens")
        copy = self._map(seq, target)
        assert copy is None, "a sequence computed in chunks shares no partly filled block"

    # -- decode ----------------------------------------------------------------------

    def can_append_slots(self, group: SequenceGroup) -> bool:
        """Whether every running sequence can get a slot (worst case: one new block each)."""
        return self.gpu.num_free_blocks >= group.num_seqs(SequenceStatus.RUNNING)

    def append_slots(self, seq: Sequence, lookahead: int = 0) -> tuple[BlockId, BlockId] | None:
        """Map slots up to the sequence's length plus ``lookahead`` (the positions of
        decode steps run in a row), allocating a block only when the last one is full;
        a write into a shared block first moves it to a private copy.

        Returns:
            The copy-on-write ``(src, dst)`` the executor must apply before the step, or None.
        """
        return self._map(seq, seq.get_len() + lookahead)

    def map_ahead(self, targets: list[tuple[Sequence, int]]) -> bool:
        """Map each sequence's slots up to its target, for a call sent ahead of the one in
        flight, which made every tail private (no copy on write); False, changing nothing,
        unless all fit above the watermark."""
        tables = self.block_tables
        needed = sum(max(0, self.blocks_for(t) - len(tables[s.seq_id])) for s, t in targets)
        if self.gpu.num_free_blocks - needed < self.watermark_blocks:
            return False
        for seq, target in targets:
            copy = self._map(seq, target)
            assert copy is None, "the call in flight already made the tail private"
        return True

    def _map(self, seq: Sequence, target: int) -> tuple[BlockId, BlockId] | None:
        """Map slots up to ``target``, first freeing what fell out of the window; returns
        the copy on write it needed, if any."""
        self._free_outside_window(seq)
        table = self.block_tables[seq.seq_id]
        num_slots = self._num_slots[seq.seq_id]
        copy = None
        if self._writes_shared_tail(seq, target):
            last = table[-1]
            table[-1] = self.gpu.allocate(after=_before(table, len(table) - 1))
            self.gpu.free(last)
            self.counters.cow_copies += 1
            self.num_table_changes += 1
            copy = (last, table[-1])
        while len(table) < self.blocks_for(target):
            table.append(self.gpu.allocate(after=_before(table, len(table))))
        self._num_slots[seq.seq_id] = max(num_slots, target)
        self._register_full_blocks(seq, len(self._hashes[seq.seq_id]))
        return copy

    def _free_outside_window(self, seq: Sequence) -> None:
        """Give back the blocks wholly before the window of the sequence's next position
        to compute (``num_computed_tokens``): no query of this step or a later one reads
        them, a later prompt chunk's included. Only for a running sequence (GPU table).

            positions:   [ block i ][ block i+1 ] ... next position p
            window of p:              p - W + 1 ......... p
            freed:       block i, since (i + 1) * block_size <= p - W + 1
        """
        table = self.block_tables[seq.seq_id]
        # Freed entries are a leading run: walk back from the last one now outside.
        for index in reversed(range(self._num_outside_window(seq.num_computed_tokens))):
            if table[index] == NO_BLOCK:
                break
            self.gpu.free(table[index])
            table[index] = NO_BLOCK
            self.counters.window_freed_blocks += 1
            self.num_table_changes += 1

    def _num_outside_window(self, position: int) -> int:
        """Leading blocks wholly before the window of ``position``: no layer reads them
        from there on (0 without a window)."""
        if self.sliding_window == 0:
            return 0
        return max(0, position - self.sliding_window + 1) // self.block_size

    def unmap_ahead(self, seq: Sequence) -> None:
        """Give back the slots mapped for decode steps in a row that did not run (the call
        ended early), and any block only they used: the table ends at the last computed
        token again."""
        target = seq.get_len() - 1
        if self._num_slots[seq.seq_id] <= target:
            return
        table = self.block_tables[seq.seq_id]
        while len(table) > self.blocks_for(target):
            self.gpu.free(table.pop())
            self.num_table_changes += 1
        self._num_slots[seq.seq_id] = target

    def blocks_to_append(self, seq: Sequence, lookahead: int) -> int:
        """New blocks ``append_slots(seq, lookahead)`` would take, a copy on write included."""
        target = seq.get_len() + lookahead
        num_new = max(0, self.blocks_for(target) - len(self.block_tables[seq.seq_id]))
        return num_new + self._writes_shared_tail(seq, target)

    def _writes_shared_tail(self, seq: Sequence, target: int) -> bool:
        """Whether mapping slots up to ``target`` writes into a partly filled last block
        that another table shares (so it must be copied first)."""
        num_slots = self._num_slots[seq.seq_id]
        if num_slots >= target or num_slots % self.block_size == 0:
            return False
        return self.gpu.ref_counts[self.block_tables[seq.seq_id][-1]] > 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give the child the parent's table; every block gains a reference."""
        table = self.block_tables[parent.seq_id]
        for block_id in _held(table):
            self._pool_of(parent).incref(block_id)
        self.num_table_changes += 1
        self.block_tables[child.seq_id] = list(table)
        self._num_slots[child.seq_id] = self._num_slots[parent.seq_id]
        self._hashes[child.seq_id] = list(self._hashes[parent.seq_id])

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's table; blocks no other table holds go back to their pool."""
        table = self.block_tables.pop(seq.seq_id, None)
        if table is None:
            return
        if not seq.status.is_finished:  # preempted: its group stays, without the blocks
            self.num_table_changes += 1
        pool = self._pool_of(seq)
        for block_id in _held(table):
            pool.free(block_id)
        del self._num_slots[seq.seq_id]
        del self._hashes[seq.seq_id]
        self._swapped.discard(seq.seq_id)

    def num_slots(self, seq: Sequence) -> int:
        """Token slots the sequence's table maps (persisted with the table)."""
        return self._num_slots[seq.seq_id]

    def restore(
        self, seq: Sequence, block_table: list[BlockId], num_slots: int, on_cpu: bool
    ) -> None:
        """Re-create a persisted table after a restart; reference counts are derived
        from the tables, never loaded. Mutates the pool the table lives in."""
        pool = self.cpu if on_cpu else self.gpu
        for block_id in _held(block_table):
            pool.claim(block_id)
        self.block_tables[seq.seq_id] = list(block_table)
        self._num_slots[seq.seq_id] = num_slots
        self._hashes[seq.seq_id] = []
        if on_cpu:
            self._swapped.add(seq.seq_id)
        else:
            self._register_full_blocks(seq, 0)

    def fits_pool(self, block_table: list[BlockId], on_cpu: bool) -> bool:
        """Whether a persisted table can be restored: ids inside its pool, and ``NO_BLOCK``
        only as a leading run under a sliding window. No side effects."""
        num_blocks = (self.cpu if on_cpu else self.gpu).num_blocks
        held = _held(block_table)
        if len(held) < len(block_table) and self.sliding_window == 0:
            return False
        return all(0 <= b < num_blocks for b in held)

    def forget_cached(self) -> None:
        """Drop the prefix cache: the K/V it pointed at is gone with the executor."""
        self.gpu.forget_cached()

    # -- swapping --------------------------------------------------------------------

    def can_swap_out(self, group: SequenceGroup) -> bool:
        return len(self._group_blocks(group, SequenceStatus.RUNNING)) <= self.cpu.num_free_blocks

    def swap_out(self, group: SequenceGroup) -> BlockMapping:
        """Move every running sequence of the group to CPU blocks, all or nothing.

        Returns:
            ``(gpu_block, cpu_block)`` pairs, one per distinct block: a block shared
            inside the group is copied once and stays shared on the CPU.
        """
        mapping = self._move(group, SequenceStatus.RUNNING, self.gpu, self.cpu)
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            seq.status = SequenceStatus.SWAPPED
            self._swapped.add(seq.seq_id)
        self.counters.swapped_out_blocks += len(mapping)
        return mapping

    def can_swap_in(self, group: SequenceGroup) -> AllocStatus:
        """Whether the swapped group fits back with a slot to grow each sequence."""
        num_seqs = group.num_seqs(SequenceStatus.SWAPPED)
        required = len(self._group_blocks(group, SequenceStatus.SWAPPED)) + num_seqs
        return self._admission(required, required)

    def swap_in(self, group: SequenceGroup) -> BlockMapping:
        """Move every swapped sequence back to GPU blocks. Returns ``(cpu, gpu)`` pairs."""
        mapping = self._move(group, SequenceStatus.SWAPPED, self.cpu, self.gpu)
        for seq in group.get_seqs(SequenceStatus.SWAPPED):
            seq.status = SequenceStatus.RUNNING
            self._swapped.discard(seq.seq_id)
            self._register_full_blocks(seq, 0)
        self.counters.swapped_in_blocks += len(mapping)
        return mapping

    def _move(
        self, group: SequenceGroup, status: SequenceStatus, src: BlockAllocator, dst: BlockAllocator
    ) -> BlockMapping:
        moved: dict[BlockId, BlockId] = {}
        self.num_table_changes += 1
        for seq in group.get_seqs(status):
            table = self.block_tables[seq.seq_id]
            for index, block_id in enumerate(table):
                if block_id == NO_BLOCK:
                    continue
                if block_id in moved:
                    dst.incref(moved[block_id])
                else:
                    moved[block_id] = dst.allocate(after=_before(table, index))
                src.free(block_id)
                table[index] = moved[block_id]
        return list(moved.items())

    # -- accounting ------------------------------------------------------------------

    def get_block_table(self, seq: Sequence) -> list[BlockId]:
        return self.block_tables[seq.seq_id]

    def slot_utilization(self) -> float:
        """Filled token slots over allocated slots in the GPU pool (the paper's measure);
        a shared block counts once. 1.0 when nothing is allocated. Only a table's last
        filled block can be partly filled, so a table costs a few set operations (in C),
        not a Python loop over its blocks: metrics take this while the engine runs."""
        size = self.block_size
        held: set[BlockId] = set()
        full: set[BlockId] = set()
        tails: dict[BlockId, int] = {}  # partly filled block -> the most slots any table fills
        for seq_id, table in self.block_tables.items():
            if seq_id in self._swapped:
                continue
            held.update(table)
            num_full, tail = divmod(self._num_slots[seq_id], size)
            full.update(table[:num_full])
            if tail and num_full < len(table):
                tails[table[num_full]] = max(tails.get(table[num_full], 0), tail)
        held.discard(NO_BLOCK)
        if not held:
            return 1.0
        full.discard(NO_BLOCK)
        tails.pop(NO_BLOCK, None)
        filled = size * len(full) + sum(n for b, n in tails.items() if b not in full)
        return filled / (len(held) * size)

    def check_integrity(self) -> None:
        """Recompute every reference count from the tables and compare with the pools."""
        self.gpu.check_integrity()
        self.cpu.check_integrity()
        expected = {"gpu": [0] * self.gpu.num_blocks, "cpu": [0] * self.cpu.num_blocks}
        for seq_id, table in self.block_tables.items():
            assert len(table) == self.blocks_for(self._num_slots[seq_id]), f"seq {seq_id} table"
            held = _held(table)
            num_freed = len(table) - len(held)
            assert NO_BLOCK not in held, f"seq {seq_id}: freed entries after held ones"
            assert self.sliding_window or not num_freed, f"seq {seq_id}: freed without window"
            for block_id in held:
                expected["cpu" if seq_id in self._swapped else "gpu"][block_id] += 1
        assert expected["gpu"] == self.gpu.ref_counts, "gpu ref_counts differ from the tables"
        assert expected["cpu"] == self.cpu.ref_counts, "cpu ref_counts differ from the tables"

    # -- helpers ---------------------------------------------------------------------

    def _pool_of(self, seq: Sequence) -> BlockAllocator:
        return self.cpu if seq.seq_id in self._swapped else self.gpu

    def _group_blocks(self, group: SequenceGroup, status: SequenceStatus) -> set[BlockId]:
        return {b for seq in group.get_seqs(status) for b in _held(self.block_tables[seq.seq_id])}

    def _block_tokens(self, token_ids: list[int], index: int) -> list[int]:
        return token_ids[index * self.block_size : (index + 1) * self.block_size]

    def _chain_hashes(
        self, token_ids: list[int], start: int = 0, parent: BlockHash | None = None
    ) -> list[BlockHash]:
        """Hashes of the full blocks from ``start`` on, chained from ``parent``."""
        if not self.enable_prefix_caching:
            return []
        hashes = []
        for index in range(start, len(token_ids) // self.block_size):
            parent = hash_block(parent, self._block_tokens(token_ids, index))
            hashes.append(parent)
        return hashes

    def _reusable_prefix(self, token_ids: list[int]) -> list[BlockId]:
        """Cached GPU blocks for the longest run of leading blocks, stopping before the
        block of the last token: its logits are needed, so it is computed, and it must
        not be written into a shared block.

            tokens:  [ b0 full ][ b1 full ][ b2 full ]   last token in b2
            reuse:   [ b0 hit  ][ b1 hit  ]  b2 fresh
        """
        hits = []
        max_hits = (len(token_ids) - 1) // self.block_size
        for index, block_hash in enumerate(self._chain_hashes(token_ids)[:max_hits]):
            block_id = self.gpu.lookup(block_hash, self._block_tokens(token_ids, index))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _distinct_prompts(self, group: SequenceGroup) -> list[list[int]]:
        distinct = {tuple(s.get_token_ids()) for s in group.get_seqs(SequenceStatus.WAITING)}
        return [list(token_ids) for token_ids in distinct]

    def _register_full_blocks(self, seq: Sequence, start: int) -> None:
        """Hash the sequence's full blocks from ``start`` on and publish them for reuse."""
        # Slots mapped ahead for decode steps in a row hold no known token yet.
        num_full = min(self._num_slots[seq.seq_id], seq.get_len()) // self.block_size
        if not self.enable_prefix_caching or start >= num_full:
            return
        hashes = self._hashes[seq.seq_id]
        # The tokens of the blocks from the first to hash or register on (a copy of the
        # whole sequence, once a block fills, would cost its length).
        first = min(start, len(hashes))
        tokens = seq.get_token_ids_between(first * self.block_size, num_full * self.block_size)
        if len(hashes) < num_full:
            parent = hashes[-1] if hashes else None
            hashes.extend(self._chain_hashes(tokens, len(hashes) - first, parent))
        table = self.block_tables[seq.seq_id]
        for index in range(start, num_full):
            if table[index] != NO_BLOCK:
                block = self._block_tokens(tokens, index - first)
                self.gpu.register(table[index], hashes[index], block)


def _held(table: list[BlockId]) -> list[BlockId]:
    """The entries that hold a block: all but the leading run freed outside the window."""
    return table[num_freed(table) :]


def _before(table: list[BlockId], index: int) -> BlockId | None:
    """The block that entry ``index`` should follow physically, if the entry before holds one."""
    return table[index - 1] if index > 0 and table[index - 1] != NO_BLOCK else None
