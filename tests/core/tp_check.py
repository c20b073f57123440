"""Tensor parallelism check: cachelife with transformers' own TP, against one-process eager generation.

    PYTHONPATH=src torchrun --nproc-per-node 2 tests/core/tp_check.py --out DIR [--device cuda|cpu]

Every rank builds the same zoo model (seeded), saves it and computes eager dynamic-cache tokens on its own
device without TP (the one-device reference); then it loads the saved weights with
`DistributedConfig(tp_plan="auto")` (so each rank holds num_key_value_heads / world_size heads), generates
eagerly with TP, enables cachelife, compiles `model.forward` and generates with a static cache twice. Rank 0
writes DIR/tp-check.json (other ranks DIR/tp-check-rank<N>.json); the exit status is 0 when every compiled
call equals the one-device eager tokens. On CUDA `mode="reduce-overhead"` is tried first and, if it raises,
the default mode (recorded under `attempts`). NVLink multicast is off by default (the environment below).
"""

from __future__ import annotations

import os

for _name, _value in (
    ("NCCL_NVLS_ENABLE", "0"),
    ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
    ("NVSHMEM_DISABLE_NVLS", "1"),
):
    os.environ.setdefault(_name, _value)

import argparse  # noqa: E402 - the environment above must be set before torch loads NCCL
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import DistributedConfig, PreTrainedModel  # noqa: E402

import cachelife  # noqa: E402
from cachelife.core.layer_lifecycle import Filled, Pinned  # noqa: E402
from cachelife.integration.call_arguments import find_cache  # noqa: E402
from cachelife.tools import zoo  # noqa: E402


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON result")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--model", default="llama-small", help="a decoder-only zoo model with a TP plan (Llama)")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--input-length", type=int, default=9)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--calls", type=int, default=2)
    return parser.parse_args()


def tokens_of(model: PreTrainedModel, inputs: zoo.Inputs, **settings: Any) -> torch.Tensor:
    return zoo.generate_tokens(model, inputs, **settings).cpu()


def key_shapes(cache: object) -> list[list[int]]:
    shapes = []
    for layer in cachelife.lifecycle(cache).layers:
        state = layer.state
        shapes.append(list(state.buffers.key_shape) if isinstance(state, Pinned | Filled) else [])
    return shapes


def compiled_attempts(
    model: PreTrainedModel,
    *,
    inputs: zoo.Inputs,
    settings: dict[str, Any],
    modes: tuple[str, ...],
    calls: int,
    first_forward: list[list[list[int]]],
    single: torch.Tensor,
    tp_eager: torch.Tensor,
) -> list[dict[str, Any]]:
    """Compile `model.forward` in each mode in turn until one runs every call; report each attempt."""
    attempts = []
    for mode in modes:
        torch._dynamo.reset()
        first_forward.clear()
        cachelife.compile_forward(model, mode=mode)
        skips = int(counters["inductor"]["cudagraph_skips"])
        attempt: dict[str, Any] = {"mode": mode, "calls": [], "error": None}
        try:
            for _ in range(calls):
                started = time.perf_counter()
                tokens = tokens_of(model, inputs, **settings, cache_implementation="static")
                attempt["calls"].append(
                    {
                        "seconds": time.perf_counter() - started,
                        "equals_single": bool(torch.equal(tokens, single)),
                        "equals_tp_eager": bool(torch.equal(tokens, tp_eager)),
                        "tokens": tokens.tolist(),
                    }
                )
        except Exception as error:  # reported in the JSON; the exit status says it failed
            attempt["error"] = f"{type(error).__name__}: {error}"[:2000] + "\n" + traceback.format_exc()[-2000:]
        attempt["cudagraph_skips"] = int(counters["inductor"]["cudagraph_skips"]) - skips
        attempt["key_shapes_at_first_forward"] = first_forward[0] if first_forward else None
        attempts.append(attempt)
        if attempt["error"] is None:
            break
    cachelife.restore_forward(model)
    return attempts


def main() -> int:
    args = parse()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "torch": torch.__version__, "transformers": transformers.__version__, "model": args.model,
        "device": str(device), "world_size": world, "rank": rank,
        "environment": {name: os.environ.get(name) for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                                "NVSHMEM_DISABLE_NVLS")},
    }  # fmt: skip
    settings: dict[str, Any] = {
        "do_sample": False,
        "max_new_tokens": args.new_tokens,
        "min_new_tokens": args.new_tokens,
    }

    # 1. one-device eager reference from the same weights (each rank computes it; no process group yet)
    built = zoo.build(args.model, device=device)
    weights = Path(tempfile.mkdtemp(prefix=f"tp-check-weights-rank{rank}-"))
    built.model.save_pretrained(weights)
    inputs = built.inputs(args.batch_size, args.input_length, 1)
    single = tokens_of(built.model, inputs, **settings, disable_compile=True)
    kv_heads = cachelife.model_cache_shapes(built.model).self_attention[0].num_kv_heads
    model_class = type(built.model)
    del built

    # 2. transformers' tensor parallelism
    started = time.perf_counter()
    model = model_class.from_pretrained(weights, distributed_config=DistributedConfig(tp_plan="auto")).eval()
    result["load_seconds"] = time.perf_counter() - started
    result["tp_size"] = getattr(model, "_tp_size", None)
    result["model_device"] = str(model.device)
    inputs = {name: value.to(model.device) for name, value in inputs.items()}
    tp_eager = tokens_of(model, inputs, **settings, disable_compile=True)
    result["expected_kv_heads_per_rank"] = kv_heads // world
    result["inferred_kv_heads_per_rank"] = cachelife.model_cache_shapes(model).self_attention[0].num_kv_heads

    # 3. cachelife with a compiled forward
    cachelife.enable(model)
    first_forward: list[list[list[int]]] = []

    def snapshot(module: torch.nn.Module, args_: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = find_cache(kwargs)
        if not first_forward and cache is not None:
            first_forward.append(key_shapes(cache))

    model.register_forward_pre_hook(snapshot, with_kwargs=True)
    modes = ("reduce-overhead", "default") if use_cuda else ("default",)
    attempts = compiled_attempts(
        model,
        inputs=inputs,
        settings=settings,
        modes=modes,
        calls=args.calls,
        first_forward=first_forward,
        single=single,
        tp_eager=tp_eager,
    )

    last = attempts[-1]
    calls = last["calls"]
    shapes = last["key_shapes_at_first_forward"] or []
    result.update(
        attempts=attempts,
        compile_mode_used=last["mode"] if last["error"] is None else None,
        single_tokens=single.tolist(),
        tp_eager_tokens=tp_eager.tolist(),
        tp_eager_equals_single=bool(torch.equal(tp_eager, single)),
        per_rank_key_shapes_ok=bool(shapes) and all(shape[1] == kv_heads // world for shape in shapes),
        cachelife_equals_single=last["error"] is None and all(call["equals_single"] for call in calls),
        cachelife_equals_tp_eager=last["error"] is None and all(call["equals_tp_eager"] for call in calls),
    )
    name = "tp-check.json" if rank == 0 else f"tp-check-rank{rank}.json"
    (args.out / name).write_text(json.dumps(result, indent=2) + "\n")
    # No barrier: on the two-GPU H200 both ranks wrote their results and then hung at teardown, after
    # barrier() (each rank is done once its file is written).
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if result["cachelife_equals_single"] and result["per_rank_key_shapes_ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
