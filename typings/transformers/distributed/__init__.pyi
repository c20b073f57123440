# transformers.distributed, as checked against 5.17.0, 5.24.0 and 5.25.0.
from typing import Literal

class DistributedConfig:
    # transformers takes more (fsdp, pipeline and expert parallelism), none of which cachelife uses.
    def __init__(
        self, *, tp_size: int | None = None, tp_plan: dict[str, str] | Literal["auto"] | None = None
    ) -> None: ...
