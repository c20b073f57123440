"""`Engine(attention=...)`: the rows decode with cachelife's decode attention kernel (here the op's torch
fallback, or Triton's interpreter under `TRITON_INTERPRET=1`) with `model.generate`'s tokens, the model's own
implementation comes back when the engine closes, and "auto" leaves a model alone off the GPU and the
default ("model") everywhere.

The token test counts the kernel's calls from the eager step, so that equality tests the kernel and not its
absence."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cachelife.errors import InvalidArgumentError
from cachelife.kernels.attention import decode_attention
from cachelife.model_rewrites import decode_attention as attention_rewrite
from cachelife.model_rewrites.decode_attention import ATTENTION
from cachelife.serving.engine import Engine
from cachelife.tools import zoo


def implementations(model: torch.nn.Module) -> set[str | None]:
    return {c._attn_implementation for m in model.modules() if (c := getattr(m, "config", None)) is not None}


def requests_of(built: zoo.ZooModel) -> list[dict[str, Any]]:
    """Prompts of other lengths, one left-padded with its mask, with other budgets."""
    made = [{**built.inputs(1, 2 + 3 * index, index), "max_new_tokens": 3 + 2 * index} for index in range(4)]
    if not built.model.config.is_encoder_decoder:
        ids = made[1]["input_ids"]
        made[1]["input_ids"] = torch.cat([torch.zeros_like(ids[:, :2]), ids], dim=1)
        made[1]["attention_mask"] = torch.cat([torch.zeros_like(ids[:, :2]), torch.ones_like(ids)], dim=1)
    return made


@pytest.mark.parametrize(("name", "options"), [("llama", {}), ("t5", {"encoder_length": 16})])
def test_decode_attention_rows_give_generates_tokens_and_the_model_gets_its_own_back(
    name: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(args[0].shape[0])  # the query's rows
        return decode_attention(*args, **kwargs)

    monkeypatch.setattr(attention_rewrite, "decode_attention", counted)
    built = zoo.build(name)
    model = built.model
    requests = requests_of(built)
    expected = [zoo.generate_tokens(model, request, do_sample=False) for request in requests]
    before = implementations(model)
    with Engine(model, rows=2, max_length=32, compile_step=False, attention="decode", **options) as engine:
        assert implementations(model) == {ATTENTION}
        futures = [engine.submit(**request, do_sample=False) for request in requests]
        results = [future.result(timeout=300) for future in futures]
    assert implementations(model) == before
    assert calls.count(2) > 0  # the step's two rows went through the kernel
    for index, (result, tokens) in enumerate(zip(results, expected, strict=True)):
        assert torch.equal(result, tokens), index


def test_auto_the_default_keeps_the_models_attention_off_the_gpu() -> None:
    """On the CPU, with or without Triton's interpreter (the tests' kernels run in it)."""
    model = zoo.build("llama").model
    before = implementations(model)
    with Engine(model, rows=1, max_length=16, compile_step=False) as engine:
        assert implementations(model) == before
        engine.submit(**zoo.build("llama").inputs(1, 3, 0), max_new_tokens=2).result(timeout=300)
    assert ATTENTION not in before


def test_auto_takes_the_kernel_where_triton_runs_on_a_gpu_and_only_over_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cachelife.serving.step_attention.triton_on_gpu", lambda device: True)
    model = zoo.build("llama").model
    with Engine(model, rows=1, max_length=16, compile_step=False, attention="auto"):
        assert implementations(model) == {ATTENTION}
    assert implementations(model) == {"sdpa"}
    with Engine(model, rows=1, max_length=16, compile_step=False):  # the default is "auto"
        assert implementations(model) == {ATTENTION}
    with Engine(model, rows=1, max_length=16, compile_step=False, attention="model"):
        assert implementations(model) == {"sdpa"}
    model.set_attn_implementation("eager")
    with Engine(model, rows=1, max_length=16, compile_step=False, attention="auto"):
        assert implementations(model) == {"eager"}


def test_an_unknown_attention_is_refused_by_name_before_any_work() -> None:
    model = zoo.build("llama").model
    before = implementations(model)
    with pytest.raises(InvalidArgumentError, match=r"attention must be one of 'auto', 'decode', 'model', got 'flash'"):
        Engine(model, rows=1, max_length=16, attention="flash")  # type: ignore[arg-type]
    assert implementations(model) == before


def test_a_failing_engine_start_gives_the_model_its_attention_back() -> None:
    model = zoo.build("llama").model
    before = implementations(model)
    with pytest.raises(InvalidArgumentError, match="max_length"):
        Engine(model, rows=1, max_length=10**9, attention="decode")
    assert implementations(model) == before
