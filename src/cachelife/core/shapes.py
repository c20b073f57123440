"""Per-layer key/value shapes of a model's caches: the extension point, and inference from configs.

A shape here is everything about a layer's buffers except the batch and sequence sizes: the number of
key/value heads and the key and value head dims. Self-attention and cross-attention are described
separately, per decoder layer.

Model authors declare shapes by giving their model class a `cachelife_cache_shapes()` method (the
`DeclaresCacheShapes` protocol); that wins over inference. Otherwise `infer_cache_shapes` reads the config
with the rule of the model's family (`FAMILY_RULES`, keyed by `config.model_type`), falling back to the
decoder-only rule for models without an encoder. Under transformers' tensor parallelism, inferred head
counts are those of one rank (`per_rank_shapes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol, runtime_checkable

from attrs import frozen
from transformers import PreTrainedConfig

from cachelife.errors import CacheShapeError, UnsupportedCacheError
from cachelife.validate import check_int, is_int_at_least


@frozen
class LayerShape:
    """Key/value heads and head dims of one layer's cache (keys: heads x key_head_dim)."""

    num_kv_heads: int
    key_head_dim: int
    value_head_dim: int

    def __attrs_post_init__(self) -> None:
        for name in ("num_kv_heads", "key_head_dim", "value_head_dim"):
            check_int(f"LayerShape.{name}", getattr(self, name), error=CacheShapeError)


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
    shapes = infer_cache_shapes(config)
    ranks = tensor_parallel_size(model)
    if ranks > 1 and shards_key_heads(model):
        return per_rank_shapes(shapes, ranks, who=type(model).__name__)
    return shapes


# -- tensor parallelism ------------------------------------------------------------------------------------

# Projections whose output holds the attention keys, fused or not: a column-wise split of one of them
# splits the key/value heads over the ranks (transformers' own rule for early cache initialisation).
_KEY_PROJECTIONS: Final = ("k_proj", "qkv_proj", "query_key_value")
# Column-wise styles whose output stays split over the ranks (not `colwise_rep`, `colwise_gather_output`).
_SPLITTING_STYLES: Final = ("colwise", "local_colwise", "packed_colwise")


def tensor_parallel_size(model: object) -> int:
    """How many ranks share the model's heads under transformers' tensor parallelism (`from_pretrained(...,
    tp_plan="auto")` under torchrun sets `model._tp_size`); 1 without it."""
    size = getattr(model, "_tp_size", None)
    if is_int_at_least(size, 2):
        return size
    return 1


def shards_key_heads(model: object) -> bool:
    """Whether the model's tensor-parallel plan splits a key projection column-wise, so that each rank's
    attention writes only its share of the key/value heads into its cache."""
    plan = getattr(model, "_tp_plan", None)
    if not isinstance(plan, Mapping):
        return False
    return any(
        str(key).rsplit(".", 1)[-1] in _KEY_PROJECTIONS and style in _SPLITTING_STYLES for key, style in plan.items()
    )


