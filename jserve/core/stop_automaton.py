"""One Aho-Corasick automaton over a request's stop strings (pure Python, no jax).

Why an automaton: searching each new token's text for every stop string, and scanning the
text's end for a partial match of each, costs O(stop strings x their length) per token, and a
search from the text's start costs O(text) more. The automaton reads each new character once,
whatever the number of stop strings and the length of the text so far: a state is the longest
end of the text read that begins some stop string, so it also says how much text to hold back.
It is built once per request and never changes, so the request's `n` samples share it; each
keeps only its state, an int.

Why not pyahocorasick: it can search text fed in pieces, but does not expose the state's depth,
which is the held-back length here; without it each step would scan the text's end again.
"""

from __future__ import annotations

from collections.abc import Sequence

ROOT = 0  # the state of a text with no end that begins a stop string


class StopStringAutomaton:
    """The automaton of `stop_strings` (non-empty strings, any Unicode).

    States are ints; `advance` feeds text from a state, `held_back` reads a state's partial
    match. Matching is exact and case-sensitive, character by character.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if not all(stop_strings):
            raise ValueError(f"stop strings must be non-empty, got {list(stop_strings)!r}")
        self.stop_strings = tuple(stop_strings)
        self._goto: list[dict[str, int]] = [{}]
        depth, spelled_by = [0], [-1]  # spelled_by: the first stop string equal to the state
        for index, stop in enumerate(self.stop_strings):
            state = ROOT
            for char in stop:
                following = self._goto[state].get(char)
                if following is None:
                    following = self._goto[state][char] = len(self._goto)
                    self._goto.append({})
                    depth.append(depth[state] + 1)
                    spelled_by.append(-1)
                state = following
            if spelled_by[state] == -1:
                spelled_by[state] = index
        self._link_failures(depth, spelled_by)

    def _link_failures(self, depth: list[int], spelled_by: list[int]) -> None:
        """Failure links, breadth first, and what each state means for stopping.

        `_fail[s]`: the state of the longest proper end of s's text that begins a stop string.
        `_held[s]`: the longest end of s's text that is a proper beginning of a stop string.
        `_match[s]`: (length, index) of the longest stop string that ends s's text, or None;
        the longest one starts first, and among equal strings the first listed is named.
        """
        goto = self._goto
        self._fail = fail = [ROOT] * len(goto)
        self._held = held = [0] * len(goto)
        self._match = match = [None] * len(goto)
        order = [ROOT]
        for state in order:  # grows while iterated: breadth-first order
            for char, child in goto[state].items():
                if state != ROOT:
                    link = fail[state]
                    while char not in goto[link] and link != ROOT:
                        link = fail[link]
                    fail[child] = goto[link].get(char, ROOT)
                order.append(child)
            # fail[state] is shallower, so its entries are already final.
            held[state] = depth[state] if goto[state] else held[fail[state]]
            own = spelled_by[state]
            match[state] = (depth[state], own) if own != -1 else match[fail[state]]

    def advance(
        self, state: int, text: str, report: bool = True
    ) -> tuple[int, tuple[int, int] | None]:
        """Feed `text` from `state`: returns the new state and, if `report`, the match ending in
        `text` that starts first, as (its start relative to `text`'s start, which is negative
        when it began in earlier text; its index in `stop_strings`), else None.

        Costs O(len(text)) amortized over a whole stream of calls: each character moves one
        step deeper, and each failure link followed moves at least one step back up.
        """
        goto, fail, match = self._goto, self._fail, self._match
        best: tuple[int, int] | None = None
        for position, char in enumerate(text, 1):
            following = goto[state].get(char)
            while following is None and state != ROOT:
                state = fail[state]
                following = goto[state].get(char)
            state = ROOT if following is None else following
            if report and (found := match[state]) is not None:
                candidate = (position - found[0], found[1])
                if best is None or candidate < best:
                    best = candidate
        return state, best

    def held_back(self, state: int) -> int:
        """Length of the longest end of the text read that is a proper beginning of a stop
        string: the text that a later character could still turn into a stop string."""
        return self._held[state]
