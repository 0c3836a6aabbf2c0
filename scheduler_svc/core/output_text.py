"""A sequence's generated text: a token's piece appended each step, the whole read rarely."""

from __future__ import annotations


class OutputText:
    """Text that grows at its end and is cut only at a stop string.

    A ``str`` grows by copying itself, so appending a token's piece to the text of a long
    generation cost the whole text, for every running sequence at every step (at 256
    sequences of 2,000 tokens, a tenth of the scheduler's time). Here the text is a few
    chunks, merged like a binary counter (a chunk absorbs the one after it once that is as
    long): an append copies a character O(log n) times over its life, ``since`` copies
    about what it returns, and reading the whole joins the chunks once.

    ``cuts`` counts the cuts: a reader that kept this object and a length knows the text
    up to that length is unchanged while ``cuts`` is (the journal's deltas).
    """

    __slots__ = ("_chunks", "_len", "cuts")

    def __init__(self, text: str = "") -> None:
        self._chunks = [text] if text else []
        self._len = len(text)
        self.cuts = 0

    def append(self, piece: str) -> None:
        if not piece:
            return
        chunks = self._chunks
        chunks.append(piece)
        self._len += len(piece)
        while len(chunks) > 1 and len(chunks[-2]) <= len(chunks[-1]):
            last = chunks.pop()
            chunks[-1] += last

    def __iadd__(self, piece: str) -> OutputText:
        self.append(piece)
        return self

    def since(self, start: int) -> str:
        """The text from character ``start`` on."""
        need = self._len - max(start, 0)
        if need <= 0:
            return ""
        chunks = self._chunks
        index, taken = len(chunks), 0
        while taken < need:
            index -= 1
            taken += len(chunks[index])
        first = chunks[index][taken - need :]
        return first + "".join(chunks[index + 1 :]) if index + 1 < len(chunks) else first

    def cut(self, end: int) -> None:
        """Keep the first ``end`` characters."""
        text = str(self)[:end]
        self._chunks = [text] if text else []
        self._len = len(text)
        self.cuts += 1

    def __str__(self) -> str:
        chunks = self._chunks
        if len(chunks) > 1:
            chunks[:] = ["".join(chunks)]
        return chunks[0] if chunks else ""

    def __len__(self) -> int:
        return self._len

    def __eq__(self, other: object) -> bool:
        if isinstance(other, OutputText | str):
            return len(other) == self._len and str(self) == str(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return repr(str(self))
