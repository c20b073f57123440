"""A compile-cache namespace of its own for graphs that decode with pinned caches.

Why (issue #3, the intermittent "skipping cudagraphs due to mutated inputs"): CUDA-graph trees only let a
graph mutate inputs that are static, and which inputs are static is decided when the graph is compiled and
stored with it (`fw_metadata.static_input_indices`, and inductor's cached CUDA-graph verdict). torch 2.11
and 2.12 leave `static_input_indices` out of the AOTAutograd cache key (torch 2.13 adds it). So a graph
compiled by a run whose cache tensors were not marked static, such as transformers as released, where the
cache is allocated inside the compiled region, has the same key as the same graph over pinned caches. A
later run with pinned caches then loads that entry from the on-disk cache, inherits its verdict that the
cache tensors are ordinary mutated inputs, and CUDA graphs are skipped for the graph: correct, but slow.

cachelife compiles under its own `torch.compiler.config.cache_key_tag` (which both the FX-graph and the
AOTAutograd keys include) while it decodes, so its entries never mix with entries made over unpinned
caches. torch's configuration is per thread from 2.12 on and process-wide before: on 2.11 the tag is set
while at least one cachelife decode runs in any thread, and the previous value comes back when the last
one ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from attrs import define, field

TAG = "cachelife-pinned-caches"


def _current() -> str:
    return torch.compiler.config.cache_key_tag


def _tagged(tag: str) -> str:
    if TAG in tag.split("+"):
        return tag
    return f"{tag}+{TAG}" if tag else TAG


def base_tag() -> str:
    """The compile-cache tag in effect without cachelife's part: what a user (or TORCH_COMPILE_CACHE_KEY_TAG)
    set, the same inside and outside `pinned_compile_cache()`."""
    return "+".join(part for part in _current().split("+") if part != TAG)


def _config_is_process_wide() -> bool:
    """Whether a config value set in one thread is seen by another (torch 2.11) or not (2.12+)."""
    probe = f"{TAG}-probe"
    seen: list[str] = []
    before = _current()
    torch.compiler.config.cache_key_tag = probe
    try:
        thread = threading.Thread(target=lambda: seen.append(_current()))
        thread.start()
        thread.join()
    finally:
        torch.compiler.config.cache_key_tag = before
    return seen == [probe]


@define(kw_only=True)
class _Namespace:
    """Sets and restores the tag: per thread where torch's config is, else counted over all threads."""

    lock: threading.Lock = field(factory=threading.Lock)
    process_wide: bool | None = None
    depth: int = 0
    saved: str = ""

    def enter(self) -> str | None:
        """Tag the compile cache; returns the value this thread restores, None where the last one out does."""
        with self.lock:
            if self.process_wide is None:
                self.process_wide = _config_is_process_wide()
            if self.process_wide:
                if self.depth == 0:
                    self.saved = _current()
                    torch.compiler.config.cache_key_tag = _tagged(self.saved)
                self.depth += 1
                return None
        before = _current()
        torch.compiler.config.cache_key_tag = _tagged(before)
        return before

    def leave(self, before: str | None) -> None:
        if before is not None:
            torch.compiler.config.cache_key_tag = before
            return
        with self.lock:
            self.depth -= 1
            if self.depth == 0:
                torch.compiler.config.cache_key_tag = self.saved


_NAMESPACE = _Namespace()


@contextlib.contextmanager
def pinned_compile_cache() -> Iterator[None]:
    """Compile (and load compiled graphs) in cachelife's compile-cache namespace; see the module docstring.

    `generate` on an enabled model and `cachelife.generate` enter it themselves; use it around your own
    decoding loop when it calls a compiled model with caches from `prepare_static_cache`.
    """
    before = _NAMESPACE.enter()
    try:
        yield
    finally:
        _NAMESPACE.leave(before)
