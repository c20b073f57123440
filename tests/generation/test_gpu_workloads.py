"""GPU tests (marker `gpu`) of the everyday calls on the fast path, under cachelife's CUDA graphs (fp32):
left-padded LLM batches, return_dict_in_generate outputs, beam sampling and streaming equal `model.generate`
(or, for sampling, reproduce themselves), at 1 and 2 steps per graph replay."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.utils import ModelOutput

import cachelife
from cachelife.tools import zoo
from cachelife.tools.recording import RecordingStreamer

pytestmark = pytest.mark.gpu

NEW = 24


def built_without_end(name: str) -> zoo.ZooModel:
    built = zoo.build(name, device="cuda")
    config = built.model.generation_config
    config.eos_token_id = config.forced_eos_token_id = None
    cachelife.enable(built.model)
    return built


def left_padded(built: zoo.ZooModel, rows: int, length: int) -> dict[str, torch.Tensor]:
    """Prompts of lengths `length`, `length - 3`, ... padded on the left with the pad token (0)."""
    inputs = built.inputs(rows, length, 3)
    ids, mask = inputs["input_ids"].clone(), torch.ones_like(inputs["input_ids"])
    for row in range(rows):
        padding = min(3 * row, length - 1)
        ids[row, :padding] = 0
        mask[row, :padding] = 0
    return {"input_ids": ids, "attention_mask": mask}


def graphed(model: Any, steps: int, **settings: Any) -> Any:
    return cachelife.generate(model, fallback=False, steps_per_call=steps, cuda_graphs="cachelife", **settings)


@pytest.mark.parametrize("beams", [1, 2])
def test_left_padded_llm_batches_equal_generate(beams: int) -> None:
    built = built_without_end("llama-small")
    model = built.model
    inputs = left_padded(built, 4, 16)
    settings: dict[str, Any] = {"max_new_tokens": NEW, "num_beams": beams, "num_return_sequences": beams}
    expected = zoo.generate_tokens(model, inputs, **settings)
    for steps in (1, 2):
        out = graphed(model, steps, **inputs, **settings)
        assert isinstance(out, torch.Tensor)
        assert torch.equal(out, expected), steps


@pytest.mark.parametrize(("name", "beams"), [("llama-small", 1), ("t5-small", 3)])
def test_return_dict_outputs_equal_generate(name: str, beams: int) -> None:
    built = built_without_end(name)
    inputs = built.inputs(2, 9, 1)
    settings: dict[str, Any] = {
        "max_new_tokens": NEW, "num_beams": beams, "return_dict_in_generate": True, "output_scores": True,
        "output_logits": True, "repetition_penalty": 1.3,
    }  # fmt: skip
    theirs = built.model.generate(**inputs, **settings)
    assert isinstance(theirs, ModelOutput)
    for steps in (1, 2):
        ours = graphed(built.model, steps, **inputs, **settings)
        assert isinstance(ours, ModelOutput)
        assert type(ours) is type(theirs)
        assert torch.equal(ours["sequences"], theirs["sequences"]), steps
        for field in ("scores", "logits"):
            assert len(ours[field]) == len(theirs[field])
            for got, expected in zip(ours[field], theirs[field], strict=True):
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        if beams > 1:
            assert torch.equal(ours["beam_indices"], theirs["beam_indices"])
            torch.testing.assert_close(ours["sequences_scores"], theirs["sequences_scores"], rtol=1e-4, atol=1e-4)


def test_beam_sampling_reproduces_itself_and_equals_generate_when_nearly_deterministic() -> None:
    built = built_without_end("t5-small")
    inputs = built.inputs(2, 9, 1)
    settings: dict[str, Any] = {"max_new_tokens": NEW, "num_beams": 3, "do_sample": True, "top_k": 20}

    def drawn(seed: int, steps: int, **extra: Any) -> torch.Tensor:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        out = graphed(built.model, steps, generator=generator, **inputs, **{**settings, **extra})
        assert isinstance(out, torch.Tensor)
        return out

    first = drawn(4, 1)
    for steps in (1, 2, 2):  # a graph's first call (capture) and its replays draw alike, at any steps per call
        assert torch.equal(drawn(4, steps), first), steps
    assert len({tuple(drawn(seed, 1).flatten().tolist()) for seed in range(4)}) > 1
    nearly: dict[str, Any] = {"temperature": 0.002}
    torch.manual_seed(0)
    assert torch.equal(drawn(1, 2, **nearly), zoo.generate_tokens(built.model, inputs, **settings, **nearly))


@pytest.mark.parametrize("check_every", [1, 8])
def test_a_streamer_gets_generate_s_tokens(check_every: int) -> None:
    built = built_without_end("llama-small")
    inputs = built.inputs(1, 9, 1)
    theirs, ours = RecordingStreamer(), RecordingStreamer()
    built.model.generate(**inputs, max_new_tokens=NEW, streamer=theirs)
    cachelife.generate(
        built.model, fallback=False, stop_check_every=check_every, **inputs, max_new_tokens=NEW, streamer=ours
    )
    assert ours.puts == theirs.puts
    assert ours.ends == theirs.ends == 1
