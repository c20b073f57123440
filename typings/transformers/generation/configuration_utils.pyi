# transformers.generation.configuration_utils, as checked against 5.17.0, 5.23.0 and 5.24.0.
from typing import Any

class CompileConfig:
    fullgraph: bool
    dynamic: bool | None
    backend: str
    mode: str
    # Class attribute transformers reads to allow auto-compilation on devices other than CUDA.
    _compile_all_devices: bool | None
    def __init__(
        self,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        backend: str = "inductor",
        mode: str = "reduce-overhead",
        options: dict[str, Any] | None = None,
    ) -> None: ...

class GenerationConfig:
    # None on a fresh GenerationConfig (5.17 and 5.24): generate then uses its own default.
    num_beams: int | None
    num_return_sequences: int | None
    cache_implementation: str | None
    compile_config: CompileConfig | None
    disable_compile: bool | None
    max_length: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    decoder_start_token_id: int | list[int] | None
    forced_eos_token_id: int | list[int] | None
    no_repeat_ngram_size: int | None
    def __init__(self, **kwargs: Any) -> None: ...
