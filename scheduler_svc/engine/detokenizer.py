"""Incremental detokenization and stop strings: text grows per token, never re-decoded whole."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

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
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decode = _decoder(tokenizer)

    def update(self, seq: Sequence) -> str:
        """Decode the sequence's unread tokens; mutates its text and offsets. Returns the delta.

        The tokens of several decode steps are decoded together; when they end inside a
        character, one at a time, so that the complete characters before it go out now.
        """
        end = len(seq.output_token_ids)
        delta = self._read_to(seq, end)
        if delta or end - seq.read_offset <= 1:
            return delta
        return "".join(self._read_to(seq, stop) for stop in range(seq.read_offset + 1, end + 1))

    def _read_to(self, seq: Sequence, end: int) -> str:
        ids = seq.output_token_ids
        prefix = self._decode(ids[seq.prefix_offset : seq.read_offset])
        full = self._decode(ids[seq.prefix_offset : end])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        seq.output_text += delta
        seq.prefix_offset = seq.read_offset
        seq.read_offset = end
        return delta


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """Decoding without special tokens. Twice per token of every running sequence, so a
    Hugging Face fast tokenizer that cleans up no spaces is called in its Rust backend
    directly, which gives the same text without the wrapper's per-call argument handling."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, True)


def find_stop(text: str, new_len: int, stop: tuple[str, ...]) -> int | None:
    """Where ``text`` must be cut for the first stop string that its last ``new_len``
    characters complete, or None. Earlier text was checked before."""
    cut = None
    for s in stop:
        start = max(0, len(text) - new_len - len(s) + 1)
        index = text.find(s, start)
        if index != -1 and (cut is None or index < cut):
            cut = index
    return cut
