"""The decode attention kernel (`cachelife.kernels.attention`): its Triton kernels against a plain softmax, the
custom op under `torch.compile(fullgraph=True)`, models greedy-decoding through it with SDPA's tokens, and in
bf16 its teacher-forced logits as close to fp32's as SDPA's own (`AGREEMENT_BOUND`).

The Triton tests run the kernels on the CPU in Triton's interpreter: run them with `TRITON_INTERPRET=1` in an
environment with Triton (`pip install triton`). Without Triton, or without that variable, they are skipped,
and the op and the models run on its torch fallback, which the other tests check. With Triton, the kernels are
also compiled for a GPU (none needed), which checks what the interpreter lets pass; the `gpu` tests run them
on one.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, PreTrainedConfig, PreTrainedModel
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import cachelife
from cachelife.errors import CacheShapeError, InvalidArgumentError, UnsupportedGenerationError
from cachelife.integration.runtime import runtime_of
from cachelife.kernels.attention import (
    MAX_SPLITS,
    PROGRAMS_PER_SM,
    attention_combine_kernel,
    attention_split_kernel,
    decode_attention,
    launch_plan,
    plan_splits,
    reference_decode_attention,
)
from cachelife.kernels.triton_support import triton_runs_on
from cachelife.model_rewrites import decode_attention as decode_attention_module
from cachelife.model_rewrites.decode_attention import (
    ATTENTION,
    decode_attention_forward,
    register_decode_attention,
    use_decode_attention,
)
from cachelife.tools import zoo

INTERPRETED = triton_runs_on(torch.device("cpu"))
needs_triton = pytest.mark.skipif(
    not INTERPRETED, reason="needs Triton and TRITON_INTERPRET=1 (Triton's CPU interpreter): skipped, not passed"
)
OP = "cachelife::decode_attention"


@dataclass(frozen=True)
class Case:
    """Random inputs of one shape: `mask` none, "bool" (some positions masked out), "added" (a float mask
    per head, -inf at some positions) or "batch" (a bool mask shared by the batch)."""

    name: str
    batch: int
    heads: int
    kv_heads: int
    positions: int
    head_dim: int
    mask: str | None
    splits: int | None
    expected_splits: int  # what the plan makes of `splits` on the CPU: the case tests that many
    dtype: torch.dtype = torch.float32
    value_dim: int | None = None
    transposed: bool = False  # laid out as transformers' projections give them: (batch, positions, heads, _)

    def inputs(self, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        generator = torch.Generator().manual_seed(0)
        value_dim = self.value_dim or self.head_dim

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(device, self.dtype)

        if self.transposed:
            query = randn(self.batch, 1, self.heads, self.head_dim).transpose(1, 2)
            key = randn(self.batch, self.positions, self.kv_heads, self.head_dim).transpose(1, 2)
            value = randn(self.batch, self.positions, self.kv_heads, value_dim).transpose(1, 2)
        else:
            query = randn(self.batch, self.heads, 1, self.head_dim)
            key = randn(self.batch, self.kv_heads, self.positions, self.head_dim)
            value = randn(self.batch, self.kv_heads, self.positions, value_dim)
        keep = torch.rand(self.batch, 1, 1, self.positions, generator=generator) > 0.4
        keep[..., 0] = True
        added = torch.randn(1, self.heads, 1, self.positions, generator=generator).masked_fill(~keep[:1], -math.inf)
        masks = {None: None, "bool": keep, "batch": keep[:1], "added": added.to(self.dtype)}
        mask = masks[self.mask]
        return query, key, value, None if mask is None else mask.to(device)


CASES = [
    Case("mha-3-splits", 2, 4, 4, 300, 16, None, 3, 3),
    Case("mha-bool-mask", 2, 4, 4, 300, 16, "bool", 3, 3),
    Case("gqa-bool-mask", 2, 8, 2, 150, 32, "bool", 4, 3),  # 4 heads per group: tiles of 64, 3 of them
    Case("gqa-batch-mask", 2, 6, 2, 150, 24, "batch", 2, 2),  # 3 heads per group, head_dim not a power of 2
    Case("mqa-added-mask", 1, 4, 1, 200, 16, "added", 2, 2),
    Case("one-split", 2, 4, 2, 37, 16, "bool", None, 1),
    Case("splits-past-tiles", 1, 2, 2, 300, 16, None, MAX_SPLITS, 3),
    Case("value-dim", 1, 2, 1, 200, 16, None, 2, 2, value_dim=8),
    Case("one-position", 2, 2, 2, 1, 8, None, 5, 1),
    Case("transposed-cache", 2, 4, 2, 150, 16, "bool", 2, 2, transposed=True),
    Case("bf16-gqa", 2, 8, 2, 150, 32, "bool", 3, 3, dtype=torch.bfloat16),
    Case("fp16-added", 1, 4, 4, 300, 16, "added", 2, 2, dtype=torch.float16),
]
# Against a float64 softmax of the same inputs: float32 to float rounding; half precision to its output
# rounding (the interpreter rounds float32 to bfloat16 toward zero, a GPU to nearest).
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def softmax_reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Attention as the textbook writes it, in float64, with key and value repeated for each query head."""
    group = query.shape[1] // key.shape[1]
    keys = key.double().repeat_interleave(group, dim=1)
    values = value.double().repeat_interleave(group, dim=1)
    scores = query.double() @ keys.transpose(-1, -2) / math.sqrt(query.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.double()
    return torch.softmax(scores, dim=-1) @ values


def check_close(output: torch.Tensor, case: Case) -> None:
    query, key, value, mask = case.inputs()
    expected = softmax_reference(query, key, value, mask)
    assert output.dtype == case.dtype
    assert output.shape == (case.batch, case.heads, 1, case.value_dim or case.head_dim)
    tolerance = TOLERANCE[case.dtype]
    torch.testing.assert_close(output.double(), expected, atol=tolerance, rtol=tolerance)


def assert_float32_close(output: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = TOLERANCE[torch.float32]
    torch.testing.assert_close(output.double(), expected, atol=tolerance, rtol=tolerance)


def test_the_cases_cut_the_positions_as_they_say() -> None:
    for case in CASES:
        plan = plan_splits(
            batch=case.batch, kv_heads=case.kv_heads, group=case.heads // case.kv_heads, positions=case.positions,
            key_dim=case.head_dim, value_dim=case.value_dim or case.head_dim, programs=1, splits=case.splits,
        )  # fmt: skip
        assert plan.splits == case.expected_splits, case.name
        assert (plan.splits - 1) * plan.split_size < case.positions <= plan.splits * plan.split_size, case.name


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_kernel_equals_a_plain_softmax(case: Case) -> None:
    query, key, value, mask = case.inputs()
    check_close(decode_attention(query, key, value, mask, splits=case.splits), case)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_torch_fallback_equals_a_plain_softmax(case: Case) -> None:
    query, key, value, mask = case.inputs()
    check_close(reference_decode_attention(query, key, value, mask), case)


@pytest.mark.parametrize("interpreting", ["0", "1"])
def test_which_devices_take_the_triton_kernels(interpreting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter serves CPU tensors only: under TRITON_INTERPRET=1 it would copy CUDA tensors to the
    host and back (a host sync, which a CUDA-graph capture refuses), so they take the torch fallback then."""
    pytest.importorskip("triton", reason="needs Triton: skipped, not passed")
    monkeypatch.setenv("TRITON_INTERPRET", interpreting)
    assert triton_runs_on(torch.device("cuda")) == (interpreting == "0")
    assert triton_runs_on(torch.device("cpu")) == (interpreting == "1")
    assert not triton_runs_on(torch.device("meta"))


def test_the_split_plan() -> None:
    # Whisper-large-v3's cross-attention at batch 1 on 132 SMs: 20 heads over 1500 positions, head_dim 64.
    whisper = plan_splits(batch=1, kv_heads=20, group=1, positions=1500, key_dim=64, value_dim=64, programs=264)
    assert (whisper.block_n, whisper.splits, whisper.split_size) == (128, 12, 128)  # one tile each, 240 programs
    # Enough programs without splitting: one split, the output written by phase 1 itself.
    wide = plan_splits(batch=32, kv_heads=20, group=1, positions=1500, key_dim=64, value_dim=64, programs=264)
    assert wide.splits == 1
    # Grouped-query attention: 4 heads of a group in one program, so shorter tiles.
    gqa = plan_splits(batch=1, kv_heads=8, group=4, positions=4096, key_dim=128, value_dim=128, programs=264)
    assert (gqa.block_g, gqa.block_n, gqa.splits, gqa.split_size) == (4, 16, 32, 128)  # 8 tiles a split
    assert gqa.splits * gqa.split_size >= 4096 > (gqa.splits - 1) * gqa.split_size
    capped = plan_splits(batch=1, kv_heads=1, group=1, positions=32768, key_dim=64, value_dim=64, programs=10**4)
    assert capped.splits == MAX_SPLITS


# The engine's shapes (rows, key/value heads, query heads per group, cache positions) and the (splits, tile
# length) of the fastest 4-warp plans of the sweep on an H100 (132 SMs) in
# bench/results/gpu/decode-attention-cuda-20261206-40bb996-h100-tf5.17.0.json; the op's own plan then was
# (3, 32) for the Llama shape at 16 rows (23.7 us against 17.2 for (8, 32)) and (1, 128) for Whisper's
# self-attention (13.9 us against 13.2 for (4, 128)).
SWEPT_BEST = {
    "llama-1": ((1, 8, 4, 512), (16, 32)),
    "llama-16": ((16, 8, 4, 512), (8, 32)),
    "whisper-self-16": ((16, 20, 1, 448), (4, 128)),
    "whisper-cross-16": ((16, 20, 1, 1500), (4, 128)),
}


@pytest.mark.parametrize("case", SWEPT_BEST)
def test_the_plan_on_132_multiprocessors_is_the_sweeps_fastest(case: str) -> None:
    (batch, kv_heads, group, positions), best = SWEPT_BEST[case]
    plan = plan_splits(
        batch=batch, kv_heads=kv_heads, group=group, positions=positions, key_dim=64, value_dim=64,
        programs=PROGRAMS_PER_SM * 132,
    )  # fmt: skip
    assert (plan.splits, plan.block_n) == best


@pytest.mark.parametrize("triton", [pytest.param(True, marks=needs_triton), False], ids=["triton", "torch"])
def test_a_query_the_mask_excludes_entirely_gives_zeros(triton: bool) -> None:
    query, key, value, _ = Case("", 2, 4, 2, 300, 16, None, 3, 3).inputs()
    mask = torch.ones(2, 1, 1, 300, dtype=torch.bool)
    mask[1] = False
    attend = decode_attention if triton else reference_decode_attention
    output = attend(query, key, value, mask)
    assert torch.equal(output[1], torch.zeros_like(output[1]))
    assert_float32_close(output[0], softmax_reference(query, key, value, mask)[0])


@needs_triton
def test_tiles_the_mask_excludes_are_not_read() -> None:
    """As in a static cache past its filled length: NaN in key and value where the mask excludes a whole tile
    (positions 128-255 of tiles of 128) does not reach the output, since the kernel skips the tile."""
    query, key, value, _ = Case("", 1, 2, 2, 300, 16, None, 3, 3).inputs()
    mask = torch.ones(1, 1, 1, 300, dtype=torch.bool)
    mask[..., 128:256] = False
    key[:, :, 128:256] = math.nan
    value[:, :, 128:256] = math.nan
    for splits in (1, 3):
        output = decode_attention(query, key, value, mask, splits=splits)
        kept = torch.cat([torch.arange(128), torch.arange(256, 300)])
        expected = softmax_reference(query, key[:, :, kept], value[:, :, kept], None)
        assert_float32_close(output, expected)


@needs_triton
@pytest.mark.parametrize("mask_kind", [None, "bool"])
def test_every_launch_a_benchmark_sweeps_equals_a_plain_softmax(mask_kind: str | None) -> None:
    """bench.decode_attention times plans other than the op's own (splits, tile length, warps, the per-tile skip
    on or off, values read before or after the scores, matrix products or sums): each computes the same
    attention."""
    case = Case("", 2, 4, 2, 300, 16, mask_kind, 1, 1)
    query, key, value, mask = case.inputs()
    launches = [
        (1, 32, None, False),
        (3, 64, True, True),
        (5, 16, False, False),
        (2, 128, None, True),
        (1, 16, True, True),
    ]
    for splits, block_n, skip, early in launches:
        products = block_n == 64
        plan = plan_splits(
            batch=2, kv_heads=2, group=2, positions=300, key_dim=16, value_dim=16, programs=1, splits=splits,
            block_n=block_n,
        )  # fmt: skip
        assert plan.block_n == block_n
        output = launch_plan(
            query, key, value, mask, scale=16**-0.5, plan=plan, num_warps=2, skip_empty=skip, values_early=early,
            products=products,
        )  # fmt: skip
        check_close(output, case)
    # Matrix products of float16, weights rounded to it (the interpreter multiplies no bfloat16 matrices).
    rounded = dataclasses.replace(case, dtype=torch.float16)
    query, key, value, mask = rounded.inputs()
    plan = plan_splits(
        batch=2, kv_heads=2, group=2, positions=300, key_dim=16, value_dim=16, programs=1, splits=3, block_n=32
    )
    check_close(launch_plan(query, key, value, mask, scale=16**-0.5, plan=plan, products=True), rounded)


def test_kernels_compile_for_a_gpu_without_one(tmp_path: Path) -> None:
    """Triton's compiler checks what its interpreter does not (every name a kernel reads, its annotations
    included): both kernels compile to code for an H100-class GPU (sm_90) on this machine, which needs none.
    In a process of its own: Triton's interpreter, once on, stays on in a process (TRITON_INTERPRET)."""
    pytest.importorskip("triton.backends.nvidia", reason="needs Triton with its NVIDIA backend: skipped, not passed")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compiled afresh, not taken from an earlier run
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]


