"""Requests as the scheduler sees them: sampling parameters, sequences and sequence groups."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedserve.sampling_params import SamplingParams
from pagedserve.step import PromptLogprob
from scheduler_svc.core.output_text import OutputText


class SequenceStatus(enum.IntEnum):
    """Persisted as an int; the FINISHED_* values are terminal."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED  # hundreds of times a step: no lookup through the class

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = frozenset(s for s in SequenceStatus if s >= SequenceStatus.FINISHED_STOPPED)
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


@dataclass(slots=True)
class Sequence:
    """One token stream; ``num_computed_tokens`` counts tokens whose K/V is in the cache."""

    seq_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    num_computed_tokens: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    output_text: OutputText = field(default_factory=OutputText)  # a str is taken too
    prefix_offset: int = 0  # detokenizer window, see scheduler_svc/engine/detokenizer.py
    read_offset: int = 0
    # That window in the tokenizer's own streaming decoder; rebuilt from the offsets, so
    # not persisted (TRANSIENT) nor compared.
    decoder: Any = field(default=None, compare=False, repr=False)

    TRANSIENT: ClassVar[frozenset[str]] = frozenset({"decoder"})

    def __post_init__(self) -> None:
        if isinstance(self.output_text, str):  # read back from JSON
            self.output_text = OutputText(self.output_text)

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def get_token_ids_between(self, start: int, end: int) -> list[int]:
        """``get_token_ids()[start:end]`` without joining the whole sequence: a decode
        step takes one token of thousands."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    def append_token(
        self, token_id: int, logprob: float = 0.0, top_logprobs: dict[int, float] | None = None
    ) -> None:
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprob)
        self.cumulative_logprob += logprob
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)

    def fork(self, seq_id: int) -> Sequence:
        """A copy under a new id, sharing nothing mutable with this one."""
        return Sequence(
            seq_id,
            list(self.prompt_token_ids),
            list(self.output_token_ids),
            self.status,
            self.cumulative_logprob,
            self.num_computed_tokens,
            list(self.output_logprobs),
            list(self.output_top_logprobs),
            OutputText(str(self.output_text)),
            self.prefix_offset,
            self.read_offset,
        )


@dataclass(slots=True)
class SequenceGroup:
    """One request: its sequences (samples or beams) are scheduled and preempted together.

    A group starts with one sequence; after the prompt's step the output processor forks
    it into the ``width`` samples or beams, which then share the prompt's blocks.
    """

    request_id: str
    seqs: list[Sequence]
    arrival_time: float
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    num_preemptions: int = 0
    # How the model scored prompt tokens 1, 2, ... (token 0 has nothing before it), when
    # the request asked for prompt_logprobs; kept across preemptions, never scored twice.
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.seqs[0].prompt_token_ids) if self.seqs else 0

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt tokens wait to be scored: their positions must then be computed,
        not taken from the prefix cache, which holds K/V but no logits."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.prompt_len - 1

    def add_prompt_logprobs(self, first: int, scored: list[PromptLogprob]) -> None:
        """Keep what ``scored`` (prompt tokens ``first``, ``first + 1``, ...) adds to the
        tokens scored so far: a prompt recomputed after a preemption is scored again."""
        have = len(self.prompt_logprobs) + 1  # the first position not scored yet
        assert first <= have, f"prompt tokens {have}..{first - 1} of {self.request_id} unscored"
        self.prompt_logprobs += scored[have - first :]

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        seqs = self.seqs
        if status is None:
            return list(seqs)
        if len(seqs) == 1:  # most groups, several times a step each: no comprehension
            return [seqs[0]] if seqs[0].status == status else []
        return [seq for seq in seqs if seq.status == status]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs[0].status in _FINISHED
        return all(seq.status in _FINISHED for seq in seqs)

    def outputs(self) -> list[Sequence]:
        """The ``n`` sequences to return: best beams by length-normalised score, best of
        ``best_of`` samples by cumulative logprob, else all samples in order."""
        params = self.sampling_params
        if params.use_beam_search:
            penalty = params.length_penalty

            def key(s: Sequence) -> float:
                return s.cumulative_logprob / max(len(s.output_token_ids), 1) ** penalty
        elif params.width > params.n:

            def key(s: Sequence) -> float:
                return s.cumulative_logprob
        else:
            return self.seqs[: params.n]
        return sorted(self.seqs, key=key, reverse=True)[: params.n]

    def max_num_running_seqs(self) -> int:
        """Upper bound on sequences this group will run at once (for the seq budget)."""
        if self.seqs and self.seqs[0].status == SequenceStatus.WAITING:
            return self.sampling_params.width
        return self.num_seqs(SequenceStatus.RUNNING) + self.num_seqs(SequenceStatus.SWAPPED)
