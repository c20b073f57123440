"""The main job: compiled static-cache generation with cachelife on the embedded default model.

Builds a small T5 from a config in code, generates eagerly with a dynamic cache for reference, enables
cachelife, compiles `model.forward` (CUDA graphs via mode="reduce-overhead" on a GPU, inductor on a CPU),
generates with `cache_implementation="static"` several times, prints the per-layer lifecycle table seen at
the first forward call, and checks every call's tokens against the reference.
"""

from __future__ import annotations

import time
from typing import Any, TextIO

import torch
import transformers
from attrs import frozen

from cachelife import zoo
from cachelife.cache import CacheLifecycle, lifecycle
from cachelife.integration import enable, find_cache
from cachelife.lifecycle import Filled, Pinned


@frozen
class DemoResult:
    """What one demo run saw: whether every compiled call matched eager, and the seconds each took."""

    matches: tuple[bool, ...]
    seconds: tuple[float, ...]
    table_at_first_forward: str

    @property
    def ok(self) -> bool:
        return bool(self.matches) and all(self.matches)


def lifecycle_table(state: CacheLifecycle) -> str:
    """One row per layer: index, role, state, key shape, value shape, dtype, device."""
    rows = [("index", "role", "state", "keys", "values", "dtype", "device")]
    for layer in state.layers:
        current = layer.state
        if isinstance(current, Pinned | Filled):
            recorded = current.buffers
            shapes = (str(recorded.key_shape), str(recorded.value_shape))
            where = (str(recorded.dtype).removeprefix("torch."), str(recorded.device))
        else:
            shapes, where = ("-", "-"), ("-", "-")
        rows.append((str(layer.index), layer.role, type(current).__name__, *shapes, *where))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def run_demo(
    *,
    model_name: str = "t5",
    device: str = "auto",
    batch_size: int = 2,
    input_length: int = 12,
    new_tokens: int = 16,
    calls: int = 2,
    out: TextIO,
) -> DemoResult:
    """Run the demo and write its report to `out`; see the module docstring."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = torch.device(device)
    built = zoo.build(model_name, device=chosen)
    model = built.model
    inputs = built.inputs(batch_size, input_length, 1)
    settings: dict[str, Any] = {"do_sample": False, "max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    out.write(
        f"cachelife demo: {model_name} ({type(model).__name__}) on {chosen}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}\n"
    )
    reference = zoo.generate_tokens(model, inputs, **settings, disable_compile=True)

    enable(model)
    first_forward: list[str] = []

    def snapshot(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = find_cache(kwargs)
        if not first_forward and cache is not None:
            first_forward.append(lifecycle_table(lifecycle(cache)))

    # Registered after enable's hook, so it sees the cache as the compiled forward will receive it.
    handle = model.register_forward_pre_hook(snapshot, with_kwargs=True)
    mode = "reduce-overhead" if chosen.type == "cuda" else "default"
    model.forward = torch.compile(model.forward, mode=mode, fullgraph=True)  # type: ignore[method-assign]
    out.write(f"compiled model.forward with mode={mode!r}, fullgraph=True\n")
    matches: list[bool] = []
    seconds: list[float] = []
    try:
        for call in range(calls):
            started = time.perf_counter()
            tokens = zoo.generate_tokens(model, inputs, **settings, cache_implementation="static")
            if chosen.type == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
            matches.append(tokens.shape == reference.shape and bool(torch.equal(tokens, reference)))
            if call == 0:
                out.write("\nper-layer lifecycle at the first forward call:\n")
                out.write((first_forward[0] if first_forward else "(no forward call saw a cache)") + "\n\n")
            out.write(f"call {call}: {seconds[-1]:.2f} s, tokens {'equal' if matches[-1] else 'DIFFER from'} eager\n")
    finally:
        handle.remove()
    result = DemoResult(tuple(matches), tuple(seconds), first_forward[0] if first_forward else "")
    out.write("OK: compiled static-cache generation equals eager\n" if result.ok else "FAILED: tokens differ\n")
    return result