def compile_kernels() -> None:
    """Compile the split kernel in a few variants and the combine kernel for sm_90 (run as this file's main)."""
    compiler = importlib.import_module("triton.compiler")
    target = importlib.import_module("triton.backends.compiler").GPUTarget("cuda", 90, 32)
    jit = importlib.import_module("triton.runtime.jit").JITFunction
    partials = {"part_acc": "*fp32", "part_max": "*fp32", "part_sum": "*fp32"}
    variants = [  # (group, mask (0 none, 1 bool, 2 added), one split, dtype, values early, matrix products)
        (1, 0, True, "bf16", False, False), (4, 1, False, "bf16", True, False), (3, 2, False, "fp32", False, False),
        (1, 0, False, "bf16", True, True), (4, 1, False, "fp32", False, True),
    ]  # fmt: skip
    for group, mask, final, dtype, early, products in variants:
        rows = 16 if products else 4 if group > 1 else 1
        blocks = {"BLOCK_G": rows, "BLOCK_N": 32, "BLOCK_DK": 64, "BLOCK_DV": 64}
        constants = {"GROUP": group, "KEY_DIM": 64, "VALUE_DIM": 64, **blocks, "MASK": mask, "FINAL": final,
                     "SKIP_EMPTY": mask != 0, "VALUES_EARLY": early, "PRODUCTS": products,
                     "IEEE": dtype == "fp32"}  # fmt: skip
        pointers = dict.fromkeys(("query", "key", "value", "out"), f"*{dtype}") | partials
        pointers["mask"] = "*u8" if mask == 1 else f"*{dtype}"
        compile_kernel(compiler, jit(attention_split_kernel), target, constants, pointers)
    constants = {"VALUE_DIM": 64, "BLOCK_S": 8, "BLOCK_DV": 64}
    compile_kernel(compiler, jit(attention_combine_kernel), target, constants, {**partials, "out": "*bf16"})


