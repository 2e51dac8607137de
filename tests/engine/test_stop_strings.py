"""Stop strings found with one alternation over the new text's window (serving.engine.stop_strings)
give exactly what a scan of the whole list gives (vLLM's check_stop_strings, this engine's rule
until issue 37): the occurrence ending in the new text that starts first, the first listed of
those starting there, and none wholly in the earlier text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.engine.stop_strings import StopStrings


def scan(text: str, new_chars: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The list scanned stop by stop: the rule the matcher keeps."""
    found: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if index >= 0 and (found is None or index < found[0]):
            found = (index, stop)
    return found


@pytest.mark.slow
@given(stops=st.lists(st.text(alphabet="ab.\\(*", min_size=1, max_size=4), min_size=1, max_size=6).map(tuple),
       text=st.text(alphabet="ab.\\(*", max_size=24), new=st.integers(min_value=0, max_value=24))
@settings(max_examples=2000, deadline=None)
def test_the_matcher_finds_what_a_scan_of_the_list_finds(stops: tuple[str, ...], text: str, new: int) -> None:
    new_chars = min(new, len(text))
    assert StopStrings(stops).find(text, new_chars) == scan(text, new_chars, stops)


def test_ties_go_to_the_first_listed_and_old_occurrences_do_not_count() -> None:
    assert StopStrings(("a", "ab")).find("xab", 2) == (1, "a")
    assert StopStrings(("ab", "a")).find("xab", 2) == (1, "ab")
    # "a" lies wholly in the earlier text (min_tokens kept it unchecked); "abc" ends in the new text.
    assert StopStrings(("a", "abc")).find("xabc", 2) == (1, "abc")
    assert StopStrings(("a",)).find("xa" + "b" * 5, 5) is None
    # Regex metacharacters are text.
    assert StopStrings((".*", "(")).find("no (match) .*", 13) == (3, "(")


def test_empty_stop_strings_are_refused() -> None:
    with pytest.raises(ValueError):
        StopStrings(("ok", ""))
    with pytest.raises(ValueError):
        StopStrings(())


class _Untouchable(tuple):
    def __iter__(self):
        raise AssertionError("a step walked the list of stop strings")


def test_a_step_does_not_walk_the_list() -> None:
    """Per step, one search of the compiled alternation: with 16 stop strings or 16,000, the list
    itself is read only for an occurrence wholly in the earlier text."""
    stops = tuple(f"<{index}>" for index in range(16_000))
    matcher = StopStrings(stops)
    matcher.stops = _Untouchable(stops)
    text = ""
    for piece in ("the ", "output ", "grows; ", "<159", "99> here"):
        text += piece
        found = matcher.find(text, len(piece))
    assert found == (len("the output grows; "), "<15999>")
