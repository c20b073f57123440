"""transformers' `NoRepeatNGramLogitsProcessor` with an n-gram size of each row's own, as tensor operations.

For a row of `length` tokens and size `n`, transformers bans every token that completed an n-gram whose first
`n - 1` tokens are the row's last `n - 1`: the n-grams are those wholly inside the row's tokens (left padding
included, as `generate` passes it), and a row shorter than `n` bans nothing. Here every row's windows are compared
at once, up to `LONGEST_NGRAM` tokens long (a static bound, so that one compiled step serves every size up to it);
a row of size 0 bans nothing.
"""

from __future__ import annotations

from typing import Final

import torch

# The longest n-gram the engine's per-row pipeline bans; a longer one runs a program of its own.
LONGEST_NGRAM: Final = 8


def banned_ngrams(tokens: torch.Tensor, length: torch.Tensor, size: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) bool: the tokens each row may not pick next. `tokens` (rows, width) holds each row's tokens
    from column 0, `length` (rows, 1) their count and `size` (rows, 1) the row's n-gram size (0: none)."""
    rows, width = tokens.shape
    last = width - 1
    starts = torch.arange(width, device=tokens.device)[None, :]
    # A window starting at `starts` lies wholly inside the row's tokens.
    matches = (size > 0) & (starts + size <= length)
    for offset in range(LONGEST_NGRAM - 1):
        window = tokens.gather(1, (starts + offset).clamp(max=last).expand(rows, width))
        tail = tokens.gather(1, (length - size + 1 + offset).clamp(0, last))
        matches = matches & ((offset >= size - 1) | (window == tail))
    following = tokens.gather(1, (starts + size - 1).clamp(0, last))
    hits = torch.zeros(rows, vocab + 1, dtype=torch.bool, device=tokens.device)
    hits = hits.scatter(1, torch.where(matches, following.clamp(max=vocab), vocab), True)
    return hits[:, :vocab]
