"""Per-request output streams: what each step added to each output, numbered so that a
client (or a restarted scheduler) can resume right after the last event it saw."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import orjson

from pagedserve.step import PromptLogprob
from scheduler_svc.core.sequence import Sequence, SequenceGroup
from scheduler_svc.state.persistence import prompt_logprobs_from_list, prompt_logprobs_to_list


class EngineDeadError(RuntimeError):
    """The engine loop stopped; requests in flight cannot complete in this process."""


class RequestInFlightError(ValueError):
    """Another client is already streaming this request id."""


class RequestFailedError(RuntimeError):
    """The engine ended this request without a result; ``code`` says why for the client
    (``deadline_exceeded``, or ``request_failed``)."""

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(message)
        self.code = code or "request_failed"


class QueueFullError(RuntimeError):
    """Too many requests, or prompt tokens, already wait for a first step, or the wait
    would be too long: retry later. ``reason`` names which, for metrics."""

    def __init__(self, message: str, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class SeqDelta:
    """What one output (``index``) gained since the last event."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float]]
    finish_reason: str | None = None


@dataclass(slots=True)
class RequestDelta:
    """One event of a request's stream; ``event`` counts from 1 per request."""

    request_id: str
    prompt_len: int
    event: int = 0
    outputs: list[SeqDelta] = field(default_factory=list)
    finished: bool = False
    error: str | None = None  # why the request ended without a result (with finished)
    error_code: str | None = None  # that reason for clients: "deadline_exceeded", ...
    # Prompt tokens 1, 2, ... as scored, in the first event of a request that asked.
    prompt_logprobs: list[PromptLogprob] | None = None

    def to_json(self) -> str:
        # By field names: dataclasses.asdict deep-copies, and this runs for every request
        # of every step.
        outputs = []
        for out in self.outputs:
            data = {name: getattr(out, name) for name in _SEQ_DELTA_FIELDS}
            data["top_logprobs"] = [list(top.items()) for top in out.top_logprobs]
            outputs.append(data)
        data = {name: getattr(self, name) for name in _REQUEST_DELTA_FIELDS}
        if self.prompt_logprobs is not None:
            data["prompt_logprobs"] = prompt_logprobs_to_list(self.prompt_logprobs)
        return orjson.dumps(data | {"outputs": outputs}).decode()

    @classmethod
    def from_json(cls, text: str) -> RequestDelta:
        data = orjson.loads(text)
        outputs = []
        for out in data.pop("outputs"):
            out["top_logprobs"] = [dict(map(tuple, top)) for top in out["top_logprobs"]]
            outputs.append(SeqDelta(**out))
        if data.get("prompt_logprobs") is not None:
            data["prompt_logprobs"] = prompt_logprobs_from_list(data["prompt_logprobs"])
        return cls(**data, outputs=outputs)


@dataclass(slots=True)
class Choice:
    """One output accumulated from its deltas. Its text is kept in parts and joined when
    read: a long answer comes in thousands of deltas, and adding each to one string would
    copy the string each time."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        if len(self.parts) > 1:
            self.parts[:] = ["".join(self.parts)]
        return self.parts[0] if self.parts else ""

    def add(self, out: SeqDelta | Choice) -> None:
        self.parts.append(out.text)
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        self.top_logprobs += out.top_logprobs
        self.finish_reason = out.finish_reason or self.finish_reason


_SEQ_DELTA_FIELDS = tuple(f.name for f in dataclasses.fields(SeqDelta))
_REQUEST_DELTA_FIELDS = tuple(
    f.name for f in dataclasses.fields(RequestDelta) if f.name not in ("outputs", "prompt_logprobs")
)


class StreamTracker:
    """Remembers how much of each sequence was already sent, to cut the next delta."""

    def __init__(self) -> None:
        # seq_id -> (tokens sent, characters of text sent, finish sent)
        self._sent: dict[int, tuple[int, int, bool]] = {}
        self._events: dict[str, int] = {}  # request_id -> events so far

    def restore(self, group: SequenceGroup, num_events: int) -> None:
        """After a restart: everything the group holds was already committed as events."""
        self._events[group.request_id] = num_events
        for seq in group.seqs:
            sent = (len(seq.output_token_ids), len(seq.output_text), seq.status.is_finished)
            self._sent[seq.seq_id] = sent

    def has_events(self, request_id: str) -> bool:
        """Whether the request made an event here (or before a restart)."""
        return request_id in self._events

    def forget(self, group: SequenceGroup) -> int:
        """Stop tracking a group handed to another engine; returns its events so far."""
        for seq in group.seqs:
            self._sent.pop(seq.seq_id, None)
        return self._events.pop(group.request_id, 0)

    def failed(
        self,
        request_id: str,
        prompt_len: int,
        error: str,
        num_events: int = 0,
        code: str | None = None,
    ) -> RequestDelta:
        """The last event of a request the engine had to drop, saying why; ``num_events``:
        the events it had before it came here."""
        event = max(self._events.pop(request_id, 0), num_events) + 1
        return RequestDelta(
            request_id, prompt_len, event, finished=True, error=error, error_code=code
        )

    def delta(self, group: SequenceGroup, finished: bool) -> RequestDelta | None:
        """The group's next event: its outputs' tokens and text since the last one, or None
        when it has nothing new. Forgets a finished group."""
        out = RequestDelta(group.request_id, group.prompt_len, finished=finished)
        params = group.sampling_params
        if params.use_beam_search or params.width > params.n:
            if finished:  # only the final ranking is meaningful
                out.outputs = [_whole(i, s) for i, s in enumerate(group.outputs())]
        else:
            for index, seq in enumerate(group.seqs):
                seq_delta = self._seq_delta(index, seq)
                if seq_delta is not None:
                    out.outputs.append(seq_delta)
        if finished:
            for seq in group.seqs:
                self._sent.pop(seq.seq_id, None)
        if not out.outputs and not finished:
            return None
        out.event = self._events.get(group.request_id, 0) + 1
        if out.event == 1 and group.sampling_params.prompt_logprobs is not None:
            out.prompt_logprobs = group.prompt_logprobs  # scored whole before any output
        if finished:
            self._events.pop(group.request_id, None)
        else:
            self._events[group.request_id] = out.event
        return out

    def _seq_delta(self, index: int, seq: Sequence) -> SeqDelta | None:
        sent, chars, finish_sent = self._sent.get(seq.seq_id, (0, 0, False))
        ends_now = seq.status.is_finished and not finish_sent
        if sent == len(seq.output_token_ids) and not ends_now:
            return None
        # A stop string may cut text that went out already: then nothing more goes.
        text = seq.output_text
        self._sent[seq.seq_id] = (len(seq.output_token_ids), len(text), seq.status.is_finished)
        return SeqDelta(
            index,
            text.since(chars),
            seq.output_token_ids[sent:],
            seq.output_logprobs[sent:],
            seq.output_top_logprobs[sent:],
            seq.status.finish_reason,
        )


def _whole(index: int, seq: Sequence) -> SeqDelta:
    return SeqDelta(
        index,
        str(seq.output_text),
        list(seq.output_token_ids),
        list(seq.output_logprobs),
        list(seq.output_top_logprobs),
        seq.status.finish_reason,
    )
