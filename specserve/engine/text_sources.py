"""Which characters of a request's text came from accepted draft tokens.

A request's text grows token by token; each token is either a draft token the target accepted
or a token the target produced itself (bonus / recovered / plain). ``TextSources`` keeps that
origin as runs over the text, so a client can colour the streamed text by where it came from
(the playground) without a tokenizer. Work per appended token is O(1); a slice costs the number
of runs it covers. The engine keeps one over a request's unsent text only (output_processor).
"""

from __future__ import annotations


class TextSources:
    """Runs ``(end offset, from_draft)`` covering ``text[0:end]`` in order, adjacent runs
    always of different origin. Offsets are Python string indices (code points)."""

    def __init__(self) -> None:
        self.ends: list[int] = []
        self.flags: list[bool] = []

    @property
    def length(self) -> int:
        return self.ends[-1] if self.ends else 0

    def extend(self, new_length: int, from_draft: bool) -> None:
        """The text grew to ``new_length`` characters, all from one token of this origin."""
        if new_length <= self.length:
            return
        if self.flags and self.flags[-1] == from_draft:
            self.ends[-1] = new_length
        else:
            self.ends.append(new_length)
            self.flags.append(from_draft)

    def truncate(self, new_length: int) -> None:
        """The text was cut (a stop string matched) to ``new_length`` characters."""
        while self.ends and (len(self.ends) > 1 and self.ends[-2] >= new_length):
            self.ends.pop()
            self.flags.pop()
        if self.ends:
            self.ends[-1] = min(self.ends[-1], new_length)
            if self.ends[-1] == 0:
                self.ends.pop()
                self.flags.pop()

    def drop_prefix(self, n: int) -> None:
        """The first ``n`` characters are gone (sent): offsets shift down by ``n``. Costs the
        number of runs kept, which a stream's unsent text bounds."""
        kept = [(e - n, f) for e, f in zip(self.ends, self.flags) if e > n]
        self.ends, self.flags = [e for e, _ in kept], [f for _, f in kept]

    def spans(self, start: int, end: int) -> list[tuple[int, bool]]:
        """``text[start:end]`` as (length, from_draft) runs, in order."""
        out: list[tuple[int, bool]] = []
        i = len(self.ends) - 1
        while i >= 0 and end > start:  # walk back from the tail: deltas sit at the end
            run_start = self.ends[i - 1] if i > 0 else 0
            a, b = max(run_start, start), min(self.ends[i], end)
            if b > a:
                out.append((b - a, self.flags[i]))
            if run_start <= start:
                break
            i -= 1
        out.reverse()
        return out
