"""Finding a request's stop strings in its output as it grows, at a cost set by the new text, not
by the number of stop strings.

A scan of the list costs a `str.find` per stop string per step: with 95,000 of them one request
held the engine's step for everyone (issue 37). Here the list is one compiled alternation of the
escaped strings, searched once per step over the window where an occurrence can end in the new
text: the new characters and the `max_len - 1` before them. (The request caps bound the list too:
serving.contracts.request_caps.)

The answer is the one a scan of the list gives (vLLM's `check_stop_strings`): among occurrences
that end within the new text, the one that starts first; of those starting at one place, the
first listed. An alternation tries its branches in order, so at each place the regex finds the
first listed stop that matches there. Only when that one ends before the new text (an occurrence
wholly in the earlier text, which `min_tokens` left unchecked) are the others tried at that place.
"""

from __future__ import annotations

import re


class StopStrings:
    def __init__(self, stops: tuple[str, ...]) -> None:
        if not stops or not all(stops):
            raise ValueError("stop strings are non-empty, and at least one is needed")
        self.stops = stops
        self.max_len = max(len(stop) for stop in stops)
        self._pattern = re.compile("|".join(re.escape(stop) for stop in stops))

    def find(self, text: str, new_chars: int) -> tuple[int, str] | None:
        """The earliest stop string ending within the last `new_chars` characters of `text`:
        `(index where it starts, the stop string)`, or None."""
        boundary = len(text) - new_chars  # an occurrence must end after this index
        position = max(0, boundary - self.max_len + 1)
        while (match := self._pattern.search(text, position)) is not None:
            start = match.start()
            if match.end() > boundary:
                return start, match.group()
            found = next((stop for stop in self.stops if start + len(stop) > boundary and text.startswith(stop, start)),
                         None)
            if found is not None:
                return start, found
            position = start + 1
        return None
