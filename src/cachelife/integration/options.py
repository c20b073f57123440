"""What `cachelife.enable` installs on a model, as one value: `Options`, frozen, keyword-only and checked when it
is made, and its presets: `DEFAULT` (`Options()`: fused projections, the one lever that keeps `model.generate`'s
tokens), `EXACT` (nothing on: the model's own operations) and `FAST` (the levers that cut the decoding step's
kernel time, at the price of other rounding).

Each boolean field is one lever, applied to the model as one reversible rewrite
(`cachelife.integration.rewrites`); `compile_options` are the inductor options of cachelife's compiled steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

import attrs
from attrs import field, frozen

from cachelife.integration.compiled import FAST_KERNELS, CompileOptions, checked_options
from cachelife.validate import check_bool


def _is_bool(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    check_bool(attribute.name, value)


def _read_only(options: Mapping[str, object] | None) -> CompileOptions:
    """`options` as `checked_options` checks them, in a mapping nobody can change."""
    return MappingProxyType(checked_options(options))


@frozen(kw_only=True, repr=False)
class Options:
    """The levers `cachelife.enable` installs on a model. `fuse_projections` is on by default, every other field
    off (`DEFAULT`); each is checked when the value is made, and a wrong one raises `InvalidArgumentError` naming
    it.

    - `fuse_projections` (on by default): each layer's self-attention query, key and value, and a gated MLP's
      gate and up projections, as one matrix product (`cachelife.model_rewrites.fused_projections`). The weights
      are concatenated once, at `enable`, and the parameters become views of them: memory stays as it was but
      for zeros standing in for a missing bias. Each output is the same dot product as the separate layers',
      summed by a kernel the matrix-product library picks for the wider product: float32 tokens equal
      `model.generate`'s in the tests, and bf16 logits lie as close to transformers' compiled forward as the
      separate products'. Models without such groups (GPT-2's fused attention, quantized or adapted layers)
      are left as they are.
    - `decode_attention`: cachelife's split-KV attention kernel for one query as the attention implementation of
      every config the model holds, for self- and cross-attention (`cachelife.model_rewrites.decode_attention`;
      transformers' SDPA for prompts). A model with a part whose attention does not go through transformers'
      attention interface is refused with `UnsupportedGenerationError`.
    - `small_linear`: every decoding step's linear products of one row and few output features through
      cachelife's Triton kernel for few rows (`cachelife.kernels.linear`); the model itself is not changed.
    - `fused_layers`: each decoder layer of a family cachelife knows (Whisper's, Llama's) with its norms and
      residual adds folded into its products, for a decoding step of one row
      (`cachelife.model_rewrites.fused_layers`, `cachelife.kernels.layer_linear`); the parameters are not
      changed, and other models are left as they are, with a warning.
    - `compile_regions`: every layer of the model's stacks of identical layers marked as a compile region
      (`cachelife.model_rewrites.layer_regions`): a compiled step compiles one layer's code for all of them.
    - `compile_options`: inductor options added to the compilation of `cachelife.generate`'s steps on this
      model, unless a call passes its own (`cachelife.generate(compile_options=...)`). Names
      `torch._inductor.list_options()` knows, with str, int or bool values; not the two that cachelife sets
      itself (`triton.cudagraphs`, `emulate_precision_casts`).

    `disable`, or `enable` with other options, restores what a lever changed exactly; any change of the options
    releases the model's compiled steps and graphs (`cachelife.release`).
    """

    fuse_projections: bool = field(default=True, validator=_is_bool)
    decode_attention: bool = field(default=False, validator=_is_bool)
    small_linear: bool = field(default=False, validator=_is_bool)
    fused_layers: bool = field(default=False, validator=_is_bool)
    compile_regions: bool = field(default=False, validator=_is_bool)
    # Left out of the hash (a mapping has none); equal options still hash equal.
    compile_options: CompileOptions = field(factory=lambda: MappingProxyType({}), converter=_read_only, hash=False)

    def __repr__(self) -> str:
        """The fields that differ from the default's, as a call that makes this value."""
        default = Options()
        changed = [
            f"{item.name}={dict(value) if isinstance(value, Mapping) else value!r}"
            for item in attrs.fields(Options)
            if (value := getattr(self, item.name)) != getattr(default, item.name)
        ]
        return f"Options({', '.join(changed)})"


DEFAULT: Final = Options()
"""What `cachelife.enable` installs unless told otherwise: fused projections, nothing else."""

EXACT: Final = Options(fuse_projections=False)
"""Nothing on: every module of the model computes as it was written; `cachelife.generate` and an enabled
model's `generate` decode `model.generate`'s tokens."""

FAST: Final = Options(fuse_projections=True, decode_attention=True, compile_options=FAST_KERNELS)
"""Fused projections, cachelife's decode attention kernel and `FAST_KERNELS`: the levers that cut the decoding
step's GPU kernel time together (`bench.levers`, its `all` preset; whether wall time falls too depends on the
model and the device). They sum in other orders than the default step, so bf16 tokens can part from `EXACT`'s at
near ties."""
