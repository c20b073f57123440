"""The compiled static-cache recipe, run with or without cachelife, and what it did.

The recipe is transformers' own (the T5 integration test `test_compile_static_cache`):

    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    model.generate(**inputs, do_sample=False, max_new_tokens=N, cache_implementation="static")

`compile_mode="auto"` instead leaves `model.forward` alone and passes transformers' `compile_config`, which
compiles decoding only. Each call is compared with eager dynamic-cache generation and reports its CUDA-graph
health: skips, unexpected re-records, and graphs dynamo compiled. `python -m cachelife recipe --json` runs it
in a fresh process (the vanilla recipe can kill its process with a segmentation fault).
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Literal, TypeAlias

import attrs
import torch
import transformers
from attrs import frozen
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees
from transformers import CompileConfig

from cachelife.core.cache_lifecycle import CacheLifecycle, lifecycle
from cachelife.core.layer_lifecycle import Filled, Pinned
from cachelife.integration.call_arguments import find_cache
from cachelife.integration.compiled import compile_forward
from cachelife.integration.enabling import enable
from cachelife.tools import zoo

CompileMode: TypeAlias = Literal["forward", "auto"]


@frozen
class CudaGraphHealth:
    """Process-wide counters of dynamo, inductor and CUDA-graph trees at one moment."""

    cudagraph_skips: int
    rerecords: int
    graphs: int

    @classmethod
    def now(cls) -> CudaGraphHealth:
        return cls(
            cudagraph_skips=int(counters["inductor"]["cudagraph_skips"]),
            rerecords=_rerecords(),
            graphs=int(counters["stats"]["unique_graphs"]),
        )


def _rerecords() -> int:
    """Unexpected re-recordings counted by CUDA-graph trees on the current device (0 without CUDA)."""
    if not torch.cuda.is_available():
        return 0
    manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    if manager is None:
        return 0
    return sum(sum(per_function.values()) for per_function in manager.num_rerecord.values())


@frozen(kw_only=True)
class CallReport:
    """One compiled `generate` call."""

    index: int
    seconds: float | None
    equal_to_eager: bool | None
    error: str | None
    health: CudaGraphHealth


@frozen(kw_only=True)
class RecipeReport:
    """A whole recipe run: environment, eager reference time, and every compiled call."""

    model: str
    device: str
    dtype: str
    torch: str
    transformers: str
    use_cachelife: bool
    compile_mode: CompileMode
    new_tokens: int
    num_beams: int
    eager_seconds: float
    calls: tuple[CallReport, ...]
    table_at_first_forward: str

    @property
    def ok(self) -> bool:
        """Every call ran and equalled eager generation."""
        return bool(self.calls) and all(call.error is None and call.equal_to_eager for call in self.calls)

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data["ok"] = self.ok
        return data


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


def pick_device(device: str) -> torch.device:
    """The device a command-line option names: `auto` is CUDA when available, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def run_recipe(
    model_name: str,
    *,
    use_cachelife: bool = True,
    compile_mode: CompileMode = "forward",
    device: str = "auto",
    dtype: torch.dtype = torch.float32,
    batch_size: int = 4,
    input_length: int = 48,
    new_tokens: int = 64,
    calls: int = 3,
    num_beams: int = 1,
) -> RecipeReport:
    """Run the recipe on a zoo model (beam search with `num_beams` > 1); exceptions inside a call are
    reported, not raised."""
    chosen = pick_device(device)
    built = zoo.build(model_name, device=chosen, dtype=dtype)
    model = built.model
    inputs = built.inputs(batch_size, input_length, 1)
    settings: dict[str, Any] = {
        "do_sample": False,
        "max_new_tokens": new_tokens,
        "min_new_tokens": new_tokens,
        "num_beams": num_beams,
    }
    started = time.perf_counter()
    reference = zoo.generate_tokens(model, inputs, **settings, disable_compile=True)
    eager_seconds = _elapsed(started, chosen)

    first_forward: list[str] = []
    if use_cachelife:
        enable(model)

    def snapshot(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = find_cache(kwargs)
        if not first_forward and cache is not None:
            try:
                first_forward.append(lifecycle_table(lifecycle(cache)))
            except Exception as error:  # a report line; the call itself decides success
                first_forward.append(f"(cachelife cannot read this cache: {error})")

    # Registered after enable's hook: it sees the cache exactly as the compiled code will receive it.
    model.register_forward_pre_hook(snapshot, with_kwargs=True)
    mode = "reduce-overhead" if chosen.type == "cuda" else "default"
    if compile_mode == "forward":
        compile_forward(model, mode=mode, fullgraph=True)
    else:
        compile_config = CompileConfig(fullgraph=True, mode=mode)
        compile_config._compile_all_devices = True  # transformers compiles on GPUs only unless told
        settings["compile_config"] = compile_config
    reports: list[CallReport] = []
    for index in range(calls):
        started = time.perf_counter()
        try:
            tokens = zoo.generate_tokens(model, inputs, **settings, cache_implementation="static")
            seconds: float | None = _elapsed(started, chosen)
            equal: bool | None = tokens.shape == reference.shape and bool(torch.equal(tokens, reference))
            error = None
        except Exception as raised:  # the vanilla recipe's failure is what we report
            seconds, equal = None, None
            error = f"{type(raised).__name__}: {raised}"[:2000] + "\n" + traceback.format_exc()[-1500:]
        reports.append(
            CallReport(index=index, seconds=seconds, equal_to_eager=equal, error=error, health=CudaGraphHealth.now())
        )
        if error is not None:
            break
    return RecipeReport(
        model=model_name,
        device=str(chosen) if chosen.type != "cuda" else torch.cuda.get_device_name(chosen),
        dtype=str(dtype).removeprefix("torch."),
        torch=torch.__version__,
        transformers=transformers.__version__,
        use_cachelife=use_cachelife,
        compile_mode=compile_mode,
        new_tokens=new_tokens,
        num_beams=num_beams,
        eager_seconds=eager_seconds,
        calls=tuple(reports),
        table_at_first_forward=first_forward[0] if first_forward else "",
    )


def _elapsed(started: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started
