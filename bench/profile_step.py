"""The kinds a profiled step's device kernels are grouped into, by kernel name (bench/engine_step.py's table)."""

from __future__ import annotations

import re

# Kernel kinds, first match wins: attention before matrix products (flash-attention and cutlass attention kernels
# carry gemm-like names), and a fused triton kernel that writes the cache is a cache write.
GROUPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"sdpa|flash|fmha|attention|attn", re.I)),
    (
        "matrix_products",
        re.compile(r"gemm|gemv|splitk|matmul|cutlass|xmma|nvjet|cublas|linear|mkldnn|(^|[_:])(add|b)?mm(_|$|\b)", re.I),
    ),
    ("cache_writes", re.compile(r"index_copy|index_put|scatter", re.I)),
    ("norms", re.compile(r"norm|rms|rsqrt", re.I)),
    ("fused_triton", re.compile(r"triton_", re.I)),
    ("copies", re.compile(r"copy|memcpy|memset|(^|[_:])cat(_|$|\b)", re.I)),
)
OTHER = "other"


def group_of(name: str) -> str:
    """The first group whose pattern the kernel's name matches, else `OTHER`."""
    return next((group for group, pattern in GROUPS if pattern.search(name)), OTHER)
