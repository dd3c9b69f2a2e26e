"""N-gram / prompt-lookup drafting: guess the next tokens by finding the sequence's own recent
tokens earlier in its prompt or output and copying what followed them there.

Rewrites, code edits, quoting and extraction repeat long stretches of the prompt, so the tokens
that followed an earlier occurrence of the last few tokens are often the next ones (vLLM's
`prompt_lookup_max` / `prompt_lookup_min`, llama.cpp's lookup decoding). The drafts are
deterministic (one-hot q): verify them with `verify.verify_sampled(..., draft_logits=None)`.

Cost: stateless, one backward scan over the last `window` tokens per call. Candidates are found
with `list.index` (C speed) on the newest token; each candidate's match is extended to at most
`max_n` tokens and the scan stops at the first `max_n`-token match. So a call costs
O(window * max_n + K), independent of the context length, and nothing needs rolling back when
drafts are rejected (an incremental n-gram index would be O(1) per call but must be kept in step
with every accepted and rejected token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramProposer:
    """Proposes up to K next tokens from the most recent earlier occurrence of the last n tokens,
    trying n from `max_n` down to `min_n`; looks back at most `window` tokens."""

    max_n: int = 4
    min_n: int = 1
    window: int = 1024

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram sizes min_n={self.min_n}, max_n={self.max_n} must satisfy "
                             "1 <= min_n <= max_n")
        if self.window < 1:
            raise ValueError(f"n-gram lookup window={self.window} must be at least 1 token")

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Draft up to `k` tokens to follow `token_ids` (prompt + output so far).

        Takes: the sequence's ids (any sliceable sequence; only its last `window + 1` ids are read)
        and k >= 0. Gives: the tokens that followed the chosen earlier occurrence, at most k and
        never past the end of `token_ids` (so possibly fewer); [] when no earlier occurrence of
        the last `min_n` tokens lies in the window. Chosen occurrence: the longest match of the
        sequence's tail (up to `max_n` tokens), the most recent among equally long ones.
        """
        if k <= 0 or len(token_ids) < 2:
            return []
        tail = list(token_ids[-(self.window + 1):])        # the window, then the newest token
        end, length = self._best_match(tail)
        if length < self.min_n:
            return []
        return tail[end + 1:end + 1 + k]

    def _best_match(self, tail: list[int]) -> tuple[int, int]:
        """(end, length): the earlier position `end` < len(tail) - 1 whose preceding tokens match
        the tail's last `length` tokens, longest first (capped at max_n), most recent first."""
        newest = len(tail) - 1
        earlier = tail[newest - 1::-1]                     # earlier[j] = tail[newest - 1 - j]
        best_end, best_length, j = -1, 0, 0
        while True:
            try:
                j = earlier.index(tail[newest], j)
            except ValueError:
                return best_end, best_length
            end = newest - 1 - j
            length = self._match_length(tail, end, newest)
            if length > best_length:
                best_end, best_length = end, length
                if length == self.max_n:
                    return best_end, best_length
            j += 1

    def _match_length(self, tail: list[int], end: int, newest: int) -> int:
        """How many tokens (at most max_n) ending at `end` equal those ending at `newest`."""
        length = 1                                         # tail[end] == tail[newest] already
        while length < self.max_n and end - length >= 0 and tail[end - length] == tail[newest - length]:
            length += 1
        return length