def compile_kernel(
    compiler: Any, kernel: Any, target: Any, constants: dict[str, int], pointers: dict[str, str]
) -> None:
    """Compile `kernel` for `target` (pointer dtypes as Triton names them; other parameters 32-bit ints but the
    scale, a float) down to a GPU binary."""
    signature = {
        name: pointers.get(name, "constexpr" if name in constants else "fp32" if name == "scale" else "i32")
        for name in kernel.arg_names
    }
    source = compiler.ASTSource(fn=kernel, signature=signature, constexprs=constants)
    options = {"num_warps": 4, "enable_fp_fusion": True}
    if "cubin" not in compiler.compile(source, target=target, options=options).asm:
        msg = f"{kernel} compiled to no GPU binary"
        raise RuntimeError(msg)


def test_inputs_the_kernel_does_not_take_are_refused() -> None:
    query, key, value, _ = Case("", 2, 4, 2, 20, 16, None, 1, 1).inputs()
    with pytest.raises(CacheShapeError, match=r"query \(batch, heads, 1, head_dim\)") as raised:
        decode_attention(query.expand(2, 4, 3, 16), key, value)
    assert isinstance(raised.value, ValueError)
    with pytest.raises(CacheShapeError, match="heads a multiple of kv_heads"):
        decode_attention(query[:, :3], key, value)
    with pytest.raises(CacheShapeError, match="all of one dtype"):
        decode_attention(query, key.half(), value)
    with pytest.raises(CacheShapeError, match=r"broadcastable to \(2, 4, 1, 20\), got \(2, 1, 1, 19\)"):
        decode_attention(query, key, value, torch.ones(2, 1, 1, 19, dtype=torch.bool))
    with pytest.raises(CacheShapeError, match="a 4-D bool or float mask"):
        decode_attention(query, key, value, torch.ones(2, 1, 1, 20, dtype=torch.long))
    with pytest.raises(InvalidArgumentError, match="splits must be a positive int, got 0"):
        decode_attention(query, key, value, splits=0)


