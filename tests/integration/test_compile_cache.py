"""cachelife's compile-cache namespace: set while decoding, in every thread, and restored exactly after."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import cachelife
from cachelife.integration.compile_cache import TAG, _Namespace, pinned_compile_cache
from cachelife.tools import zoo


def current_tag() -> str:
    return torch.compiler.config.cache_key_tag


@pytest.fixture(autouse=True)
def _untagged() -> Iterator[None]:
    before = current_tag()
    yield
    assert current_tag() == before


def test_the_tag_is_set_inside_and_restored_after_even_on_an_error() -> None:
    assert current_tag() == ""
    with pinned_compile_cache():
        assert current_tag() == TAG
        with pinned_compile_cache():
            assert current_tag() == TAG
        assert current_tag() == TAG
    assert current_tag() == ""
    with pytest.raises(KeyError), pinned_compile_cache():
        raise KeyError("boom")
    assert current_tag() == ""


def test_a_tag_of_the_users_own_is_kept_and_extended() -> None:
    torch.compiler.config.cache_key_tag = "mine"
    try:
        with pinned_compile_cache():
            assert current_tag() == f"mine+{TAG}"
        assert current_tag() == "mine"
    finally:
        torch.compiler.config.cache_key_tag = ""


def test_the_tag_stays_until_the_last_of_two_threads_leaves() -> None:
    entered = threading.Barrier(2)
    first_left = threading.Event()
    seen: dict[str, str] = {}

    def first() -> None:
        with pinned_compile_cache():
            entered.wait()
        first_left.set()

    def second() -> None:
        with pinned_compile_cache():
            entered.wait()
            first_left.wait(timeout=10)
            seen["after the first left"] = current_tag()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert seen == {"after the first left": TAG}
    assert current_tag() == ""


def test_where_config_is_process_wide_the_last_decode_out_restores_the_tag() -> None:
    """torch 2.11's config is one for all threads: overlapping decodes must not untag each other."""
    namespace = _Namespace(process_wide=True)
    first = namespace.enter()
    second = namespace.enter()
    namespace.leave(first)  # the first decode ends while the second still runs
    assert current_tag() == TAG
    namespace.leave(second)
    assert current_tag() == ""


class TagAtCompileTime:
    """A torch.compile backend that records the cache-key tag in force when dynamo hands it a graph."""

    def __init__(self) -> None:
        self.tags: list[str] = []

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.tags.append(current_tag())
        return graph.forward


@pytest.mark.parametrize("use_cachelife", [True, False])
def test_generate_on_an_enabled_model_compiles_in_cachelifes_namespace(use_cachelife: bool) -> None:
    built = zoo.build("t5")
    model = built.model
    inputs = built.inputs(2, 7, 1)
    expected = zoo.generate_tokens(model, inputs, max_new_tokens=4, do_sample=False, disable_compile=True)
    if use_cachelife:
        cachelife.enable(model)
    backend = TagAtCompileTime()
    torch._dynamo.reset()
    cachelife.compile_forward(model, backend=backend)
    tokens = zoo.generate_tokens(model, inputs, max_new_tokens=4, do_sample=False, cache_implementation="static")
    assert torch.equal(tokens, expected)
    assert backend.tags, "nothing was compiled"
    assert set(backend.tags) == ({TAG} if use_cachelife else {""})
