"""Attention for one query over a static cache, split over the cached positions (flash-decoding).

At one query a step's attention has too little work per (batch, head) to fill a GPU: cross-attention over
1500 encoder positions with 20 heads gives 20 programs. The positions are cut into splits instead: phase 1
runs one program per (batch, key/value head, split) over every query head of that key/value head (so
grouped-query attention reads its keys once) and keeps the split's running maximum, sum and unnormalised
output; phase 2 combines the splits of each (batch, head). Tiles whose positions the mask excludes entirely
are skipped, so that an empty part of a static cache costs no reads. Scores, sums and outputs accumulate in
float32 for bfloat16, float16 and float32 inputs.

`decode_attention` runs the custom op `cachelife::decode_attention`: Triton kernels on CUDA tensors, and on
CPU tensors under `TRITON_INTERPRET=1`; plain torch ops everywhere else. Its fake implementation lets dynamo
trace it with `fullgraph=True`; the number of splits depends on static shapes only, so the op captures in CUDA
graphs. `cachelife.model_rewrites.decode_attention` makes it a transformers attention implementation.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Final

import attrs
import torch
from attrs import frozen

from cachelife.errors import CacheShapeError
from cachelife.kernels.triton_support import (
    DTYPES,
    LAUNCH,
    Pointer,
    Scalar,
    constexpr,
    launching_on,
    multiprocessors,
    power_of_two_at_least,
    tl,
    triton,
    triton_runs_on,
)
from cachelife.validate import check_int

# Most splits per (batch, key/value head): phase 2 combines them in one tile.
MAX_SPLITS: Final = 64
# Elements of phase 1's largest tile (query heads x positions x head size), which sets the positions per tile.
_TILE_ELEMENTS: Final = 8192
# Phase 1's programs per streaming multiprocessor: a decode call's programs are short, so more of them than
# the machine holds at once keep it busier (bench/results' decode-attention sweeps).
PROGRAMS_PER_SM: Final = 8
# The split kernel's MASK: none, bool or added to the scores (it compares numbers: Triton kernels read no
# Python globals).
_NO_MASK: Final = 0
_BOOL_MASK: Final = 1
_ADDED_MASK: Final = 2
# The fewest rows of a matrix product's left operand (tl.dot), which query heads are padded to.
_PRODUCT_ROWS: Final = 16


def attention_split_kernel(  # noqa: PLR0912, PLR0915, PLR0917 (a Triton kernel: every pointer, size and stride positionally)
    query: Pointer, key: Pointer, value: Pointer, mask: Pointer, out: Pointer,
    part_acc: Pointer, part_max: Pointer, part_sum: Pointer,
    scale: Scalar, heads: Scalar, positions: Scalar, split_size: Scalar, splits: Scalar,
    q_sb: Scalar, q_sh: Scalar, q_sd: Scalar,
    k_sb: Scalar, k_sh: Scalar, k_sp: Scalar, k_sd: Scalar,
    v_sb: Scalar, v_sh: Scalar, v_sp: Scalar, v_sd: Scalar,
    m_sb: Scalar, m_sh: Scalar, m_sp: Scalar,
    o_sb: Scalar, o_sh: Scalar, o_sd: Scalar,
    GROUP: constexpr, KEY_DIM: constexpr, VALUE_DIM: constexpr,
    BLOCK_G: constexpr, BLOCK_N: constexpr, BLOCK_DK: constexpr, BLOCK_DV: constexpr,
    MASK: constexpr, FINAL: constexpr, SKIP_EMPTY: constexpr, VALUES_EARLY: constexpr, PRODUCTS: constexpr,
    IEEE: constexpr,
) -> None:  # fmt: skip
    """Phase 1, in Triton's language: one (batch, key/value head, split). With one split (FINAL) it writes the
    output itself. MASK is 0 (none), 1 (bool, nonzero attends) or 2 (added to the scores). SKIP_EMPTY tests each
    tile for a live position before reading it (a branch in the loop, which keeps the compiler from pipelining
    the loads): worth it where a mask can empty whole tiles; without one, a tile past the cache reads nothing.
    VALUES_EARLY asks for a tile's values before its scores are computed, so that both reads are in flight at
    once (more registers per program); the arithmetic is the same either way. PRODUCTS computes the scores and
    the weighted values as matrix products (tl.dot, at least 16 query rows, the weights rounded to the values'
    dtype first, as flash attention rounds them; IEEE keeps float32 products exact instead of TF32)."""
    kv_heads = heads // GROUP
    batch = (tl.program_id(0) // kv_heads).to(tl.int64)
    kv_head = (tl.program_id(0) % kv_heads).to(tl.int64)
    split = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + g
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q_in = (g < GROUP)[:, None] & (dk < KEY_DIM)[None, :]
    q_raw = tl.load(query + batch * q_sb + head[:, None] * q_sh + dk[None, :] * q_sd, mask=q_in, other=0.0)
    q = q_raw.to(tl.float32)
    keys = key + batch * k_sb + kv_head * k_sh
    values = value + batch * v_sb + kv_head * v_sh
    best = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    for offset in range(0, split_size, BLOCK_N):
        n = split * split_size + offset + tl.arange(0, BLOCK_N)
        n_in = n < positions
        live = (g < GROUP)[:, None] & n_in[None, :]
        if MASK != 0:
            bias = tl.load(mask + batch * m_sb + head[:, None] * m_sh + n[None, :] * m_sp, mask=live, other=0)
            if MASK == 1:
                live = live & (bias != 0)
            else:
                bias = bias.to(tl.float32)
                live = live & (bias > float("-inf"))
        visit = True
        if SKIP_EMPTY:
            visit = tl.max(tl.max(live.to(tl.int32), axis=1), axis=0) > 0
        if visit:
            k_in = n_in[:, None] & (dk < KEY_DIM)[None, :]
            k = tl.load(keys + n[:, None] * k_sp + dk[None, :] * k_sd, mask=k_in, other=0.0)
            v_in = n_in[:, None] & (dv < VALUE_DIM)[None, :]
            if VALUES_EARLY:
                v = tl.load(values + n[:, None] * v_sp + dv[None, :] * v_sd, mask=v_in, other=0.0)
            if PRODUCTS:
                if IEEE:
                    scores = tl.dot(q_raw, tl.trans(k), input_precision="ieee") * scale
                else:
                    scores = tl.dot(q_raw, tl.trans(k)) * scale
            else:
                scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
            if MASK == 2:
                scores += bias
            scores = tl.where(live, scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            # Rows with nothing live yet keep a finite shift, so that no inf - inf appears.
            shift = tl.where(new_best == float("-inf"), 0.0, new_best)
            rescale = tl.exp(best - shift)
            weights = tl.exp(scores - shift[:, None])
            if not VALUES_EARLY:
                v = tl.load(values + n[:, None] * v_sp + dv[None, :] * v_sd, mask=v_in, other=0.0)
            if PRODUCTS:
                if IEEE:  # noqa: SIM108 (Triton compiles branches on a constexpr, not every conditional expression)
                    weighted = tl.dot(weights, v, input_precision="ieee")
                else:
                    weighted = tl.dot(weights.to(v.dtype), v)
            else:
                weighted = tl.sum(weights[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * rescale[:, None] + weighted
            total = total * rescale + tl.sum(weights, axis=1)
            best = new_best
    out_in = (g < GROUP)[:, None] & (dv < VALUE_DIM)[None, :]
    if FINAL:
        # A row that the mask excludes entirely has total 0 and gives zeros.
        result = acc / tl.where(total > 0, total, 1.0)[:, None]
        target = out + batch * o_sb + head[:, None] * o_sh + dv[None, :] * o_sd
        tl.store(target, result.to(out.dtype.element_ty), mask=out_in)
    else:
        part = (batch * heads + head) * splits + split
        tl.store(part_max + part, best, mask=g < GROUP)
        tl.store(part_sum + part, total, mask=g < GROUP)
        tl.store(part_acc + part[:, None] * VALUE_DIM + dv[None, :], acc, mask=out_in)


def attention_combine_kernel(  # noqa: PLR0917 (a Triton kernel, as above)
    part_acc: Pointer, part_max: Pointer, part_sum: Pointer, out: Pointer,
    heads: Scalar, splits: Scalar, o_sb: Scalar, o_sh: Scalar, o_sd: Scalar,
    VALUE_DIM: constexpr, BLOCK_S: constexpr, BLOCK_DV: constexpr,
) -> None:  # fmt: skip
    """Phase 2, in Triton's language: one (batch, head); weighs each split by exp(its maximum - the overall maximum)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    s_in = s < splits
    best = tl.load(part_max + row * splits + s, mask=s_in, other=float("-inf"))
    top = tl.max(best, axis=0)
    weights = tl.exp(best - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(weights * tl.load(part_sum + row * splits + s, mask=s_in, other=0.0), axis=0)
    acc_in = s_in[:, None] & (dv < VALUE_DIM)[None, :]
    acc = tl.load(part_acc + (row * splits + s)[:, None] * VALUE_DIM + dv[None, :], mask=acc_in, other=0.0)
    result = tl.sum(weights[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    target = out + (row // heads) * o_sb + (row % heads) * o_sh + dv * o_sd
    tl.store(target, result.to(out.dtype.element_ty), mask=dv < VALUE_DIM)


@functools.cache
def _jitted() -> tuple[Any, Any]:
    """The two kernels, jitted on first use (after the process set TRITON_INTERPRET, if it does)."""
    return triton.jit(attention_split_kernel), triton.jit(attention_combine_kernel)


@frozen(kw_only=True)
class SplitPlan:
    """How one call is cut: tiles of `block_n` positions; `splits` programs per (batch, key/value head), each
    over `split_size` positions (whole tiles; the last split may reach past the cache); block sizes for the
    query heads of a group and the key and value head sizes (powers of two)."""

    block_g: int
    block_n: int
    block_dk: int
    block_dv: int
    splits: int
    split_size: int


def plan_splits(
    *, batch: int, kv_heads: int, group: int, positions: int, key_dim: int, value_dim: int, programs: int,
    splits: int | None = None, block_n: int | None = None,
) -> SplitPlan:  # fmt: skip
    """The plan for these static shapes: as many splits as bring the programs of phase 1 to `programs` (or
    `splits` if given), at most one per tile and `MAX_SPLITS`, then as few as keep the same tiles per split.
    Tiles hold `block_n` positions (a power of two) if given, else as many as fit `_TILE_ELEMENTS`."""
    block_g = power_of_two_at_least(group)
    block_dk, block_dv = power_of_two_at_least(key_dim), power_of_two_at_least(value_dim)
    if block_n is None:
        fit = _TILE_ELEMENTS // (block_g * max(block_dk, block_dv))
        block_n = min(max(1 << max(fit, 1).bit_length() - 1, 16), 128)
    tiles = math.ceil(positions / block_n)
    wanted = splits if splits is not None else math.ceil(programs / (batch * kv_heads))
    tiles_per_split = math.ceil(tiles / min(max(wanted, 1), tiles, MAX_SPLITS))
    count = math.ceil(tiles / tiles_per_split)
    return SplitPlan(
        block_g=block_g,
        block_n=block_n,
        block_dk=block_dk,
        block_dv=block_dv,
        splits=count,
        split_size=tiles_per_split * block_n,
    )


def input_problem(  # noqa: PLR0911 (one message per kind of problem)
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> str:
    """What keeps these inputs from the kernel ("" when nothing does)."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.shape[2] != 1:
        return f"query (batch, heads, 1, head_dim) and 4-D key and value, got {_shapes(query, key, value)}"
    batch, heads, _, key_dim = query.shape
    kv_heads, positions = key.shape[1], key.shape[2]
    if key.shape[0] != batch or value.shape[:3] != key.shape[:3] or key.shape[3] != key_dim:
        shapes = _shapes(query, key, value)
        return f"key and value (batch, kv_heads, positions, _) of the query's batch and head_dim, got {shapes}"
    if kv_heads == 0 or heads % kv_heads != 0 or positions == 0:
        return f"heads a multiple of kv_heads and at least one position, got {_shapes(query, key, value)}"
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"query, key and value all of one dtype of {DTYPES}, got {query.dtype}, {key.dtype}, {value.dtype}"
    if not query.device == key.device == value.device:
        return f"query, key and value on one device, got {query.device}, {key.device}, {value.device}"
    if mask is None:
        return ""
    if mask.dim() != 4 or not (mask.dtype == torch.bool or mask.dtype.is_floating_point) or mask.device != query.device:
        return f"a 4-D bool or float mask on {query.device}, got {mask.dtype} {tuple(mask.shape)} on {mask.device}"
    if any(size not in (1, full) for size, full in zip(mask.shape, (batch, heads, 1, positions), strict=True)):
        return f"a mask broadcastable to {(batch, heads, 1, positions)}, got {tuple(mask.shape)}"
    return ""


def _shapes(*tensors: torch.Tensor) -> str:
    return ", ".join(str(tuple(tensor.shape)) for tensor in tensors)


def _check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> None:
    if problem := input_problem(query, key, value, mask):
        msg = f"decode_attention expects {problem}"
        raise CacheShapeError(msg)


def reference_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None,
    *, scaling: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """The op in plain torch ops (its fallback without Triton): float32 scores, softmax and sums, zeros for a
    query that the mask excludes entirely."""
    _check_inputs(query, key, value, mask)
    batch, heads, _, key_dim = query.shape
    kv_heads, positions = key.shape[1], key.shape[2]
    scale = key_dim**-0.5 if scaling is None else scaling
    grouped = query.float().reshape(batch, kv_heads, heads // kv_heads, key_dim)
    scores = torch.einsum("bkgd,bkpd->bkgp", grouped, key.float()).reshape(batch, heads, 1, positions) * scale
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask.float()
    best = scores.amax(dim=-1, keepdim=True)
    weights = torch.exp(scores - best.masked_fill(best == float("-inf"), 0.0))
    total = weights.sum(dim=-1, keepdim=True)
    grouped_weights = (weights / total.masked_fill(total == 0, 1.0)).reshape(batch, kv_heads, -1, positions)
    output = torch.matmul(grouped_weights, value.float()).reshape(batch, heads, 1, value.shape[-1])
    return output.to(query.dtype)


def _programs(device: torch.device) -> int:
    """How many programs phase 1 aims at on `device`: a few per streaming multiprocessor."""
    return PROGRAMS_PER_SM * multiprocessors(device)


def _triton_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, *, scale: float,
    splits: int, products: bool,
) -> torch.Tensor:  # fmt: skip
    batch, heads, _, key_dim = query.shape
    plan = plan_splits(
        batch=batch, kv_heads=key.shape[1], group=heads // key.shape[1], positions=key.shape[2], key_dim=key_dim,
        value_dim=value.shape[3], programs=_programs(query.device), splits=splits or None,
    )  # fmt: skip
    return launch_plan(query, key, value, mask, scale=scale, plan=plan, products=products)


def launch_plan(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, *, scale: float,
    plan: SplitPlan, num_warps: int = LAUNCH["num_warps"], skip_empty: bool | None = None,
    num_stages: int | None = None, values_early: bool = False, products: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The Triton kernels on checked inputs, cut as `plan` says, with `num_warps` per program; `skip_empty` (by
    default: whether there is a mask) tests each tile for a live position before reading it; `num_stages` (by
    default Triton's) sets how many tiles phase 1's loop pipelines, `values_early` whether a tile's values are
    read before its scores are computed, `products` whether the kernel computes with matrix products (its query
    heads padded to 16). The op launches this with its own plan; benchmarks compare others
    (bench/decode_attention.py)."""
    batch, heads, _, key_dim = query.shape
    kv_heads, positions, value_dim = key.shape[1], key.shape[2], value.shape[3]
    if products:
        plan = attrs.evolve(plan, block_g=max(plan.block_g, _PRODUCT_ROWS))
    out = torch.empty((batch, heads, 1, value_dim), dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    if mask is None:
        mask_kind, mask_arg, mask_strides = _NO_MASK, query, (0, 0, 0)
    else:
        full = mask.expand(batch, heads, 1, positions)
        mask_kind = _BOOL_MASK if mask.dtype == torch.bool else _ADDED_MASK
        mask_arg = full.view(torch.uint8) if mask.dtype == torch.bool else full
        mask_strides = (full.stride(0), full.stride(1), full.stride(3))
    final = plan.splits == 1
    rows = (batch, heads, plan.splits)
    part_acc = out if final else torch.empty((*rows, value_dim), dtype=torch.float32, device=query.device)
    part_max = out if final else torch.empty(rows, dtype=torch.float32, device=query.device)
    part_sum = out if final else torch.empty(rows, dtype=torch.float32, device=query.device)
    out_strides = (out.stride(0), out.stride(1), out.stride(3))
    launch: dict[str, Any] = {**LAUNCH, "num_warps": num_warps}
    if num_stages is not None:
        launch["num_stages"] = num_stages
    split, combine = _jitted()
    with launching_on(query.device):
        split[(batch * kv_heads, plan.splits)](
            query, key, value, mask_arg, out, part_acc, part_max, part_sum,
            scale, heads, positions, plan.split_size, plan.splits,
            query.stride(0), query.stride(1), query.stride(3), *key.stride(), *value.stride(), *mask_strides,
            *out_strides,
            GROUP=heads // kv_heads, KEY_DIM=key_dim, VALUE_DIM=value_dim, BLOCK_G=plan.block_g, BLOCK_N=plan.block_n,
            BLOCK_DK=plan.block_dk, BLOCK_DV=plan.block_dv, MASK=mask_kind, FINAL=final,
            SKIP_EMPTY=mask is not None if skip_empty is None else skip_empty, VALUES_EARLY=values_early,
            PRODUCTS=products, IEEE=query.dtype == torch.float32, **launch,
        )  # fmt: skip
        if not final:
            combine[(batch * heads,)](
                part_acc, part_max, part_sum, out, heads, plan.splits, *out_strides,
                VALUE_DIM=value_dim, BLOCK_S=power_of_two_at_least(plan.splits), BLOCK_DV=plan.block_dv, **LAUNCH,
            )  # fmt: skip
    return out


@torch.library.custom_op("cachelife::decode_attention", mutates_args=())
def _decode_attention_op(  # noqa: PLR0917 (an op's schema is positional)
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float, splits: int,
    products: bool,
) -> torch.Tensor:  # fmt: skip
    """`splits` 0 lets the plan choose."""
    if triton_runs_on(query.device):
        return _triton_decode_attention(query, key, value, mask, scale=scale, splits=splits, products=products)
    return reference_decode_attention(query, key, value, mask, scaling=scale)


@_decode_attention_op.register_fake
def _(  # noqa: PLR0917 (the op's schema)
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float, splits: int,
    products: bool,
) -> torch.Tensor:  # fmt: skip
    _check_inputs(query, key, value, mask)
    return query.new_empty((query.shape[0], query.shape[1], 1, value.shape[3]))


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None,
    *, scaling: float | None = None, splits: int | None = None, products: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Attention of one query per (batch, head) over `positions` keys, as (batch, heads, 1, value_dim).

    `query` is (batch, heads, 1, head_dim), `key` and `value` (batch, kv_heads, positions, _), heads a
    multiple of kv_heads (grouped-query attention); `mask` (bool: True attends; float: added to the scores)
    broadcasts to (batch, heads, 1, positions). `scaling` defaults to head_dim ** -0.5; `splits` (at most one
    per tile of positions, and `MAX_SPLITS`) overrides the plan's choice. `products` computes with matrix
    products (the weights rounded to the inputs' dtype before they weigh the values, as flash attention rounds
    them; float32 stays exact), which reads the keys and values at a faster pace on a GPU.
    """
    _check_inputs(query, key, value, mask)
    if splits is not None:
        check_int("splits", splits)
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    output: torch.Tensor = _decode_attention_op(query, key, value, mask, scale, splits or 0, products)
    return output
