"""A fake executor for scheduler tests: it stores each token id as that slot's "K/V".

Every step it applies the cache operations, writes the new tokens into their slots,
then reads each sequence back through its block table and asserts it sees exactly the
sequence's tokens, so a wrong table, a missed copy-on-write or a lost swap fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.step import NO_BLOCK, SeqOutput
from scheduler_svc.core.block_manager import BlockManager
from scheduler_svc.core.output_processor import OutputProcessor, num_samples
from scheduler_svc.core.scheduler import Scheduler, SchedulerOutput
from scheduler_svc.core.sequence import Sequence, SequenceGroup, SequenceStatus

EOS = 2


@dataclass
class FakeExecutor:
    block_manager: BlockManager
    eos_after: dict[str, int] = field(default_factory=dict)  # request_id -> output length
    steps: int = 0

    def __post_init__(self) -> None:
        bm = self.block_manager
        self.gpu = [[None] * bm.block_size for _ in range(bm.gpu.num_blocks)]
        self.cpu = [[None] * bm.block_size for _ in range(bm.cpu.num_blocks)]

    def execute(self, out: SchedulerOutput) -> list[dict[int, SeqOutput]]:
        """The samples of each decode step by seq_id: one step, or as many in a row as
        the scheduler mapped slots ahead for (each token fed back, as the executor does)."""
        self.steps += 1
        for gpu_block, cpu_block in out.blocks_to_swap_out:
            self.cpu[cpu_block] = list(self.gpu[gpu_block])
        for cpu_block, gpu_block in out.blocks_to_swap_in:
            self.gpu[gpu_block] = list(self.cpu[cpu_block])
        for src, dst in out.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        bm = self.block_manager
        runs = [
            _Run(
                s.group,
                seq,
                seq.get_token_ids()[: bm.num_slots(seq)],  # short of the length: a chunk
                seq.num_computed_tokens,
                max(1, bm.num_slots(seq) - seq.get_len() + 1),
            )
            for s in out.scheduled
            for seq in s.group.get_seqs(SequenceStatus.RUNNING)
        ]
        steps = []
        for index in range(max((run.num_steps for run in runs), default=1)):
            going = [run for run in runs if run.num_steps > index]
            for run in going:  # write every new token first, as each layer does
                self._write(run)
            samples = {}
            for run in going:  # then attend: read the context back (its sliding window)
                table = bm.get_block_table(run.seq)
                first = max(0, run.computed - bm.sliding_window + 1) if bm.sliding_window else 0
                seen = [self._read(table, pos) for pos in range(first, len(run.tokens))]
                assert seen == run.tokens[first:], f"seq {run.seq.seq_id} reads a corrupted cache"
                if len(run.tokens) < run.seq.get_len():
                    samples[run.seq.seq_id] = SeqOutput(run.seq.seq_id, [], [])
                    continue
                drawn = samples[run.seq.seq_id] = self._draw(run.group, run.seq, run.tokens)
                run.computed = len(run.tokens)
                run.tokens = [*run.tokens, drawn.token_ids[0]]
            steps.append(samples)
        return steps

    def _write(self, run: _Run) -> None:
        bs, table = self.block_manager.block_size, self.block_manager.get_block_table(run.seq)
        for pos in range(run.computed, len(run.tokens)):
            self.gpu[table[pos // bs]][pos % bs] = run.tokens[pos]

    def _read(self, table: list[int], pos: int) -> int | None:
        bs = self.block_manager.block_size
        assert table[pos // bs] != NO_BLOCK, f"position {pos} is read but its block was freed"
        return self.gpu[table[pos // bs]][pos % bs]

    def _draw(self, group: SequenceGroup, seq: Sequence, tokens: list[int]) -> SeqOutput:
        k = num_samples(group)
        base = 10 + (sum(tokens[-4:]) * 31 + len(tokens)) % 900
        token_ids = [base + i for i in range(k)]
        if len(tokens) - group.prompt_len + 1 == self.eos_after.get(group.request_id):
            token_ids[0] = EOS
        logprobs = [-0.1 * (i + 1) - (base % 7) * 0.01 for i in range(k)]
        return SeqOutput(seq.seq_id, token_ids, logprobs)


@dataclass
class _Run:
    """A sequence through the steps of one call: its tokens so far and those computed."""

    group: SequenceGroup
    seq: Sequence
    tokens: list[int]
    computed: int
    num_steps: int


def step(
    scheduler: Scheduler,
    processor: OutputProcessor,
    executor: FakeExecutor,
    whole_runs: bool = False,
) -> tuple[SchedulerOutput, list[SequenceGroup]]:
    """Schedule, execute and apply one call; returns it and the groups that finished.

    With ``whole_runs`` a call that may be is applied at once (OutputProcessor.process_run),
    as the engine does, rather than step by step."""
    out = scheduler.schedule()
    finished = list(out.ignored)
    steps = executor.execute(out)
    if whole_runs and processor.can_process_run(out):
        runs: dict[int, SeqOutput] = {}
        for samples in steps:
            for seq_id, drawn in samples.items():
                run = runs.setdefault(seq_id, SeqOutput(seq_id, [], []))
                run.token_ids += drawn.token_ids
                run.logprobs += drawn.logprobs
        return out, finished + processor.process_run(out, runs)
    for samples in steps:
        finished += processor.process(out, samples)
    return out, finished


def run_engine(
    scheduler: Scheduler, executor: FakeExecutor, max_steps: int = 10_000, whole_runs: bool = False
) -> tuple[list[SequenceGroup], list]:
    """Step until nothing is left; returns groups in finishing order and every step's output."""
    processor = OutputProcessor(scheduler, eos_token_id=EOS)
    finished: list[SequenceGroup] = []
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished, outputs
        out, done = step(scheduler, processor, executor, whole_runs)
        outputs.append(out)
        finished += done
        scheduler.block_manager.check_integrity()
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
