"""Incremental detokenization and stop strings: text grows per token, never re-decoded whole."""

from __future__ import annotations

from typing import Any, Protocol

from tokenizers.decoders import DecodeStream

from scheduler_svc.core.output_text import OutputText
from scheduler_svc.core.sequence import Sequence


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class Detokenizer:
    """Appends each sequence's new text to ``seq.output_text``.

    A token's text can depend on its neighbours (byte fallback, leading spaces), so the new
    text is the decoded window from ``prefix_offset`` minus that window without the new
    tokens; a window that ends in an incomplete UTF-8 character waits for the next token.

        output ids: ..... [prefix_offset ...... read_offset | new tokens ]
                           already emitted, kept as context   text to emit

    New tokens go through the sequence's ``DecodeStream`` of Hugging Face tokenizers,
    which keeps that window and its text in Rust: the same text for half the work, one
    call for all of them (calls that share a commit are detokenized together). Its state
    is not persisted: it is rebuilt from the offsets.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._backend = _backend(tokenizer)
        if self._backend is None:
            self._decode = lambda ids: tokenizer.decode(ids, True)
        else:
            backend = self._backend
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=True)

    def update(self, seq: Sequence) -> str:
        """Decode the sequence's unread tokens; mutates its text and offsets. Returns the delta.

        The tokens of several decode steps are decoded together; when they end inside a
        character, one at a time, so that the complete characters before it go out now.
        """
        end = len(seq.output_token_ids)
        if self._backend is not None and end > seq.read_offset:
            delta = self._step(seq)
            if delta is not None:
                return delta
        seq.decoder = None  # its window is behind the offsets now
        delta = self._read_to(seq, end)
        if delta or end - seq.read_offset <= 1:
            return delta
        return "".join(self._read_to(seq, stop) for stop in range(seq.read_offset + 1, end + 1))

    def _step(self, seq: Sequence) -> str | None:
        """The new tokens through the stream; None, the offsets and text unchanged, when
        their text ends inside a character or does not extend the window's (the caller then
        drops the stream and reads them by windows)."""
        ids = seq.output_token_ids
        if seq.decoder is None:
            window = ids[seq.prefix_offset : seq.read_offset]
            seq.decoder = DecodeStream(ids=window, skip_special_tokens=True)
        new = ids[seq.read_offset :]
        try:
            delta = seq.decoder.step(self._backend, new if len(new) > 1 else new[0])
        except Exception:  # a window whose text does not begin with its prefix's
            return None
        if delta is None:
            return None
        seq.output_text.append(delta)
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
        return delta

    def _read_to(self, seq: Sequence, end: int) -> str:
        ids = seq.output_token_ids
        prefix = self._decode(ids[seq.prefix_offset : seq.read_offset])
        full = self._decode(ids[seq.prefix_offset : end])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        seq.output_text.append(delta)
        seq.prefix_offset = seq.read_offset
        seq.read_offset = end
        return delta


def _backend(tokenizer: Any) -> Any:
    """A Hugging Face fast tokenizer's Rust backend where it decodes as the tokenizer does
    (no spaces cleaned up): decoding runs for every token of every running sequence, and
    the backend skips the wrapper's per-call argument handling."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend
    return None


def find_stop(text: OutputText, new_len: int, stop: tuple[str, ...]) -> int | None:
    """Where ``text`` must be cut for the first stop string that its last ``new_len``
    characters complete, or None. Earlier text was checked before, so only the end that
    a stop string could reach into is read."""
    start = max(0, len(text) - new_len - max(map(len, stop)) + 1)
    end = text.since(start)
    cut = None
    for s in stop:
        index = end.find(s, max(0, len(end) - new_len - len(s) + 1))
        if index != -1 and (cut is None or index < cut):
            cut = index
    return None if cut is None else start + cut
