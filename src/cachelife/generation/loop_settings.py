"""The settings of cachelife's decoding loop, as one value checked when it is made: `LoopSettings`, what a
`cachelife.generate` call (or an engine) asks of its steps beyond `model.generate`'s own arguments."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import torch
from attrs import field, frozen

from cachelife.errors import InvalidArgumentError
from cachelife.integration.buckets import Buckets, check_buckets
from cachelife.integration.compiled import CompileOptions, checked_options
from cachelife.validate import check_bool, check_choice, check_int

CudaGraphs = Literal["cachelife", "torch"]


def check_generator_type(generator: object) -> None:
    """Refuse anything but a `torch.Generator` or None (`InvalidArgumentError`)."""
    if generator is not None and not isinstance(generator, torch.Generator):
        msg = f"generator must be a torch.Generator or None, got {type(generator).__name__} {generator!r:.80}"
        raise InvalidArgumentError(msg)


def _is_positive(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    check_int(attribute.name, value)


def _is_bool(instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    check_bool(attribute.name, value)


def _is_generator(instance: object, attribute: attrs.Attribute[torch.Generator | None], value: object) -> None:
    check_generator_type(value)


def _is_cuda_graphs(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    check_choice(attribute.name, value, ("cachelife", "torch"))


def _optional_buckets(value: Sequence[int] | None) -> Buckets | None:
    return None if value is None else check_buckets(value)


@frozen(kw_only=True)
class LoopSettings:
    """cachelife's own settings of one `generate` call (`cachelife.generate` documents each) or of an engine's
    steps, with `generate`'s defaults. Checked when made: a wrong one raises `InvalidArgumentError` (buckets:
    `InvalidBucketsError`) naming it."""

    steps_per_call: int = field(default=1, validator=_is_positive)
    stop_check_every: int = field(default=8, validator=_is_positive)
    compile_step: bool = field(default=True, validator=_is_bool)
    fallback: bool = field(default=True, validator=_is_bool)
    generator: torch.Generator | None = field(default=None, validator=_is_generator)
    cuda_graphs: CudaGraphs = field(default="cachelife", validator=_is_cuda_graphs)
    compile_options: CompileOptions = field(factory=dict, converter=checked_options)
    encoder_buckets: Buckets | None = field(default=None, converter=_optional_buckets)

    @compile_options.validator
    def _compiled(self, attribute: attrs.Attribute[CompileOptions], value: CompileOptions) -> None:
        if value and not self.compile_step:
            msg = f"compile_options={dict(value)!r} need compile_step=True: the step runs eagerly without it"
            raise InvalidArgumentError(msg)
