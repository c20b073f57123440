"""The smallest reproduction of issue #3's intermittent CUDA-graph skip, without transformers.

    python -m bench.static_key_repro --role unmarked|static|static-in-cachelife-namespace [--device cuda]

One compiled step (mode="reduce-overhead") writes into a cache tensor in place, as a static layer's
`update` does. Run the roles one after the other in fresh processes sharing one TORCHINDUCTOR_CACHE_DIR:
`unmarked` (a cache that is not marked static, as in transformers as released) compiles the step and
fills the on-disk compile caches; `static` marks the cache static, as a pinned layer is, and on torch 2.11
and 2.12 loads the unmarked run's AOTAutograd entry (whose key leaves out which inputs are static) and
inherits its "mutated inputs" CUDA-graph skip; `static-in-cachelife-namespace` does the same inside
`cachelife.pinned_compile_cache()` and compiles its own entry. Prints one `RESULT {json}` line.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
from torch._dynamo.utils import counters

from cachelife.integration.compile_cache import pinned_compile_cache

ROLES = ("unmarked", "static", "static-in-cachelife-namespace")


def step(cache: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(2, positions, values)
    return torch.softmax(query @ cache.transpose(-1, -2), dim=-1) @ cache


def run(role: str, device: str) -> dict[str, object]:
    torch.manual_seed(0)
    cache = torch.zeros(4, 8, 64, 64, device=device)
    if role != "unmarked":
        torch._dynamo.mark_static_address(cache)
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    namespace: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if role == "static-in-cachelife-namespace":
        namespace = pinned_compile_cache()
    with namespace:
        for position in range(4):
            positions = torch.tensor([position], device=device)
            values = torch.randn(4, 8, 1, 64, device=device)
            query = torch.randn(4, 8, 1, 64, device=device)
            compiled(cache, positions, values, query)
    if device == "cuda":
        torch.cuda.synchronize()
    return {
        "role": role,
        "torch": torch.__version__,
        "device": device,
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
        "aot_autograd_cache": {k: int(v) for k, v in counters["aot_autograd"].items() if "autograd_cache" in k},
        "fx_graph_cache": {k: int(v) for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--role", choices=ROLES, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print("RESULT " + json.dumps(run(args.role, args.device)))


if __name__ == "__main__":
    main()
