"""A fake executor for scheduler tests: it stores each token id as that slot's "K/V".

Every step it applies the cache operations, writes the new tokens into their slots,
then reads each sequence back through its block table and asserts it sees exactly the
sequence's tokens, so a wrong table, a missed copy-on-write or a lost swap fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.step import SeqOutput
from scheduler_svc.block_manager import BlockManager
from scheduler_svc.output_processor import OutputProcessor, num_samples
from scheduler_svc.scheduler import Scheduler, SchedulerOutput
from scheduler_svc.sequence import Sequence, SequenceGroup, SequenceStatus

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

    def execute(self, out: SchedulerOutput) -> dict[int, SeqOutput]:
        self.steps += 1
        for gpu_block, cpu_block in out.blocks_to_swap_out:
            self.cpu[cpu_block] = list(self.gpu[gpu_block])
        for cpu_block, gpu_block in out.blocks_to_swap_in:
            self.gpu[gpu_block] = list(self.cpu[cpu_block])
        for src, dst in out.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])
        seqs = [
            (s.group, seq)
            for s in out.scheduled
            for seq in s.group.get_seqs(SequenceStatus.RUNNING)
        ]
        bs = self.block_manager.block_size
        for _, seq in seqs:  # write every new token first, as each layer does
            table, tokens = self.block_manager.get_block_table(seq), seq.get_token_ids()
            for pos in range(seq.num_computed_tokens, seq.get_len()):
                self.gpu[table[pos // bs]][pos % bs] = tokens[pos]
        samples = {}
        for group, seq in seqs:  # then attend: read the whole context back
            table = self.block_manager.get_block_table(seq)
            seen = [self.gpu[table[pos // bs]][pos % bs] for pos in range(seq.get_len())]
            assert seen == seq.get_token_ids(), f"seq {seq.seq_id} reads a corrupted cache"
            samples[seq.seq_id] = self._draw(group, seq)
        return samples

    def _draw(self, group: SequenceGroup, seq: Sequence) -> SeqOutput:
        tokens = seq.get_token_ids()
        k = num_samples(group)
        base = 10 + (sum(tokens[-4:]) * 31 + len(tokens)) % 900
        token_ids = [base + i for i in range(k)]
        if len(tokens) - group.prompt_len + 1 == self.eos_after.get(group.request_id):
            token_ids[0] = EOS
        logprobs = [-0.1 * (i + 1) - (base % 7) * 0.01 for i in range(k)]
        return SeqOutput(seq.seq_id, token_ids, logprobs)


def run_engine(
    scheduler: Scheduler, executor: FakeExecutor, max_steps: int = 10_000
) -> tuple[list[SequenceGroup], list]:
    """Step until nothing is left; returns groups in finishing order and every step's output."""
    processor = OutputProcessor(scheduler, eos_token_id=EOS)
    finished: list[SequenceGroup] = []
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished, outputs
        out = scheduler.schedule()
        outputs.append(out)
        finished.extend(out.ignored)
        samples = executor.execute(out)
        finished.extend(processor.process(out, samples))
        scheduler.block_manager.check_integrity()
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
