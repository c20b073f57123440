"""cachelife.Engine under schedules hypothesis draws: requests of random prompt lengths, budgets, minimum lengths,
processor settings, seeded sampling and streamers, through few rows and a short cache (rows end early and are
reused, newcomers join at every step position, the rows' content is moved), each equal to its own
`cachelife.generate` call, and what each streamer was given equal to its request's tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cachelife
from cachelife.serving.engine import Engine
from cachelife.tools import zoo
from cachelife.tools.recording import RecordingStreamer

END = 13  # within 12 new tokens of about a quarter of the tiny Llama's prompts: some rows end early

# Settings a request may take; requests of other settings wait for the running rows to leave.
SETTINGS: tuple[dict[str, Any], ...] = (
    {},
    {"forced_eos_token_id": END, "repetition_penalty": 1.2},
    {"begin_suppress_tokens": [221, 274], "do_sample": True, "top_k": 20, "temperature": 0.9},
)


@pytest.fixture(scope="module")
def llama() -> zoo.ZooModel:
    built = zoo.build("llama")
    built.model.generation_config.eos_token_id = END
    return built


request_strategy = st.fixed_dictionaries({
    "prompt": st.integers(1, 12),
    "new": st.integers(1, 12),
    "least": st.integers(0, 4),
    "settings": st.integers(0, len(SETTINGS) - 1),
    "streamed": st.booleans(),
})  # fmt: skip


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    drawn=st.lists(request_strategy, min_size=2, max_size=7),
    rows=st.integers(1, 3),
    steps_per_call=st.integers(1, 3),
)
def test_any_schedule_gives_each_request_its_own_tokens(
    llama: zoo.ZooModel, drawn: list[dict[str, int]], rows: int, steps_per_call: int
) -> None:
    requests = [
        {**llama.inputs(1, one["prompt"], index), "max_new_tokens": one["new"],
         "min_new_tokens": min(one["least"], one["new"]), **SETTINGS[one["settings"]]}
        for index, one in enumerate(drawn)
    ]  # fmt: skip

    def seeded(index: int) -> torch.Generator | None:
        return torch.Generator().manual_seed(index) if requests[index].get("do_sample") else None

    streamers = [RecordingStreamer() if one["streamed"] else None for one in drawn]
    with Engine(llama.model, rows=rows, max_length=28, steps_per_call=steps_per_call, compile_step=False) as engine:
        futures = [
            engine.submit(**request, generator=seeded(index), streamer=streamers[index])
            for index, request in enumerate(requests)
        ]
        results = [future.result(timeout=120) for future in futures]
    for index, (request, result) in enumerate(zip(requests, results, strict=True)):
        streamer = streamers[index]
        if streamer is not None:  # the prompt, then each new token
            assert torch.equal(torch.cat([value.reshape(1, -1) for value in streamer.values], dim=1), result)
        expected = cachelife.generate(
            llama.model, fallback=False, compile_step=False, steps_per_call=steps_per_call, generator=seeded(index),
            **request,
        )  # fmt: skip
        assert isinstance(expected, torch.Tensor)
        assert torch.equal(result, expected), (index, request)