def test_op_passes_torch_library_checks() -> None:
    """The schema, the fake implementation (shapes, strides, dtype) and AOT dispatch, by torch.library.opcheck."""
    query, key, value, mask = Case("", 2, 4, 2, 40, 16, "bool", 2, 1).inputs()
    for products in (False, True):
        arguments = (query, key, value, mask, 0.25, 2, products)
        torch.library.opcheck(torch.ops.cachelife.decode_attention.default, arguments)


def test_op_compiles_with_fullgraph() -> None:
    """Dynamo traces the op through its fake implementation; inductor (CPU) calls it in the compiled code."""
    torch._dynamo.reset()
    query, key, value, mask = Case("", 2, 4, 2, 150, 16, "bool", 2, 2).inputs()

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return decode_attention(query * 2, key, value, mask, splits=2).sum(dim=-1)

    compiled = torch.compile(attend, fullgraph=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        output = compiled(query, key, value, mask)
    assert op_calls(profile) >= 1
    assert_float32_close(output, softmax_reference(query * 2, key, value, mask).sum(dim=-1))


# -- the attention function and models ------------------------------------------------------------------------


def op_calls(profile: torch.profiler.profile) -> int:
    return sum(event.count for event in profile.key_averages() if event.key == OP)


def test_attention_function_takes_one_query_and_hands_more_to_sdpa() -> None:
    module = nn.Module()
    query, key, value, mask = Case("", 2, 4, 4, 30, 16, "bool", 1, 1).inputs()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        output, weights = decode_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert op_calls(profile) == 1
    assert weights is None
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert output.shape == expected.shape == (2, 1, 4, 16)  # (batch, q_len, heads, head_dim)
    torch.testing.assert_close(output, expected)
    three = torch.randn(2, 4, 3, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        output, _ = decode_attention_forward(module, three, key, value, mask)
    assert op_calls(profile) == 0
    assert torch.equal(output, sdpa_attention_forward(module, three, key, value, mask)[0])
    # No mask and no bias (Whisper's cross-attention): no key to skip, so SDPA reads them all.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        output, _ = decode_attention_forward(module, query, key, value, None)
    assert op_calls(profile) == 0
    assert torch.equal(output, sdpa_attention_forward(module, query, key, value, None)[0])


def test_attention_function_adds_t5s_position_bias() -> None:
    module = nn.Module()
    query, key, value, mask = Case("", 2, 4, 4, 30, 16, "bool", 1, 1).inputs()
    bias = torch.randn(1, 4, 1, 30)
    output, _ = decode_attention_forward(module, query, key, value, mask, scaling=1.0, position_bias=bias)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=1.0, position_bias=bias)
    torch.testing.assert_close(output, expected)


NEW = 6
# name -> how many attention layers of each decoder step the kernel runs, and whether the prompt's step does:
# cross-attention with neither mask nor bias (Whisper's; BART's over unpadded prompts) stays on SDPA, T5's
# (its position bias) takes the kernel.
MODELS = {"llama": (2, False), "whisper": (2, True), "bart": (2, True), "t5": (4, True)}


def greedy(model: PreTrainedModel, inputs: zoo.Inputs, new: int = NEW, **settings: Any) -> Any:
    """`generate`'s output with its tokens and each step's logits."""
    return model.generate(
        **inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
        return_dict_in_generate=True, output_logits=True, **settings,
    )  # fmt: skip


def op_calls_and_sdpas_tokens(name: str) -> int:
    """How many calls of the op a model's static-cache greedy decoding makes with the decode attention switched
    on, after checking its tokens equal SDPA's and, to float32 rounding, its logits."""
    built = zoo.build(name)
    inputs = built.inputs(2, 7, 0)
    expected = greedy(built.model, inputs)
    switch = use_decode_attention(built.model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        output = greedy(built.model, inputs)
    switch.restore()
    assert torch.equal(output.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(output.logits), torch.stack(expected.logits), atol=1e-4, rtol=1e-4)
    return op_calls(profile)


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_equal_sdpas(name: str) -> None:
    """Static-cache greedy decoding: self-attention (and cross-attention) of every step after the prompt
    through the op, with SDPA's tokens and, to float32 rounding, its logits."""
    layers, first_step = MODELS[name]
    assert op_calls_and_sdpas_tokens(name) == layers * (NEW if first_step else NEW - 1)


@needs_triton
@pytest.mark.parametrize("name", ["whisper", "bart"])
def test_unmasked_cross_attention_by_the_kernels_products_gives_sdpas_tokens(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `UNMASKED_BY_KERNEL`, cross-attention without a mask or bias takes the op too (its matrix products;
    float32 products stay exact): both attentions of every decoder layer at each step (a one-token decoder
    prompt's too), SDPA's tokens and logits."""
    monkeypatch.setattr(decode_attention_module, "UNMASKED_BY_KERNEL", True)
    layers, _ = MODELS[name]
    assert op_calls_and_sdpas_tokens(name) == 2 * layers * NEW


def test_switching_sets_every_config_and_restores_each() -> None:
    """T5's encoder and decoder stacks hold copies of the model's config (which transformers 5.17's
    `set_attn_implementation` leaves as they were): each is switched, and each gets its own value back."""
    model = zoo.build("t5").model
    configs = {id(c): c for m in model.modules() if isinstance(c := getattr(m, "config", None), PreTrainedConfig)}
    assert len(configs) == 3
    first = next(iter(configs.values()))
    first._attn_implementation = "eager"
    before = [config._attn_implementation for config in configs.values()]
    assert before == ["eager", "sdpa", "sdpa"]
    switch = use_decode_attention(model)
    assert [config._attn_implementation for config in configs.values()] == [ATTENTION] * 3
    switch.restore()
    assert [config._attn_implementation for config in configs.values()] == before


def test_transformers_takes_the_registered_name() -> None:
    model = zoo.build("llama").model
    model.set_attn_implementation(register_decode_attention())
    assert model.config._attn_implementation == ATTENTION


class OwnAttention(nn.Module):
    """Attention written out in the model's module, as models from before transformers' attention interface
    (transformers tells them by their source: an attention class, and no call of the interface)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        scores = hidden @ hidden.transpose(-1, -2)
        return torch.softmax(scores, dim=-1) @ hidden


class OwnAttentionModel(PreTrainedModel):
    config_class = LlamaConfig

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.attention = OwnAttention()


def test_models_with_their_own_attention_are_refused() -> None:
    model = OwnAttentionModel(zoo.llama_tiny())
    before = model.config._attn_implementation
    with pytest.raises(UnsupportedGenerationError, match="OwnAttentionModel computes attention outside") as raised:
        use_decode_attention(model)
    assert isinstance(raised.value, ValueError)
    assert model.config._attn_implementation == before


# -- bf16: teacher-forced logits against an fp32 reference ----------------------------------------------------

# Query projections scaled by this power of two (exact in bf16): attention as peaked as a trained model's, where
# random weights give nearly uniform attention that hides what a kernel does to its scores.
SHARPEN = 32.0
# The kernel's bf16 logits may be at most this many times as far from the fp32 reference as SDPA's bf16 logits.
AGREEMENT_BOUND = 2.0


class Forced(LogitsProcessor):
    """Teacher forcing: the k-th new token is `tokens[:, k]` whatever the scores, so that every run decodes
    the same sequence and its logits can be compared step by step."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens
        self.step = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = torch.full_like(scores, -math.inf)
        forced.scatter_(1, self.tokens[:, self.step, None].to(scores.device), 0.0)
        self.step += 1
        return forced  # type: ignore[return-value]  # transformers annotates FloatTensor, a Tensor at run time


def sharpened(name: str, device: str, dtype: torch.dtype) -> zoo.ZooModel:
    built = zoo.build(name, device=device, dtype=dtype)
    with torch.no_grad():
        for module_name, module in built.model.named_modules():
            if module_name.endswith("q_proj") and isinstance(module, nn.Linear):
                module.weight.mul_(SHARPEN)
                if module.bias is not None:
                    module.bias.mul_(SHARPEN)
    return built


def forced_logits(model: PreTrainedModel, inputs: zoo.Inputs, tokens: torch.Tensor) -> torch.Tensor:
    """(steps, batch, vocab) float32: the logits of each step of an eager static-cache decode fed `tokens`
    (transformers would compile it on CUDA otherwise)."""
    steps = tokens.shape[1]
    output: Any = model.generate(
        **inputs, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, cache_implementation="static",
        disable_compile=True, return_dict_in_generate=True, output_logits=True,
        logits_processor=LogitsProcessorList([Forced(tokens)]),
    )  # fmt: skip
    assert torch.equal(output.sequences[:, -steps:].cpu(), tokens.cpu())  # the forcing held
    return torch.stack(output.logits).float()


def logit_error(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative RMS distance of `logits` from `reference`, over every step, row and token."""
    return float((logits - reference).norm() / reference.norm())


def agreement(name: str, device: str, steps: int) -> tuple[float, float]:
    """The bf16 kernel's and bf16 SDPA's logit errors against fp32 SDPA, all teacher-forced along the tokens
    bf16 SDPA decodes greedily."""
    exact, rounded = sharpened(name, device, torch.float32), sharpened(name, device, torch.bfloat16)
    inputs = rounded.inputs(2, 12, 3)
    tokens = greedy(rounded.model, inputs, steps, disable_compile=True).sequences[:, -steps:]
    reference = forced_logits(exact.model, exact.inputs(2, 12, 3), tokens)
    sdpa = forced_logits(rounded.model, inputs, tokens)
    switch = use_decode_attention(rounded.model)
    # acc_events: torch 2.11 warns without it that its profiler clears events, and the tests take warnings as errors.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as profile:
        kernel = forced_logits(rounded.model, inputs, tokens)
    switch.restore()
    assert op_calls(profile) > 0
    return logit_error(kernel, reference), logit_error(sdpa, reference)


def check_agreement(name: str, device: str, steps: int, record_property: Callable[[str, object], None]) -> None:
    kernel, sdpa = agreement(name, device, steps)
    record_property("kernel_logit_error", kernel)
    record_property("sdpa_logit_error", sdpa)
    assert sdpa > 0  # bf16 rounds: a zero error would mean the reference is not fp32
    assert kernel <= AGREEMENT_BOUND * sdpa, (kernel, sdpa)


@needs_triton
@pytest.mark.parametrize("name", ["llama", "whisper"])
def test_bf16_teacher_forced_logits_agree_with_fp32_as_well_as_sdpas(
    name: str, record_property: Callable[[str, object], None]
) -> None:
    """Triton's interpreter, the tiny models, 16 steps: the kernel's bf16 logits are within `AGREEMENT_BOUND`
    times SDPA's own bf16 error of the fp32 logits."""
    check_agreement(name, "cpu", 16, record_property)


# -- on a GPU: the compiled Triton kernels ---------------------------------------------------------------------

GPU_CASES = [case for case in CASES if case.name in ("gqa-bool-mask", "mqa-added-mask", "bf16-gqa", "fp16-added")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=[case.name for case in GPU_CASES])
def test_kernel_on_cuda_equals_a_plain_softmax(case: Case) -> None:
    query, key, value, mask = case.inputs("cuda")
    expected = softmax_reference(query, key, value, mask)
    output = decode_attention(query, key, value, mask, splits=case.splits)
    tolerance = TOLERANCE[case.dtype]
    torch.testing.assert_close(output.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whisper_large_cross_attention_shape_on_cuda(dtype: torch.dtype) -> None:
    """The case the kernel is for: 20 heads over 1500 encoder positions, splits chosen from the GPU's SMs."""
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(shape, generator=generator).to("cuda", dtype) for shape in
                         ((1, 20, 1, 64), (1, 20, 1500, 64), (1, 20, 1500, 64)))  # fmt: skip
    tolerance = TOLERANCE[dtype]
    expected = softmax_reference(query, key, value, None)
    torch.testing.assert_close(decode_attention(query, key, value).double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama-small", "whisper-small"])
def test_bf16_teacher_forced_logits_agree_with_fp32_as_well_as_sdpas_on_cuda(
    name: str, record_property: Callable[[str, object], None]
) -> None:
    """The compiled kernel, the small models, 128 steps: as on the CPU."""
    check_agreement(name, "cuda", 128, record_property)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty:UserWarning")
@pytest.mark.filterwarnings("ignore:.*Profiler clears events:UserWarning")  # torch's profiler's note
@pytest.mark.parametrize("name", ["llama-small", "whisper-small"])
def test_compiled_step_captures_the_op_in_cuda_graphs(name: str) -> None:
    """`cachelife.generate` (a fullgraph-compiled step in cachelife's CUDA graphs), fp32, with the op in every
    attention layer: the tokens of `generate` with SDPA, one capture, and the op ran while it was captured."""
    built = zoo.build(name, device="cuda")
    inputs = built.inputs(2, 9, 1)
    expected = zoo.generate_tokens(built.model, inputs, max_new_tokens=24, min_new_tokens=24)
    use_decode_attention(built.model)
    model = cachelife.enable(built.model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        first = cachelife.generate(model, fallback=False, max_new_tokens=24, min_new_tokens=24, **inputs)
    again = cachelife.generate(model, fallback=False, max_new_tokens=24, min_new_tokens=24, **inputs)
    assert op_calls(profile) > 0
    assert isinstance(first, torch.Tensor)
    assert isinstance(again, torch.Tensor)
    assert torch.equal(first, expected)
    assert torch.equal(again, expected)
    assert runtime_of(model).captures == 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices: skipped, not passed")
def test_kernel_on_a_gpu_other_than_the_current_one() -> None:
    """Triton launches on the current device: tensors on cuda:1 while cuda:0 is current still get their own."""
    case = GPU_CASES[0]
    query, key, value, mask = case.inputs("cuda:1")
    expected = softmax_reference(query, key, value, mask)
    with torch.cuda.device(0):
        output = decode_attention(query, key, value, mask, splits=case.splits)
    tolerance = TOLERANCE[case.dtype]
    torch.testing.assert_close(output.double(), expected, atol=tolerance, rtol=tolerance)


if __name__ == "__main__":
    compile_kernels()
