"""A sequence's text, appended and cut at random, reads as the plain str it stands for."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from scheduler_svc.core.output_text import OutputText
from scheduler_svc.engine.detokenizer import find_stop

PIECES = st.text(alphabet="ab\n🦙", max_size=9)
OPS = st.lists(st.one_of(PIECES, st.integers(0, 60)), max_size=60)  # an int cuts there


@given(OPS, st.integers(-3, 70))
def test_appends_and_cuts_read_back_as_a_str(ops: list[str | int], start: int) -> None:
    text, plain = OutputText(), ""
    for op in ops:
        if isinstance(op, int):
            before = text.cuts
            text.cut(op)
            plain = plain[:op]
            assert text.cuts == before + 1
        else:
            text.append(op)
            plain += op
        assert len(text) == len(plain)
        assert text.since(start) == plain[max(start, 0) :]
    assert text == plain and str(text) == plain and text == OutputText(plain)
    text += "z"
    assert str(text) == plain + "z"


def test_a_long_text_stays_a_few_chunks() -> None:
    text = OutputText()
    for i in range(10_000):
        text.append(str(i % 10))
    assert len(text._chunks) <= 14  # one a power of two: log2(10,000) + 1
    assert text.since(9_990) == "0123456789"


@given(
    st.lists(PIECES, min_size=1, max_size=12),
    st.lists(st.text("ab🦙", min_size=1, max_size=4), min_size=1, max_size=3),
)
def test_a_stop_string_is_found_where_a_whole_str_search_finds_it(
    pieces: list[str], stop: list[str]
) -> None:
    """The stop search reads only the end of the text, and finds the first stop string
    the newest piece completes, as a search of the whole text would."""
    text, plain = OutputText(), ""
    for piece in pieces:
        text.append(piece)
        plain += piece
        cut = find_stop(text, len(piece), tuple(stop))
        completed = [
            i
            for s in stop
            if (i := plain.find(s, max(0, len(plain) - len(piece) - len(s) + 1))) != -1
        ]
        assert cut == (min(completed) if completed else None)
        if cut is not None:
            return
