"""Per-layer key/value shapes of a model's caches: the extension point, and inference from configs.

A shape here is everything about a layer's buffers except the batch and sequence sizes: the number of
key/value heads and the key and value head dims. Self-attention and cross-attention are described
separately, per decoder layer.

Model authors declare shapes by giving their model class a `cachelife_cache_shapes()` method (the
`DeclaresCacheShapes` protocol); that wins over inference. Otherwise `infer_cache_shapes` reads the config
with the rule of the model's family (`FAMILY_RULES`, keyed by `config.model_type`), falling back to the
decoder-only rule for models without an encoder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol, runtime_checkable

from attrs import frozen
from transformers import PreTrainedConfig

from cachelife.errors import CacheShapeError, UnsupportedCacheError


@frozen
class LayerShape:
    """Key/value heads and head dims of one layer's cache (keys: heads x key_head_dim)."""

    num_kv_heads: int
    key_head_dim: int
    value_head_dim: int

    def __attrs_post_init__(self) -> None:
        for name in ("num_kv_heads", "key_head_dim", "value_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                msg = f"LayerShape.{name} must be a positive int, got {value!r}"
                raise CacheShapeError(msg)


@frozen
class CacheShapes:
    """Shapes of every decoder layer's self-attention cache and, for encoder-decoder models, cross-attention."""

    self_attention: tuple[LayerShape, ...]
    cross_attention: tuple[LayerShape, ...] = ()

    @classmethod
    def uniform(cls, layers: int, shape: LayerShape, cross: LayerShape | None = None) -> CacheShapes:
        """The same shape in every layer (and the same cross-attention shape, if given)."""
        return cls((shape,) * layers, () if cross is None else (cross,) * layers)


@runtime_checkable
class DeclaresCacheShapes(Protocol):
    """Extension point for model authors: a model that states its own cache shapes.

    Implement `cachelife_cache_shapes()` on the model class (or mix in `CacheLifecycleMixin` and override
    it); the result is used instead of inference. It must describe one entry per decoder layer, with
    head counts as this process holds them (per rank under tensor parallelism).
    """

    def cachelife_cache_shapes(self) -> CacheShapes:
        """Per-layer shapes of the self-attention cache and, if any, the cross-attention cache."""
        ...


ShapeRule = Callable[[PreTrainedConfig], CacheShapes]


def model_cache_shapes(model: object) -> CacheShapes:
    """The shapes a model declares, or else those inferred from its config."""
    if isinstance(model, DeclaresCacheShapes):
        declared = model.cachelife_cache_shapes()
        if not isinstance(declared, CacheShapes):
            msg = f"{type(model).__name__}.cachelife_cache_shapes() must return CacheShapes, got {declared!r}"
            raise CacheShapeError(msg)
        return declared
    config = getattr(model, "config", None)
    if not isinstance(config, PreTrainedConfig):
        msg = f"cannot infer cache shapes of a {type(model).__name__}: it has no transformers config"
        raise UnsupportedCacheError(msg)
    return infer_cache_shapes(config)


def infer_cache_shapes(config: PreTrainedConfig) -> CacheShapes:
    """Infer per-layer cache shapes from a model config (see the module docstring)."""
    rule = FAMILY_RULES.get(config.model_type)
    if rule is not None:
        return rule(config)
    if config.is_encoder_decoder:
        msg = (
            f"cachelife has no shape rule for encoder-decoder models of type {config.model_type!r}; "
            f"known types: {', '.join(sorted(FAMILY_RULES))}. Declare the shapes with a "
            "cachelife_cache_shapes() method on the model (cachelife.DeclaresCacheShapes)."
        )
        raise UnsupportedCacheError(msg)
    return decoder_only_shapes(config)


# -- config readers ----------------------------------------------------------------------------------------


def _int(config: PreTrainedConfig, *names: str) -> int:
    """The first of `names` the config sets to an int."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    msg = f"{type(config).__name__} sets none of {', '.join(names)}; cannot infer cache shapes"
    raise CacheShapeError(msg)


def _optional_int(config: PreTrainedConfig, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _layer_configs(config: PreTrainedConfig, layers: int) -> Sequence[PreTrainedConfig]:
    """One config per layer: transformers >= 5.23 may vary attributes per layer (`per_layer_config`)."""
    per_layer = getattr(config, "per_layer_config", None)
    if isinstance(per_layer, Sequence) and len(per_layer) == layers:
        return [layer if isinstance(layer, PreTrainedConfig) else config for layer in per_layer]
    return [config] * layers


def decoder_only_shapes(config: PreTrainedConfig) -> CacheShapes:
    """Llama-style decoders: `num_key_value_heads` (GQA) or `num_attention_heads`, `head_dim` or the
    hidden size over the head count, per layer where the config varies them."""
    text = config.get_text_config(decoder=True)
    layers = _int(text, "num_hidden_layers")
    shapes = []
    for layer in _layer_configs(text, layers):
        heads = _int(layer, "num_attention_heads")
        kv_heads = _optional_int(layer, "num_key_value_heads") or heads
        head_dim = _optional_int(layer, "head_dim") or _int(layer, "hidden_size") // heads
        shapes.append(LayerShape(kv_heads, head_dim, head_dim))
    return CacheShapes(tuple(shapes))


def _t5_shapes(config: PreTrainedConfig) -> CacheShapes:
    """T5 and its descendants: `num_heads` heads of `d_kv` in every attention, `num_decoder_layers` layers."""
    shape = LayerShape(_int(config, "num_heads"), _int(config, "d_kv"), _int(config, "d_kv"))
    return CacheShapes.uniform(_int(config, "num_decoder_layers", "num_layers"), shape, shape)


def _bart_shapes(config: PreTrainedConfig) -> CacheShapes:
    """BART-style decoders (BART, mBART, Marian, Pegasus, Whisper, ...): `decoder_attention_heads` heads of
    `d_model / heads` in self- and cross-attention, `decoder_layers` layers."""
    heads = _int(config, "decoder_attention_heads")
    head_dim = _int(config, "d_model") // heads
    shape = LayerShape(heads, head_dim, head_dim)
    return CacheShapes.uniform(_int(config, "decoder_layers"), shape, shape)


FAMILY_RULES: Final[Mapping[str, ShapeRule]] = {
    **dict.fromkeys(("t5", "mt5", "umt5", "longt5", "switch_transformers"), _t5_shapes),
    **dict.fromkeys(
        (
            "bart",
            "mbart",
            "marian",
            "pegasus",
            "blenderbot",
            "blenderbot-small",
            "plbart",
            "m2m_100",
            "whisper",
        ),
        _bart_shapes,
    ),
}