def per_rank_shapes(shapes: CacheShapes, ranks: int, *, who: str = "the model") -> CacheShapes:
    """The shapes one of `ranks` tensor-parallel ranks holds: every layer's key/value heads split evenly.

    Raises `UnsupportedCacheError` naming the first layer whose head count `ranks` does not divide.
    """
    check_int("the tensor-parallel size", ranks, error=CacheShapeError)

    def split(layers: tuple[LayerShape, ...], role: str) -> tuple[LayerShape, ...]:
        for index, shape in enumerate(layers):
            if shape.num_kv_heads % ranks:
                msg = (
                    f"layer {index} ({role}-attention) of {who} has {shape.num_kv_heads} key/value heads, which "
                    f"{ranks} tensor-parallel ranks cannot share evenly (each rank's cache holds heads / ranks); "
                    "use a tensor-parallel size that divides num_key_value_heads, or declare per-rank shapes "
                    "with a cachelife_cache_shapes() method"
                )
                raise UnsupportedCacheError(msg)
        return tuple(
            LayerShape(shape.num_kv_heads // ranks, shape.key_head_dim, shape.value_head_dim) for shape in layers
        )

    return CacheShapes(split(shapes.self_attention, "self"), split(shapes.cross_attention, "cross"))


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


# Multi-head latent attention that caches the compressed latents, one "head" each: keys of kv_lora_rank,
# values of qk_rope_head_dim (read from each family's attention `forward`, transformers 5.17 and 5.24).
MLA_LATENT_FAMILIES: Final = frozenset(
    {"axk1", "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "longcat_flash", "minicpm3", "mistral4", "youtu"}
)


def storage_less_layers(config: PreTrainedConfig) -> frozenset[int]:
    """Indices of the layers transformers (>= 5.24) caches with a `DummyLayer`: KV-sharing consumers
    (`kv_sharing_modes` "reuse") and `"moe"`/`"mlp"` layer types, which store no keys or values."""
    layer_types = getattr(config, "layer_types", None)
    modes = getattr(config, "kv_sharing_modes", None)
    found = set()
    if isinstance(layer_types, Sequence):
        found |= {index for index, kind in enumerate(layer_types) if kind in ("moe", "mlp")}
    if isinstance(modes, Sequence):
        found |= {index for index, mode in enumerate(modes) if mode == "reuse"}
    return frozenset(found)


def decoder_only_shapes(config: PreTrainedConfig) -> CacheShapes:
    """Llama-style decoders: `num_key_value_heads` (GQA) or `num_attention_heads`, `head_dim` or the
    hidden size over the head count, per layer where the config varies them; latent attention
    (`MLA_LATENT_FAMILIES`) caches one head of `kv_lora_rank` keys and `qk_rope_head_dim` values.

    A layer that stores nothing (`storage_less_layers`) keeps its entry, so that indices line up with the
    decoder's layers, but its own config is not read (it may describe no attention): the entry is the
    top-level config's shape, and cachelife pins nothing there (the layer's state is `NoStorage`).
    """
    text = config.get_text_config(decoder=True)
    layers = _int(text, "num_hidden_layers")
    if text.model_type in MLA_LATENT_FAMILIES:
        latent = LayerShape(1, _int(text, "kv_lora_rank"), _int(text, "qk_rope_head_dim"))
        return CacheShapes((latent,) * layers)
    skipped = storage_less_layers(text)
    shapes = []
    for index, per_layer in enumerate(_layer_configs(text, layers)):
        layer = text if index in skipped else per_layer
        heads = _int(layer, "num_attention_heads")
        kv_heads = _optional_int(layer, "num_key_value_heads") or heads
        head_dim = _optional_int(layer, "head_dim") or _int(layer, "hidden_size") // heads
        shapes.append(LayerShape(kv_heads, head_dim, head_dim))
    return CacheShapes(tuple(shapes))


@frozen(kw_only=True)
class FamilyRule:
    """Which config attributes give one family's decoder cache shapes; of each tuple, the first set wins.

    Attributes are read by their own names, never through aliases such as `num_attention_heads`, which
    in many encoder-decoder configs (BART, Whisper, ...) point at the encoder.
    """

    layers: tuple[str, ...]
    heads: tuple[str, ...]
    kv_heads: tuple[str, ...] = ()  # grouped-query attention; the head count otherwise
    head_dim: tuple[str, ...] = ()  # explicit head dim; hidden size over heads otherwise
    hidden: tuple[str, ...] = ("d_model", "hidden_size")
    cross_kv_heads: tuple[str, ...] = ()  # cross-attention differs from self-attention (Dia)
    cross_head_dim: tuple[str, ...] = ()
    decoder_config: bool = False  # read `config.get_text_config(decoder=True)`, not the top-level config

    def __call__(self, config: PreTrainedConfig) -> CacheShapes:
        source = config.get_text_config(decoder=True) if self.decoder_config else config
        layers = _int(source, *self.layers)
        heads = _int(source, *self.heads)
        kv_heads = _optional_int(source, *self.kv_heads) or heads
        head_dim = _optional_int(source, *self.head_dim) or _int(source, *self.hidden) // heads
        own = LayerShape(kv_heads, head_dim, head_dim)
        cross_dim = _optional_int(source, *self.cross_head_dim) or head_dim
        cross = LayerShape(_optional_int(source, *self.cross_kv_heads) or kv_heads, cross_dim, cross_dim)
        return CacheShapes.uniform(layers, own, cross if config.is_encoder_decoder else None)


def _composite_shapes(config: PreTrainedConfig) -> CacheShapes:
    """EncoderDecoderModel and friends: the decoder sub-config's family rule, with cross-attention like
    self-attention (the decoder's cross-attention projects encoder states to the decoder's heads)."""
    decoder = config.get_text_config(decoder=True)
    rule = FAMILY_RULES.get(decoder.model_type)
    own = (rule(decoder) if rule is not None else decoder_only_shapes(decoder)).self_attention
    return CacheShapes(own, own)


_T5 = FamilyRule(layers=("num_decoder_layers", "num_layers"), heads=("num_heads",), head_dim=("d_kv",))
_BART = FamilyRule(layers=("decoder_layers",), heads=("decoder_attention_heads",))
_DECODER_SUBCONFIG = FamilyRule(
    layers=("num_hidden_layers",),
    heads=("num_attention_heads",),
    kv_heads=("num_key_value_heads",),
    head_dim=("head_dim",),
    hidden=("hidden_size",),
    decoder_config=True,
)

FAMILY_RULES: Final[Mapping[str, ShapeRule]] = {
    **dict.fromkeys(("t5", "mt5", "umt5", "longt5", "switch_transformers", "pop2piano", "udop"), _T5),
    "pix2struct": FamilyRule(layers=("num_layers",), heads=("num_heads",), head_dim=("d_kv",), decoder_config=True),
    **dict.fromkeys(
        (
            "bart",
            "mbart",
            "marian",
            "pegasus",
            "pegasus_x",
            "blenderbot",
            "blenderbot-small",
            "plbart",
            "m2m_100",
            "nllb-moe",
            "mvp",
            "bigbird_pegasus",
            "led",
            "fsmt",
            "whisper",
            "speech_to_text",
            "speecht5",
            "seamless_m4t",
            "seamless_m4t_v2",
            "trocr",
        ),
        _BART,
    ),
    "prophetnet": FamilyRule(
        layers=("num_decoder_layers",), heads=("num_decoder_attention_heads",), hidden=("hidden_size",)
    ),
    **dict.fromkeys(
        ("t5gemma", "t5gemma2", "canary", "cohere_asr", "moonshine", "moonshine_streaming"), _DECODER_SUBCONFIG
    ),
    "dia": FamilyRule(
        layers=("num_hidden_layers",),
        heads=("num_attention_heads",),
        kv_heads=("num_key_value_heads",),
        head_dim=("head_dim",),
        hidden=("hidden_size",),
        cross_kv_heads=("cross_num_key_value_heads",),
        cross_head_dim=("cross_head_dim",),
        decoder_config=True,
    ),
    **dict.fromkeys(("encoder-decoder", "vision-encoder-decoder", "speech-encoder-decoder"), _composite_shapes),
}
