# transformers.distributed, as checked against 5.17.0 and 5.24.0.
from typing import Any, Literal

class DistributedConfig:
    def __init__(
        self, *, tp_size: int | None = None, tp_plan: dict[str, str] | Literal["auto"] | None = None, **kwargs: Any
    ) -> None: ...
