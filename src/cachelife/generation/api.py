"""`cachelife.generate`: `model.generate`'s tokens from a compiled, graph-captured decoding loop.

`generate(model, **kwargs)` takes what `model.generate` takes and returns what it returns (the token
tensor, or with `return_dict_in_generate=True` its output object: sequences, scores, logits and the cache;
Whisper's dict of sequences and segments with `return_segments=True`).
transformers' `generate` prepares the call as always; cachelife replaces only the decoding method
(`method`, `searches`, `steps`): logits processors (`processors`), greedy search and sampling (`greedy`) and
beam search (`beams`) run inside one compiled step on pinned caches. What it does not implement
(`arguments`) falls back to `model.generate` with one WARNING naming the feature, or raises
`UnsupportedGenerationError` with `fallback=False`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

import attrs
import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria
from transformers.utils import ModelOutput

from cachelife.errors import InvalidArgumentError
from cachelife.generation.arguments import merged_config, unsupported_argument, unsupported_config
from cachelife.generation.loop_settings import CudaGraphs, LoopSettings, check_generator_type
from cachelife.generation.method import decoding_method, fall_back
from cachelife.integration.buckets import check_bucketable
from cachelife.integration.enabling import options_of
from cachelife.integration.runtime import collecting_after_compilation, runtime_of


def generate(
    model: PreTrainedModel,
    *,
    fallback: bool = True,
    steps_per_call: int = 1,
    stop_check_every: int = 8,
    compile_step: bool = True,
    generator: torch.Generator | None = None,
    cuda_graphs: CudaGraphs = "cachelife",
    compile_options: Mapping[str, str | int | bool] | None = None,
    encoder_buckets: Sequence[int] | None = None,
    **kwargs: Any,
) -> torch.Tensor | ModelOutput | dict[str, Any]:
    """`model.generate(**kwargs)`'s token tensor, decoded by cachelife's compiled loop (or, after a fallback,
    whatever `model.generate(**kwargs)` returns).

    `steps_per_call` decoding steps run per replay of the step's CUDA graph (per call of the compiled function
    without one); the host checks for the end every `stop_check_every` steps; `compile_step=False` runs the
    same step function eagerly; `generator` (a `torch.Generator` on the model's device) seeds sampling
    (exponential race; tokens are reproducible, not equal to `generate`'s multinomial draws; without one, a
    generator seeded from torch's global RNG). On a CUDA device, `cuda_graphs="cachelife"` captures
    `steps_per_call` calls of a one-step compiled function in one CUDA graph and replays it
    (`cachelife.generation.graphs`); `"torch"` compiles a `steps_per_call`-step function in torch's
    "reduce-overhead" mode (cudagraph trees) instead. `compile_options` are inductor options added to the
    step's compilation (`torch.compile(options=)`; each set of options compiles its own step), for example
    `{"max_autotune_gemm": True}`; the performance documentation says which ones were measured to help. Without
    them, an enabled model's steps compile with the compile options of its `cachelife.Options`; passed (even
    `{}`), they override those for the call.
    `encoder_buckets` (encoder-decoder models whose cross-attention honours the encoder mask), e.g.
    `(64, 128, 256)`, pads the encoder output and its mask to the smallest bucket that fits for this call, as
    `cachelife.enable(model, encoder_buckets=...)` does for every call of an enabled model.
    """
    check_model(model)
    settings = LoopSettings(
        steps_per_call=steps_per_call,
        stop_check_every=stop_check_every,
        compile_step=compile_step,
        fallback=fallback,
        generator=generator,
        cuda_graphs=cuda_graphs,
        compile_options=compile_options,
        encoder_buckets=encoder_buckets,
    )
    check_generator(generator, model)
    if settings.encoder_buckets is not None:
        check_bucketable(model)
    runtime = runtime_of(model)
    with runtime.lock, collecting_after_compilation():
        config = merged_config(model, kwargs)
        feature = unsupported_argument(kwargs) or unsupported_config(config)
        if feature is not None:
            fall_back(feature, fallback, model)
            return model.generate(**kwargs)
        kwargs = with_stop_string_criteria(kwargs, config)
        if compile_options is None and compile_step:  # read under the lock, where `enable` changes them
            settings = attrs.evolve(settings, compile_options=options_of(model).compile_options)
        called: list[bool] = []
        # A callable custom_generate does not get `generate`'s streamer: the decoding method is handed it here.
        method = decoding_method(settings, lambda: called.append(True), kwargs.get("streamer"))
        output = model.generate(**kwargs, custom_generate=method)
        if not called:  # a model whose own generate does not hand custom_generate on decoded it by itself
            fall_back(f"{type(model).__name__}.generate (it did not call cachelife's decoding method)", fallback, model)
        return _tokens(output, returns_dict=bool(getattr(config, "return_dict_in_generate", False)))


def with_stop_string_criteria(kwargs: dict[str, Any], config: GenerationConfig) -> dict[str, Any]:
    """`stop_strings` as a stopping criterion of the call: `generate` does not hand a callable custom_generate
    the tokenizer that it builds their criterion from (it pops it before it reads the method's own
    parameters), so the criterion is built here, as `generate` builds it, and evaluated at the host checks."""
    stop_strings, tokenizer = getattr(config, "stop_strings", None), kwargs.get("tokenizer")
    if stop_strings is None or tokenizer is None:
        return kwargs  # without a tokenizer, generate raises its own error
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(stop_strings=stop_strings, tokenizer=tokenizer))
    rest = {name: value for name, value in kwargs.items() if name != "tokenizer"}
    return {**rest, "stop_strings": None, "stopping_criteria": criteria}


def check_model(model: object) -> None:
    if not isinstance(model, PreTrainedModel) or not callable(getattr(model, "generate", None)):
        msg = f"cachelife.generate needs a transformers generation model (a PreTrainedModel), got {model!r:.80}"
        raise InvalidArgumentError(msg)


def check_generator(generator: object, model: PreTrainedModel) -> None:
    check_generator_type(generator)
    if isinstance(generator, torch.Generator) and generator.device.type != model.device.type:
        msg = (
            f"generator must be on the model's device ({model.device}), got a generator on {generator.device}: "
            f"torch.Generator(device={str(model.device)!r}).manual_seed(seed)"
        )
        raise InvalidArgumentError(msg)


def _tokens(output: object, *, returns_dict: bool) -> torch.Tensor | ModelOutput | dict[str, Any]:
    if _is_whisper_dict(output):
        return output
    expected = ModelOutput if returns_dict else torch.Tensor
    if not isinstance(output, expected):
        msg = f"generate returned a {type(output).__name__}, expected a {expected.__name__}"
        raise TypeError(msg)
    return output


def _is_whisper_dict(output: object) -> TypeGuard[dict[str, Any]]:
    """Whisper's generate returns a plain dict (sequences, segments) for `return_segments=True`, and for
    `return_dict_in_generate=True` with timestamps."""
    return type(output) is dict and "sequences" in output


__all__ = ["generate"]
