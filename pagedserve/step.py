"""One engine step as the executor receives it and what it answers: the contract between
the scheduler (which decides) and the executor (which computes), in process or over gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.sampling_params import SamplingParams

BlockPairs = list[tuple[int, int]]

# A block-table entry whose block went back to the pool: it lies wholly before the sliding
# window of every position still to be computed, so no kernel reads it (the scheduler frees
# such blocks only when every layer of the model slides; see BlockManager).
NO_BLOCK = -1


def num_freed(block_table: list[int]) -> int:
    """Leading entries of ``block_table`` that are ``NO_BLOCK``."""
    count = 0
    while count < len(block_table) and block_table[count] == NO_BLOCK:
        count += 1
    return count


@dataclass(slots=True)
class SeqStep:
    """One sequence of the step: compute K/V for ``new_token_ids`` at positions
    ``num_computed_tokens ..`` through ``block_table``, then draw ``num_samples`` tokens.

        positions:  0 .. num_computed_tokens-1 | num_computed_tokens .. +len(new_token_ids)-1
                    already in the cache        this step writes these slots and attends to all

    With ``num_steps`` k > 1 (one sample, no beams) the executor goes on decoding: each
    drawn token is fed back at the next position, k tokens in all, so one round trip to
    the scheduler serves k decode steps. The table then maps k - 1 more positions.

    A sequence that ``follows`` continues where the step before (``follows_step_id``)
    left it, sent before that step's answer came back: the executor fills in
    ``new_token_ids`` (the last token that step drew) and ``num_computed_tokens``, and
    the first ``table_start`` entries of ``block_table``, unchanged since that step: the
    wire carries only the blocks a decode step adds, not tables of hundreds of entries.

    With ``sampling_params.prompt_logprobs`` set and ``prompt_token_ids`` sent, the
    executor also scores the prompt: the logits at each new position p score the prompt
    token at p + 1, for every p + 1 < len(prompt_token_ids) (see ``num_prompt_scored``).
    """

    seq_id: int
    new_token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sampling_params: SamplingParams
    num_samples: int = 1
    # Seeds a per-sequence generator so a seeded request draws the same tokens whatever
    # else shares its batch: (seed, sample index, output length) fixes every draw.
    sample_index: int = 0
    # The full prompt, sent when a penalty or the prompt's scoring needs it; the output so
    # far, sent when a penalty or a grammar needs it.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_steps: int = 1
    follows: bool = False
    table_start: int = 0

    @property
    def context_len(self) -> int:
        return self.num_computed_tokens + len(self.new_token_ids)

    @property
    def num_prompt_scored(self) -> int:
        """Prompt tokens this step scores: those at positions num_computed_tokens + 1 ..,
        one per new position whose next token is still in the prompt.

            prompt:     t0  t1  t2  t3  t4          (len 5)
            chunk:          [p1  p2  p3]            (num_computed_tokens 1, 3 new)
            scores:             t2  t3  t4          logits at p score the token at p + 1
        """
        if self.sampling_params.prompt_logprobs is None:
            return 0
        num_left = len(self.prompt_token_ids) - 1 - self.num_computed_tokens
        return max(0, min(len(self.new_token_ids), num_left))

    def advance(self, token_id: int) -> SeqStep:
        """The next of ``num_steps`` decode steps: ``token_id`` (just drawn) goes in."""
        return SeqStep(
            seq_id=self.seq_id,
            new_token_ids=[token_id],
            num_computed_tokens=self.context_len,
            block_table=self.block_table,
            sampling_params=self.sampling_params,
            sample_index=self.sample_index,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=(
                [*self.output_token_ids, token_id]
                if self.sampling_params.needs_output_tokens
                else []
            ),
            num_steps=self.num_steps - 1,
        )


@dataclass(slots=True)
class ExecuteStep:
    """Cache operations, applied in this order before the forward pass, then the batch."""

    step_id: int
    epoch: int
    seqs: list[SeqStep]
    blocks_to_swap_out: BlockPairs = field(default_factory=list)  # (gpu, cpu)
    blocks_to_swap_in: BlockPairs = field(default_factory=list)  # (cpu, gpu)
    blocks_to_copy: BlockPairs = field(default_factory=list)  # (src, dst), gpu pool
    follows_step_id: int | None = None  # the step its ``follows`` sequences continue


@dataclass(slots=True)
class PromptLogprob:
    """How likely the model found one prompt token after the tokens before it: its
    logprob, its rank (1 + the number of other tokens at least as likely), and the top
    alternatives as ``{token_id: logprob}``, most likely first."""

    logprob: float
    rank: int
    top_logprobs: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class SeqOutput:
    """What was drawn for one sequence: ``num_samples`` tokens (or ``num_steps`` in a row)
    with their logprobs, and when asked for, the top alternatives of each draw as
    ``{token_id: logprob}``; and the prompt tokens the step scored, in order."""

    seq_id: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    # Left out of the step, why: its grammar does not compile or refuses its output.
    error: str = ""


@dataclass(slots=True)
class StepResult:
    step_id: int
    outputs: list[SeqOutput]


class ExecutorRestarted(RuntimeError):
    """The executor came back as a new process: its KV pool and swap pool are gone, so
    every sequence that had blocks there must be recomputed from its tokens."""

    def __init__(self, instance_id: str) -> None:
        super().__init__(f"executor restarted as instance {instance_id}")
        self.instance_id = instance_id
