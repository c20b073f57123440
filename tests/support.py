"""Helpers the tests share: waiting for an engine's state, one request decoded alone, requests of several
sampled sequences, tiny encoder-decoder models of transformers' families by name, and an encoder forward held
while other calls arrive, and the docs extension's modules loaded from their files."""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import transformers
from torch import nn
from transformers import PreTrainedModel

import cachelife
from cachelife.generation import graphs
from cachelife.generation import steps as loop_steps
from cachelife.tools import zoo

DOCS_EXTENSION = Path(__file__).resolve().parents[1] / "docs" / "_ext" / "cachelife_docs"


def docs_module(name: str) -> ModuleType:
    """A module of the docs extension (`docs/_ext/cachelife_docs/<name>.py`) loaded from its file: the
    extension's package imports Sphinx, which only the docs environment has."""
    spec = importlib.util.spec_from_file_location(f"cachelife_docs_{name}", DOCS_EXTENSION / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def until(condition: Callable[[], bool], seconds: float = 60.0) -> None:
    """Wait until `condition()` holds; fail the test after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("the engine did not get there in time")
        time.sleep(0.01)


def alone(model: PreTrainedModel, **kwargs: Any) -> torch.Tensor:
    """`cachelife.generate` of one request with an eager step, no fallback: what an engine's request equals."""
    tokens = cachelife.generate(model, compile_step=False, fallback=False, **kwargs)
    assert isinstance(tokens, torch.Tensor)
    return tokens


class _Replayed:
    def __init__(self, calls: Any) -> None:
        self.calls = calls

    def replay(self) -> None:
        self.calls()


def stand_in_graphs(patch: pytest.MonkeyPatch, captured: list[object] | None = None, *, compiled: bool = False) -> None:
    """Graphs "captured" on the CPU: a capture runs the warm-up (one step) and appends its calls to `captured`,
    every replay runs the captured calls; steps run eagerly unless `compiled`."""

    def capture(warm_up: Any, calls: Any, device: torch.device, pool: object) -> _Replayed:
        warm_up()
        if captured is not None:
            captured.append(calls)
        return _Replayed(calls)

    patch.setattr(graphs, "capture", capture)
    patch.setattr(graphs, "CAPTURING_DEVICES", frozenset({"cpu"}))
    if not compiled:
        patch.setattr(loop_steps, "compiled_step", lambda model, name, function, mode, options, kind: function)


def several_sequence_requests(built: zoo.ZooModel, count: int) -> list[dict[str, Any]]:
    """Sampling requests, every other one of 2 to 4 sequences (`num_return_sequences`), with many end tokens:
    one request's sequences end at different steps."""
    sampling = {
        "do_sample": True,
        "top_k": 0,
        "temperature": 1.3,
        "eos_token_id": list(range(3, 40)),
        "pad_token_id": 0,
    }
    requests = []
    for index in range(count):
        request = {**built.inputs(1, 3 + (5 * index) % 11, index), "max_new_tokens": 4 + (7 * index) % 13, **sampling}
        if index % 2 == 0:
            request["num_return_sequences"] = 2 + index % 3
        requests.append(request)
    return requests


def family_model(family: str) -> PreTrainedModel:
    """A tiny seeded encoder-decoder model of the family named by its transformers class prefix (`<prefix>Config`,
    `<prefix>ForConditionalGeneration`; Marian's is `MarianMTModel`)."""
    config_class = getattr(transformers, f"{family}Config")
    model_class = getattr(transformers, "MarianMTModel" if family == "Marian" else f"{family}ForConditionalGeneration")
    torch.manual_seed(0)
    if family in {"T5", "MT5"}:
        config = config_class(vocab_size=320, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                              decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    else:
        config = config_class(
            vocab_size=320, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128,
            pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        )  # fmt: skip
    model: PreTrainedModel = model_class(config).eval()
    return model


class HeldFirstForward:
    """Holds the first forward through `module` until `release()`: calls made meanwhile wait behind it."""

    def __init__(self, module: nn.Module) -> None:
        self.entered, self._released, self._first = threading.Event(), threading.Event(), True
        self._handle = module.register_forward_pre_hook(self._hold)

    def _hold(self, module: nn.Module, args: Any) -> None:
        if self._first:
            self._first = False
            self.entered.set()
            assert self._released.wait(60)

    def release(self) -> None:
        self._released.set()

    def remove(self) -> None:
        self._handle.remove()


def first_layer(model: PreTrainedModel) -> nn.Module:
    """The encoder's first layer (the first entry of its first module list)."""
    layers = next(module for module in model.get_encoder().modules() if isinstance(module, nn.ModuleList))
    return layers[0]


def in_threads(calls: int, run: Callable[[int], None], held: HeldFirstForward, gathered: Callable[[], int]) -> None:
    """`run(0)` first, held in its forward; then `run(1..)` in threads of their own until every call is gathered;
    then the first forward goes on."""
    threads = [threading.Thread(target=run, args=(index,)) for index in range(calls)]
    threads[0].start()
    assert held.entered.wait(60)
    for thread in threads[1:]:
        thread.start()
    until(lambda: gathered() == calls)
    held.release()
    for thread in threads:
        thread.join(60)
