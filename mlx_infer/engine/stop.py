"""Stop strings over a stream of text deltas.

Text that might be the start of a stop string is held back until the next delta settles it,
so a stop string spanning two tokens is caught and never emitted.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stop: list[str], include_stop: bool = False):
        """``include_stop``: the text ends after the stop string reached rather than before it (vLLM's
        include_stop_str_in_output)."""
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop
        self._held = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was reached)."""
        if not self.stop:
            return delta, False
        text = self._held + delta
        hits = [(i, len(s)) for i, s in ((text.find(s), s) for s in self.stop) if i >= 0]
        if hits:
            self._held = ""
            at, length = min(hits)
            return text[: at + length if self.include_stop else at], True
        hold = max((self._partial_suffix(text, s) for s in self.stop), default=0)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        text, self._held = self._held, ""
        return text

    @staticmethod
    def _partial_suffix(text: str, stop: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
        for n in range(min(len(text), len(stop) - 1), 0, -1):
            if text.endswith(stop[:n]):
                return n
        return 0
