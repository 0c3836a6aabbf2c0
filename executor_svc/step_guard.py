"""What the executor checks before a step touches the pools: limits, and replay / epoch order."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.model_info import ModelInfo
from pagedserve.step import BlockPairs, ExecuteStep, SeqStep, StepResult, num_freed


class InvalidArgument(ValueError):
    """The request itself is wrong (an id outside its range, bad parameters)."""


class PreconditionFailed(Exception):
    """The request does not fit the executor's state: a step from a fenced epoch or out
    of order, or pools not allocated yet."""


def validate_pairs(pairs: BlockPairs, field: str, num_src: int, num_dst: int) -> None:
    """Raise InvalidArgument naming ``field`` when a ``(src, dst)`` id is outside its pool."""
    for index, (src, dst) in enumerate(pairs):
        for side, block_id, limit in (("src", src, num_src), ("dst", dst, num_dst)):
            if not 0 <= block_id < limit:
                raise InvalidArgument(
                    f"{field}[{index}].{side}: block id {block_id} outside [0, {limit})"
                )


def validate_step(step: ExecuteStep, info: ModelInfo) -> None:
    """Raise InvalidArgument, naming the field and the limit, for anything that would index
    outside the pools, the vocabulary or the model's length, or ask for more work than a
    step over these pools can hold; mutates nothing. A sequence that ``follows`` is checked
    as sent: its position and the entries it keeps come when the step it follows has run
    (``validate_followers``). Called as the step is read, while the step before it runs."""
    gpu, cpu = info.num_gpu_blocks, info.num_cpu_blocks
    validate_pairs(step.blocks_to_swap_out, "blocks_to_swap_out", gpu, cpu)
    validate_pairs(step.blocks_to_swap_in, "blocks_to_swap_in", cpu, gpu)
    validate_pairs(step.blocks_to_copy, "blocks_to_copy", gpu, gpu)
    first_index: dict[int, int] = {}
    for index, seq in enumerate(step.seqs):
        _validate_seq(seq, index, info)
        # Outputs, grammar state and refusals are keyed by seq_id: two would be confused.
        if (first := first_index.setdefault(seq.seq_id, index)) != index:
            raise InvalidArgument(f"seqs[{index}].seq_id: {seq.seq_id} already in seqs[{first}]")
    # Two writes to one slot in a step would lose one, so no valid step writes more. A
    # follower writes one new token (filled in later) per step.
    num_writes = sum(max(len(seq.new_token_ids), 1) + seq.num_steps - 1 for seq in step.seqs)
    num_slots = gpu * info.block_size
    if num_writes > num_slots:
        raise InvalidArgument(f"seqs: {num_writes} positions written > {num_slots} slots")


def validate_followers(step: ExecuteStep, info: ModelInfo) -> None:
    """What filling in the followers decided: each one's positions, and the entries its
    window lets be freed (its table's first entries are those of the step it follows)."""
    for index, seq in enumerate(step.seqs):
        if seq.follows:
            _validate_positions(seq, index, info)
            _validate_freed(seq, index, info)


def _validate_seq(seq: SeqStep, index: int, info: ModelInfo) -> None:
    if seq.table_start and not seq.follows:
        raise InvalidArgument(f"seqs[{index}].table_start: only a sequence that follows")
    _validate_samples(seq, index, info)
    if seq.follows:
        # Sent before its position and its table's first entries are known (see
        # validate_followers): the entries sent hold blocks, but for the leading ones
        # freed of a whole table, which its window decides.
        start = 0 if seq.table_start else num_freed(seq.block_table)
        _check_range(
            seq.block_table,
            index,
            "block_table",
            "block id",
            info.num_gpu_blocks,
            start,
            origin=seq.table_start,
        )
    else:
        _validate_positions(seq, index, info)
        freed = _validate_freed(seq, index, info)
        _check_range(seq.block_table, index, "block_table", "block id", info.num_gpu_blocks, freed)
    _check_range(seq.new_token_ids, index, "new_token_ids", "token id", info.vocab_size)
    _check_range(seq.prompt_token_ids, index, "prompt_token_ids", "token id", info.vocab_size)
    _check_range(seq.output_token_ids, index, "output_token_ids", "token id", info.vocab_size)
    num_history = len(seq.prompt_token_ids) + len(seq.output_token_ids)
    if num_history > info.max_model_len:
        raise InvalidArgument(
            f"seqs[{index}]: {num_history} prompt and output tokens > max_model_len "
            f"{info.max_model_len}"
        )


def _validate_samples(seq: SeqStep, index: int, info: ModelInfo) -> None:
    """A group runs only if each of its samples or beams can own two blocks (see
    Scheduler.check_fits), so no valid step draws more samples, or beam candidates (two
    per beam), than the pool has blocks. None is drawn for a prompt chunk short of the
    prompt's end, which then runs one step."""
    if not 0 <= seq.num_samples <= info.num_gpu_blocks:
        raise InvalidArgument(
            f"seqs[{index}].num_samples: {seq.num_samples} outside [0, num_gpu_blocks "
            f"{info.num_gpu_blocks}]"
        )
    if seq.num_samples == 0 and seq.num_steps > 1:
        raise InvalidArgument(
            f"seqs[{index}].num_steps: {seq.num_steps} steps in a row draw nothing"
        )
    if seq.sampling_params.use_beam_search and seq.num_samples > info.vocab_size:
        raise InvalidArgument(
            f"seqs[{index}].num_samples: {seq.num_samples} beams > vocab_size {info.vocab_size}"
        )
    if seq.num_steps < 1:
        raise InvalidArgument(f"seqs[{index}].num_steps: {seq.num_steps} < 1")
    if seq.follows and (seq.num_samples != 1 or seq.sampling_params.use_beam_search):
        raise InvalidArgument(
            f"seqs[{index}].follows: a sequence that follows draws one sample, no beams"
        )
    if seq.num_steps > 1 and (seq.num_samples > 1 or seq.sampling_params.use_beam_search):
        raise InvalidArgument(
            f"seqs[{index}].num_steps: {seq.num_steps} steps in a row need one sample and no beams"
        )


def _validate_positions(seq: SeqStep, index: int, info: ModelInfo) -> None:
    """Every position the sequence writes lies below max_model_len and in a mapped block,
    and the table maps no more blocks than a sequence of max_model_len tokens needs."""
    if not seq.new_token_ids:
        raise InvalidArgument(
            f"seqs[{index}].new_token_ids: empty, a step needs at least one new token"
        )
    if seq.num_computed_tokens < 0:
        raise InvalidArgument(
            f"seqs[{index}].num_computed_tokens: negative position {seq.num_computed_tokens}"
        )
    last_len = seq.context_len + seq.num_steps - 1  # positions written by the last step
    if last_len > info.max_model_len:
        raise InvalidArgument(
            f"seqs[{index}]: last position {last_len - 1} >= max_model_len {info.max_model_len}"
        )
    num_blocks, block_size = len(seq.block_table), info.block_size
    if num_blocks * block_size < last_len:
        raise InvalidArgument(
            f"seqs[{index}].block_table: {num_blocks} blocks hold {num_blocks * block_size} slots, "
            f"positions need {last_len}"
        )
    max_blocks = -(-info.max_model_len // block_size)
    if num_blocks > max_blocks:
        raise InvalidArgument(
            f"seqs[{index}].block_table: {num_blocks} blocks > {max_blocks} for max_model_len "
            f"{info.max_model_len}"
        )


def _validate_freed(seq: SeqStep, index: int, info: ModelInfo) -> int:
    """Leading entries may be NO_BLOCK (freed) only where every layer slides, and only as
    far as they lie wholly before the window of the step's first new token, which reaches
    back furthest. Returns their number."""
    freed = num_freed(seq.block_table)
    first_seen = seq.num_computed_tokens - info.sliding_window + 1
    num_outside = max(0, first_seen) // info.block_size if info.sliding_window else 0
    if freed > num_outside:
        raise InvalidArgument(
            f"seqs[{index}].block_table[{freed - 1}]: freed (-1), but position "
            f"{seq.num_computed_tokens} attends to it (sliding_window {info.sliding_window}, "
            "0: every position)"
        )
    return freed


def _check_range(
    values: list[int],
    index: int,
    field: str,
    what: str,
    limit: int,
    start: int = 0,
    origin: int = 0,
) -> None:
    """Raise InvalidArgument naming the first of ``values[start:]`` outside [0, limit), as
    entry ``origin`` + its index of the field (a follower's table is sent from there on)."""
    rest = values[start:] if start else values
    if rest and (min(rest) < 0 or max(rest) >= limit):
        first = origin + start
        at, value = next((i, v) for i, v in enumerate(rest, first) if not 0 <= v < limit)
        raise InvalidArgument(f"seqs[{index}].{field}[{at}]: {what} {value} outside [0, {limit})")


@dataclass(slots=True)
class _Applied:
    step_id: int
    epoch: int
    fingerprint: bytes  # of the step's content, epoch excluded
    result: StepResult


# Applied steps a ledger keeps: the calls a scheduler may have on the wire at once.
KEPT_STEPS = 3


class StepLedger:
    """The newest epoch seen and the last three applied steps with their results (a
    scheduler that sends steps before the one before them has answered may resend all
    three: docs/architecture.md, "Async scheduling").

    A step ``(epoch e, step_id s)`` is judged against the newest epoch seen ``E`` and the
    last applied step ``(e0, s0)``, in this order:

    1. ``e < E``: refused -- a fenced scheduler from an older epoch.
    2. ``s`` is one of the kept steps' ids, with the same content: a replay; the
       stored result is answered and nothing is applied. This holds in a newer epoch too,
       so a restarted scheduler that replays its pending step gets the result its
       predecessor lost, and the step then counts as that epoch's last applied one.
    3. ``e == e0`` and ``s <= s0``: refused -- out of order, or an id reused for
       different content.
    4. Otherwise the step is applied. A new epoch may restart its step ids anywhere.

    Judging changes nothing: ``E`` rises only when a step is applied (``record``),
    answered as a replay (``adopt``) or a new leader fences (``fence``), so a call refused
    for any reason fences no one.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self._kept: list[_Applied] = []  # oldest first, at most KEPT_STEPS

    def judge(self, step_id: int, epoch: int, fingerprint: bytes) -> StepResult | None:
        """Return the stored result of a replay, or None for a step to apply; mutates nothing.

        Raises PreconditionFailed by rules 1 and 3.
        """
        if epoch < self.epoch:
            raise PreconditionFailed(f"epoch {epoch} is older than the newest seen, {self.epoch}")
        if not self._kept:
            return None
        for kept in self._kept:
            if step_id == kept.step_id and fingerprint == kept.fingerprint:
                return kept.result
        last = self._kept[-1]
        if epoch == last.epoch and step_id <= last.step_id:
            reason = "reused with different content" if step_id == last.step_id else "out of order"
            raise PreconditionFailed(
                f"step {step_id} of epoch {epoch}: {reason}, last applied is {last.step_id}"
            )
        return None

    def fence(self, epoch: int) -> int | None:
        """A new leader's fence: ``epoch`` becomes the newest seen, so no step of an older
        one is applied after this. Returns the last applied step id (None: none yet).

        Raises PreconditionFailed for an epoch older than the newest seen (changes nothing).
        """
        if epoch < self.epoch:
            raise PreconditionFailed(f"epoch {epoch} is older than the newest seen, {self.epoch}")
        self.epoch = epoch
        return self._kept[-1].step_id if self._kept else None

    def adopt(self, step_id: int, epoch: int, fingerprint: bytes) -> StepResult:
        """Answer a replay of ``step_id`` judged in ``epoch``: in a newer epoch the step
        becomes that epoch's last one, and ``epoch`` the newest seen."""
        kept = next(k for k in self._kept if (k.step_id, k.fingerprint) == (step_id, fingerprint))
        if epoch > kept.epoch:
            kept.epoch = epoch
            self._kept = [kept]  # the others belong to the old epoch's order
        self.epoch = max(self.epoch, epoch)
        return kept.result

    def record(
        self, step_id: int, epoch: int, fingerprint: bytes, result: StepResult
    ) -> list[_Applied]:
        """Remember an applied step and its result (the last ``KEPT_STEPS`` are kept), and
        its epoch as the newest seen. Returns what is no longer kept, for the caller to let
        go of off the step's path: a result holds objects for every sequence."""
        kept = [*self._kept, _Applied(step_id, epoch, fingerprint, result)]
        self._kept, dropped = kept[-KEPT_STEPS:], kept[:-KEPT_STEPS]
        self.epoch = max(self.epoch, epoch)
        return dropped
