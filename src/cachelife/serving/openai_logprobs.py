"""OpenAI's log-probabilities of a text answer: each new token's under the model's own raw distribution (before any
processor), from one forward over the prompt and the new tokens, shaped as a chat's or a completion's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from attrs import frozen

from cachelife.serving.openai_api import Tokenizer


@frozen
class TokenLogprob:
    """A new token's log-probability under the model, and the `top` likeliest tokens' at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(model: Any, prompt: Sequence[int], generated: Sequence[int], *, top: int) -> list[TokenLogprob]:
    """Each new token's log-probability under the model's own distribution (its raw logits, before any
    processor: what a sampler or a penalty changes is not in it), from one forward over the prompt and the new
    tokens, as transformers' `generate(output_logits=True)` gives it, log-softmaxed."""
    if not generated:
        return []
    ids = torch.tensor([[*prompt, *generated]], dtype=torch.long, device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    logprobs = logits[0, len(prompt) - 1 : -1].float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, ids[0, len(prompt) :, None])[:, 0].tolist()
    values, indices = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
    return [
        TokenLogprob(int(token), float(value), tuple(zip(indices[i].tolist(), values[i].tolist(), strict=True)))
        for i, (token, value) in enumerate(zip(generated, chosen, strict=True))
    ]


def logprobs_body(entries: Sequence[TokenLogprob], tokenizer: Tokenizer, *, chat: bool) -> dict[str, Any]:
    """OpenAI's `logprobs` of a choice: a chat's `content` list, or a completion's parallel lists."""

    def piece(token: int) -> str:
        return tokenizer.decode([token])

    if chat:
        content = [
            {"token": piece(e.token), "logprob": e.logprob, "bytes": list(piece(e.token).encode()),
             "top_logprobs": [{"token": piece(t), "logprob": v, "bytes": list(piece(t).encode())} for t, v in e.top]}
            for e in entries
        ]  # fmt: skip
        return {"content": content, "refusal": None}
    pieces = [piece(e.token) for e in entries]
    offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    return {
        "tokens": pieces, "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{piece(t): v for t, v in e.top} for e in entries], "text_offset": offsets,
    }  # fmt: skip
