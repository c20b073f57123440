"""Why torch skipped CUDA graphs, and what fixes it.

When inductor decides not to run a compiled graph under CUDA graphs it logs one line, "skipping cudagraphs
due to <reason>", to the `cudagraphs` artifact logger of `torch._inductor.cudagraph_utils`, and bumps
`counters["inductor"]["cudagraph_skips"]`. `SkipLog` keeps the last of those lines, so that the decoding guard
can name the reason torch gave, not a guess, and the fix that matches it.

The compile-cache advice (a graph compiled earlier over caches that were not marked static, loaded from the
compile cache: torch 2.11 and 2.12 leave static inputs out of the cache key) is given only for "mutated
inputs" on those torch versions, when every managed cache layer still holds its pinned tensors.
`SkipReporter` is what the decoding guard warns with after a compiled forward call.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Final

import torch
from attrs import define, field, frozen
from torch._dynamo.utils import counters

# Where torch logs the skip: `cudagraphs_log` (2.11 and later); `perf_hint_log` in earlier releases.
_TORCH_LOGGERS: Final = (
    "torch._inductor.cudagraph_utils.__cudagraphs",
    "torch._inductor.cudagraph_utils.__perf_hints",
)
_PREFIX: Final = "skipping cudagraphs due to "
logger = logging.getLogger(__name__)
_KEPT: Final = 64


@frozen
class Advice:
    """What a skip reason means for a cachelife user, and the fix."""

    cause: str
    fix: str


# (fragment of torch's reason, advice); the first match wins.
_ADVICE: Final[tuple[tuple[str, Advice], ...]] = (
    (
        "mutated inputs",
        Advice(
            "the graph writes into an input that is not marked static",
            "every cache layer cachelife manages is pinned and marked static; another tensor the graph mutates "
            "is not: a buffer of your own (mark it with torch._dynamo.mark_static_address before the first "
            "call), or cache tensors replaced outside cachelife (a WARNING names such layers)",
        ),
    ),
    (
        "mutation on input",
        Advice(
            "the graph mutates an input in a way CUDA graphs cannot replay",
            "keep mutated tensors static (torch._dynamo.mark_static_address) and allocated before compiling",
        ),
    ),
    (
        "cpu device",
        Advice(
            "an input or an operation of the graph is on the CPU",
            "move every input (input ids, masks, encoder outputs, cache) to the model's GPU before the call",
        ),
    ),
    (
        "non-cuda",
        Advice(
            "a tensor of the graph is not on a CUDA device",
            "move every input and the cache to the model's GPU",
        ),
    ),
    (
        "multiple devices",
        Advice(
            "the graph spans several devices",
            "a graph is captured on one device; compile per device or keep the decoding model on one GPU",
        ),
    ),
    (
        "dynamic shape",
        Advice(
            "the graph was compiled with dynamic shapes",
            "compile with dynamic=False and keep shapes fixed: a static cache, and encoder_buckets= for "
            "encoder lengths",
        ),
    ),
    (
        "incompatible op",
        Advice(
            "the graph contains an operation CUDA graphs cannot capture (torch names it)",
            "avoid that operation inside the compiled region, or compile without mode='reduce-overhead'",
        ),
    ),
)

_UNKNOWN: Final = Advice(
    "torch gave a reason cachelife has no advice for",
    "see torch's 'skipping cudagraphs due to ...' log line and the torch.compile troubleshooting guide",
)


def advice_for(reason: str) -> Advice:
    """The advice for one of torch's skip reasons (the text after 'skipping cudagraphs due to ')."""
    lowered = reason.lower()
    for fragment, advice in _ADVICE:
        if fragment in lowered:
            return advice
    return _UNKNOWN


def compile_cache_likely(reason: str, *, caches_hold_pinned_tensors: bool, torch_version: str) -> bool:
    """Whether a stale compile-cache entry is a likely cause: 'mutated inputs' on torch < 2.13 while every
    managed cache layer holds its pinned, static tensors."""
    major, minor = (int(part) for part in torch_version.split(".")[:2])
    return "mutated inputs" in reason.lower() and caches_hold_pinned_tensors and (major, minor) < (2, 13)


class SkipLog(logging.Handler):
    """The last skip reasons torch logged in this process, numbered so that readers can ask for new ones."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self._reasons: deque[tuple[int, str]] = deque(maxlen=_KEPT)
        self._count = 0
        self._lock_reasons = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not message.startswith(_PREFIX):
            return
        with self._lock_reasons:
            self._count += 1
            self._reasons.append((self._count, message.removeprefix(_PREFIX)))

    @property
    def count(self) -> int:
        """How many skip lines were seen so far."""
        return self._count

    def since(self, seen: int) -> list[str]:
        """The reasons logged after the first `seen` (at most the last 64)."""
        with self._lock_reasons:
            return [reason for number, reason in self._reasons if number > seen]


_LOG: SkipLog | None = None


def skip_log() -> SkipLog:
    """The process's one `SkipLog`, attached to torch's loggers on first use."""
    global _LOG  # noqa: PLW0603 - one handler per process, attached once
    if _LOG is None:
        log = SkipLog()
        for name in _TORCH_LOGGERS:
            logging.getLogger(name).addHandler(log)
        _LOG = log
    return _LOG


def describe(reasons: list[str], *, caches_hold_pinned_tensors: bool) -> str:
    """One paragraph per distinct reason: torch's words, what they mean, the fix."""
    parts = []
    for reason in dict.fromkeys(reasons):
        advice = advice_for(reason)
        text = f"'{reason.splitlines()[0]}': {advice.cause}; fix: {advice.fix}"
        if compile_cache_likely(
            reason, caches_hold_pinned_tensors=caches_hold_pinned_tensors, torch_version=torch.__version__
        ):
            text += (
                ". With torch < 2.13 a graph compiled earlier over caches that were not marked static can also "
                "be loaded from the compile cache (static inputs are not part of its key): generate runs in "
                "cachelife's own compile-cache namespace, a loop of your own should run inside "
                "cachelife.pinned_compile_cache()"
            )
        parts.append(text)
    if not parts:
        return "torch logged no reason this process could read (its cudagraphs log may be turned off)"
    return " | ".join(parts)


def _skips_now() -> int:
    return int(counters["inductor"]["cudagraph_skips"])


@define
class SkipReporter:
    """Warns when torch skipped CUDA graphs since the last look (a graph then runs correct but slow), naming
    the reason torch gave and its fix."""

    # CUDA-graph skips counted by torch, and skip reasons logged, when this reporter last looked.
    _skips_seen: int = field(factory=_skips_now, alias="skips_seen")
    _lines_seen: int = field(factory=lambda: skip_log().count, alias="lines_seen")

    def report(self, who: str, *, caches_hold_pinned_tensors: bool) -> None:
        skips = _skips_now()
        if skips <= self._skips_seen:
            return
        log = skip_log()
        logger.warning(
            "torch skipped CUDA graphs for %d compiled graph(s) while %s decoded, so they run correct but slow: %s",
            skips - self._skips_seen,
            who,
            describe(log.since(self._lines_seen), caches_hold_pinned_tensors=caches_hold_pinned_tensors),
        )
        self._skips_seen = skips
        self._lines_seen = log.count
