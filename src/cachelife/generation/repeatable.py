"""The attention a compiled step may use: backends whose results repeat exactly on identical inputs.

torch chooses a backend for each `scaled_dot_product_attention` when a step is traced, among those its global
switches enable (`torch.backends.cuda.enable_cudnn_sdp` and the others). On Hopper GPUs it prefers cuDNN's
attention for bf16 and fp16, whose results vary between identical calls: identical `cachelife.generate` calls
then decoded other tokens. A compiled step is therefore traced inside `torch.nn.attention.sdpa_kernel` with
`REPEATABLE_ATTENTION`: dynamo records the choice in the step's graph, so it holds for every call of the
compiled step, while the process's switches are the same before and after (they change only while a step is
traced, under the first-calls lock). Eager steps and transformers' prefill keep the process's settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn.attention import SDPBackend, sdpa_kernel

REPEATABLE_ATTENTION: tuple[SDPBackend, ...] = (
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
)
"""The backends a compiled step's attention chooses among: all of torch's but cuDNN's."""


def with_repeatable_attention(function: Callable[..., None]) -> Callable[..., None]:
    """`function`, its attention restricted to `REPEATABLE_ATTENTION` (for a step that is compiled)."""

    def run(**arguments: Any) -> None:
        with sdpa_kernel(list(REPEATABLE_ATTENTION)):
            function(**arguments)

    return run
