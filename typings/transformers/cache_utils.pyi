# transformers.cache_utils, as checked against 5.17.0, 5.23.0, 5.24.0 and 5.25.0. Unlike transformers' inline
# annotations, an EncoderDecoderCache's sub-caches are typed `Cache` (not `DynamicCache`), and a layer's
# keys and values are None until it is initialized, so callers must narrow both.
from typing import Any

import torch
from transformers.configuration_utils import PreTrainedConfig

class CacheLayerMixin:
    is_compileable: bool
    supports_early_init: bool
    keys: torch.Tensor | None
    values: torch.Tensor | None
    is_initialized: bool
    def __init__(self, **kwargs: Any) -> None: ...
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None: ...
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def get_seq_length(self) -> int: ...
    def get_max_length(self) -> int: ...
    def reset(self) -> None: ...
    def reorder_cache(self, beam_idx: torch.Tensor) -> None: ...

class DynamicLayer(CacheLayerMixin): ...

class StaticLayer(CacheLayerMixin):
    max_cache_len: int
    # A 0-dim int64 tensor on the CPU until lazy_initialization moves it to the layer's device.
    cumulative_length: torch.Tensor
    def __init__(self, max_cache_len: int, **kwargs: Any) -> None: ...

class StaticSlidingWindowLayer(StaticLayer):
    cumulative_length_int: int
    def __init__(self, max_cache_len: int, sliding_window: int, **kwargs: Any) -> None: ...

class Cache:
    def __init__(
        self,
        layers: list[Any] | None = None,
        layer_class_to_replicate: type[Any] | None = None,
        offloading: bool = False,
        offload_only_non_sliding: bool = True,
    ) -> None: ...
    def __len__(self) -> int: ...
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def early_initialization(
        self,
        batch_size: int,
        num_heads: int | list[int],
        head_dim: int | list[int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None: ...
    def get_seq_length(self, layer_idx: int = 0) -> int: ...
    def get_max_length(self, layer_idx: int | None = None) -> int: ...
    def reset(self) -> None: ...
    def reorder_cache(self, beam_idx: torch.Tensor) -> None: ...
    @property
    def is_compileable(self) -> bool: ...
    @property
    def is_initialized(self) -> bool: ...

class DynamicCache(Cache):
    layers: list[Any]
    def __init__(
        self,
        ddp_cache_data: Any = None,
        config: PreTrainedConfig | None = None,
        offloading: bool = False,
        offload_only_non_sliding: bool = False,
    ) -> None: ...

class StaticCache(Cache):
    # StaticLayer, StaticSlidingWindowLayer, ... or layer types cachelife refuses (narrow before use).
    layers: list[Any]
    def __init__(
        self,
        config: PreTrainedConfig,
        max_cache_len: int,
        offloading: bool = False,
        offload_only_non_sliding: bool = True,
        **kwargs: Any,
    ) -> None: ...

class EncoderDecoderCache(Cache):
    # Holds no `layers` of its own: they are in the two sub-caches.
    self_attention_cache: Cache
    cross_attention_cache: Cache
    # layer index -> whether the cross-attention keys and values of that layer have been computed.
    is_updated: dict[int, bool]
    def __init__(self, *caches: Cache) -> None: ...
