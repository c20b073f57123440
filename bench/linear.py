"""The small-batch linear kernel (`cachelife.kernels.linear.small_linear`) against torch's product (cuBLAS on
CUDA), one matrix product at a time, at a decoding step's shapes.

    python -m bench.linear [--device auto] [--dtype bfloat16] [--rows 1,8] [--products 32] [--replays 50]
                           [--out DIR]

For each shape of the whisper-large-v3 and Llama-3.2-1B decoders (attention projections, the fused q/k/v
and gate/up projections, the MLP's, the output projection) and each `--rows` count: `--products` products
one after another, each with a weight of its own (so that the weights do not sit in the GPU's L2 cache
between products, as a step's do not), captured in one CUDA graph per path and replayed `--replays` times
back to back; microseconds per product (wall time of the replays), the weight's bytes over that time as
GB/s, and the largest difference of each path's output from a float64 product. On a CPU the products run
eagerly (the kernel's torch fallback or Triton's interpreter): a check of the harness, not a measurement.
Writes `<out>/linear-<dtype>-<device>-<date>-tf<version>.json`. A benchmark, not a timed test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.results_file import bench_parser, results_file
from cachelife.kernels.linear import small_linear
from cachelife.tools.recipe import pick_device

# (model, product, in_features, out_features, bias)
SHAPES: tuple[tuple[str, str, int, int, bool], ...] = (
    ("whisper-large-v3", "q/o projection", 1280, 1280, True),
    ("whisper-large-v3", "fused q/k/v", 1280, 3840, True),
    ("whisper-large-v3", "fc1", 1280, 5120, True),
    ("whisper-large-v3", "fc2", 5120, 1280, True),
    ("whisper-large-v3", "output projection", 1280, 51866, False),
    ("llama-3.2-1b", "q/o projection", 2048, 2048, False),
    ("llama-3.2-1b", "k/v projection", 2048, 512, False),
    ("llama-3.2-1b", "fused gate/up", 2048, 16384, False),
    ("llama-3.2-1b", "down projection", 8192, 2048, False),
    ("llama-3.2-1b", "output projection", 2048, 128256, False),
)
# Most bytes of weights one shape's products hold at once (the output projections have fewer products).
_MAX_WEIGHT_BYTES = 4 << 30

Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def time_products(product: Product, x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                  replays: int) -> tuple[float, list[torch.Tensor]]:  # fmt: skip
    """Microseconds per product, and the outputs."""
    outputs = [product(x, w, b) for w, b in zip(weights, biases, strict=True)]  # compiles and warms up
    if x.device.type != "cuda":
        started = time.perf_counter()
        for _ in range(replays):
            outputs = [product(x, w, b) for w, b in zip(weights, biases, strict=True)]
        return 1e6 * (time.perf_counter() - started) / (replays * len(weights)), outputs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [product(x, w, b) for w, b in zip(weights, biases, strict=True)]
    graph.replay()
    torch.cuda.synchronize(x.device)
    started = time.perf_counter()
    for _ in range(replays):  # queued back to back: the device's time, once it is busier than the host
        graph.replay()
    torch.cuda.synchronize(x.device)
    return 1e6 * (time.perf_counter() - started) / (replays * len(weights)), outputs


def measure(shape: tuple[str, str, int, int, bool], rows: int, args: Any, device: torch.device) -> dict[str, Any]:
    model, name, inputs, features, has_bias = shape
    dtype = getattr(torch, args.dtype)
    weight_bytes = inputs * features * dtype.itemsize
    count = max(1, min(args.products, _MAX_WEIGHT_BYTES // weight_bytes))
    generator = torch.Generator().manual_seed(rows * 7919 + features)
    x = torch.randn(rows, inputs, generator=generator).to(device, dtype)
    weights = [(torch.randn(features, inputs, generator=generator) / inputs**0.5).to(device, dtype)
               for _ in range(count)]  # fmt: skip
    biases = [torch.randn(features, generator=generator).to(device, dtype) if has_bias else None for _ in range(count)]
    figures: dict[str, Any] = {"model": model, "product": name, "in_features": inputs, "out_features": features,
                               "rows": rows, "products": count, "weight_mb": round(weight_bytes / 1e6, 2)}  # fmt: skip
    outputs = {}
    for path, product in (("torch", F.linear), ("small_linear", small_linear)):
        microseconds, outputs[path] = time_products(product, x, weights, biases, args.replays)
        figures[f"{path}_us"] = round(microseconds, 2)
        figures[f"{path}_gb_per_s"] = round(weight_bytes / microseconds / 1e3, 1)
    expected = F.linear(x.double(), weights[0].double(), None if biases[0] is None else biases[0].double())
    for path, got in outputs.items():
        figures[f"{path}_max_difference"] = float((got[0].double() - expected).abs().max())
    figures["speedup"] = round(figures["torch_us"] / figures["small_linear_us"], 3)
    return figures


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--products", type=int, default=32)
    parser.add_argument("--replays", type=int, default=50)
    args = parser.parse_args()
    device = pick_device(args.device)
    results = results_file(args.out, f"linear-{args.dtype}", device, "linear",
                           {"settings": vars(args).copy(), "results": []})  # fmt: skip
    for rows in (int(r) for r in args.rows.split(",")):
        for shape in SHAPES:
            results.add(measure(shape, rows, args, device))
    results.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
