"""A short soak (the 200-call run is `nox -s soak`): many generate calls stay correct and bounded.

Slow: 80 eager generate calls take a minute or more on 2 busy cores; `nox -s slow` runs it.
"""

from __future__ import annotations

import gc

import pytest
import torch

import cachelife
from cachelife.core.cache_lifecycle import _REGISTRY
from cachelife.tools import zoo

CALLS = 40
pytestmark = pytest.mark.slow


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_many_generate_calls_stay_correct_reuse_buffers_and_do_not_grow() -> None:
    built = zoo.build("t5")
    model = built.model
    settings = {"do_sample": False, "max_new_tokens": 6, "min_new_tokens": 6}
    prompts = [built.inputs(2, 9, seed) for seed in range(CALLS)]
    references = [zoo.generate_tokens(model, prompt, **settings, disable_compile=True) for prompt in prompts]
    cachelife.enable(model)
    rss = []
    for index, (prompt, reference) in enumerate(zip(prompts, references, strict=True)):
        assert torch.equal(zoo.generate_tokens(model, prompt, **settings, cache_implementation="static"), reference)
        if index in (9, CALLS - 1):
            gc.collect()
            rss.append(resident_bytes())
    pool = cachelife.pool_of(model)
    assert pool is not None
    assert (pool.hits, pool.misses, pool.idle_sets) == (CALLS - 1, 1, 1)
    gc.collect()
    assert len(_REGISTRY) <= 1  # lifecycles of dropped caches are gone with them
    assert rss[1] - rss[0] < 64 * 2**20, f"resident memory grew by {(rss[1] - rss[0]) / 2**20:.1f} MiB"
