"""A layer's fused few-row product (`cachelife.kernels.layer_linear`) against the same operations compiled by
inductor, as a decoding step runs them, at the decoder products of whisper-large-v3 and the Llama-3.2-1B shape.

    python -m bench.layer_linear [--device cuda] [--dtype bfloat16] [--rows 1,4,8,16] [--cases NAME,...]
                                 [--out DIR]

Each case is one product of a decoding step with what surrounds it in the layer (CASES: Whisper's fused query,
key and value with their layer norm; an output projection with its residual; fc1 with its norm and GELU; fc2
with its residual; Llama's fused query, key and value and its gate and up products with their RMS norm; its down
product with its residual), for each `--rows` value. Its paths, each timed as a CUDA graph of 20 calls
replayed (device time per call, the median of 5; `bench.decode_attention`'s timing):
- `inductor`: `layer_linear_reference` (the layer's own operations) compiled with `torch.compile`
  (`fullgraph`, inductor's default options): what a compiled step runs without the lever;
- `fused`: the op as it plans itself;
- `fused_lanes` (from `DOT_ROWS` rows on): the op with the tensor-core plan turned off, the lanes' sums, so that
  the plan's choice is measured;
- `fused_dot_<N>x<K>` (from `DOT_ROWS` rows on, for each `--dot-plans` value): the tensor-core plan with tiles of
  N output and K input features.
Each path's largest difference from a float64 computation of the same operations is kept, and the verdict says
whether every path is within twice the compiled operations' difference (plus one rounding step of the dtype). Writes
`<out>/layer-linear-<device>-<date>-tf<version>.json`. A benchmark, not a timed test.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final
from unittest import mock

import torch
from attrs import frozen

from bench.decode_attention import device_ms_per_call, largest_error
from bench.results_file import bench_parser, results_file
from cachelife.kernels import linear
from cachelife.kernels.layer_linear import Activation, Fusion, Norm, layer_linear, layer_linear_reference
from cachelife.kernels.triton_support import power_of_two_at_least
from cachelife.tools.recipe import pick_device


@frozen(kw_only=True)
class Case:
    """One product: its input and output features, the norm before it, the activation after, a residual."""

    inputs: int
    features: int
    norm: Norm = Norm.NONE
    activation: Activation = Activation.NONE
    residual: bool = False


CASES: Final = {
    "whisper-qkv": Case(inputs=1280, features=3840, norm=Norm.LAYER),
    "whisper-out": Case(inputs=1280, features=1280, residual=True),
    "whisper-fc1": Case(inputs=1280, features=5120, norm=Norm.LAYER, activation=Activation.GELU),
    "whisper-fc2": Case(inputs=5120, features=1280, residual=True),
    "llama-qkv": Case(inputs=2048, features=3072, norm=Norm.RMS),
    "llama-gate-up": Case(inputs=2048, features=16384, norm=Norm.RMS),
    "llama-down": Case(inputs=8192, features=2048, residual=True),
}


def arguments(case: Case, rows: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(rows * 100 + case.inputs)

    def draw(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * scale + shift).to(device, dtype)

    given: dict[str, Any] = {
        "x": draw(rows, 1, case.inputs), "weight": draw(case.features, case.inputs, scale=case.inputs**-0.5),
        "bias": draw(case.features), "norm": case.norm, "activation": case.activation,
    }  # fmt: skip
    if case.norm is not Norm.NONE:
        given["norm_weight"] = draw(case.inputs, scale=0.1, shift=1.0)
    if case.norm is Norm.LAYER:
        given["norm_bias"] = draw(case.inputs, scale=0.1)
    if case.residual:
        given["residual"] = draw(rows, 1, case.features)
    return given


def float64(given: dict[str, Any]) -> torch.Tensor:
    wide: dict[str, Any] = {
        key: value.double() if isinstance(value, torch.Tensor) else value for key, value in given.items()
    }
    return layer_linear_reference(wide.pop("x"), wide.pop("weight"), wide.pop("bias"), Fusion(**wide))


def measure(
    name: str, case: Case, rows: int, device: torch.device, dtype: torch.dtype, *, dot_plans: tuple[str, ...] = ()
) -> dict[str, Any]:
    given = arguments(case, rows, device, dtype)
    x, weight, bias = given["x"], given["weight"], given["bias"]
    fusion = Fusion(**{key: value for key, value in given.items() if key not in {"x", "weight", "bias"}})
    torch._dynamo.reset()  # each case and row count compiles anew (dynamo's recompile limit counts them all)
    compiled = torch.compile(layer_linear_reference, fullgraph=True, dynamic=False)

    def by_inductor() -> torch.Tensor:
        output: torch.Tensor = compiled(x, weight, bias, fusion)
        return output

    def fused() -> torch.Tensor:
        return layer_linear(x, weight, bias, fusion)

    expected = float64(given)

    def timed(call: Callable[[], torch.Tensor]) -> dict[str, float]:
        return {"device_ms": device_ms_per_call(call), "error": largest_error(call(), expected)}

    paths = {"inductor": timed(by_inductor), "fused": timed(fused)}
    result: dict[str, Any] = {"case": name, "rows": rows, "paths": paths}
    if rows >= linear.DOT_ROWS:
        with mock.patch.object(linear, "DOT_ROWS", 10**9):  # the plan without tensor cores, for this path alone
            paths["fused_lanes"] = timed(fused)
        for plan in dot_plans:  # other tensor-core tiles: output features x input features per step
            block_n, block_k = (int(value) for value in plan.split("x"))
            tiles = (max(power_of_two_at_least(rows), 16), block_n, block_k)
            with mock.patch.object(linear, "plan_blocks", lambda tiles=tiles, **_: tiles):
                paths[f"fused_dot_{plan}"] = timed(fused)
    # Every path within twice the compiled operations' distance from float64 (plus one rounding step).
    bound = 2 * paths["inductor"]["error"] + torch.finfo(dtype).eps
    result["verdict"] = {"bound": bound, "all_agree_with_inductor": all(p["error"] <= bound for p in paths.values())}
    inductor = result["paths"]["inductor"]["device_ms"]
    result["fused_over_inductor"] = result["paths"]["fused"]["device_ms"] / inductor
    print(result, flush=True)
    return result


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--dot-plans", default="", help="more tensor-core tiles timed from DOT_ROWS rows on (NxK,...)")
    args = parser.parse_args()
    device = pick_device(args.device)
    if device.type != "cuda":
        parser.error(f"this benchmark times CUDA graphs: it needs a CUDA device, got {device}")
    dtype = getattr(torch, args.dtype)
    out = results_file(args.out, "layer-linear", device, "bench.layer_linear", {"dtype": args.dtype, "results": []})
    with torch.inference_mode():
        for name in args.cases.split(","):
            for rows in (int(value) for value in args.rows.split(",")):
                plans = tuple(plan for plan in args.dot_plans.split(",") if plan)
                out.add(measure(name, CASES[name], rows, device, dtype, dot_plans=plans), show=False)
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
