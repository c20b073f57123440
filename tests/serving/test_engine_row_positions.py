"""cachelife.Engine on decoders that count positions from the cache (BART's family): each row decodes at its own
positions, as its own `cachelife.generate` call decodes it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel

from cachelife.errors import UnsupportedGenerationError
from cachelife.serving.engine import Engine
from cachelife.tools import zoo
from support import alone, family_model

# Marian's checkpoints ban the pad token and search 4 beams: these requests ask for neither, so that the rows'
# positions, not the processors, are what is tested (test_engine.py decodes Marian's own settings).
OWN_SETTINGS = {"marian": {"bad_words_ids": None, "num_beams": 1}}


def sharpen(model: PreTrainedModel) -> None:
    """Scale the decoder's position table up: random small positional weights barely move a tiny model's
    tokens, and a row read at another row's position must show in them."""
    table = model.get_decoder().embed_positions
    assert isinstance(table, nn.Embedding)
    with torch.no_grad():
        table.weight.mul_(50.0)


def sharpened(name: str) -> zoo.ZooModel:
    built = zoo.build(name)
    sharpen(built.model)
    return built


def requests(built: zoo.ZooModel, name: str, count: int, beams_at: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """Prompts and budgets of different lengths, so that rows join at different steps; beams where asked."""
    made = []
    for index in range(count):
        request = {**built.inputs(1, 2 + (5 * index) % 9, index), "max_new_tokens": 3 + (7 * index) % 11}
        request.update(OWN_SETTINGS.get(name, {}))
        if index in beams_at:
            request["num_beams"] = 2
        made.append(request)
    return made


@pytest.mark.parametrize("name", ["bart", "marian"])
def test_rows_of_a_decoder_that_counts_from_the_cache_decode_at_their_own_positions(name: str) -> None:
    built = sharpened(name)
    decoder = built.model.get_decoder()
    own_table = decoder.embed_positions
    batch = requests(built, name, 8, beams_at=(2, 5))
    with Engine(built.model, rows=3, max_length=40, compile_step=False, encoder_length=16) as engine:
        assert decoder.embed_positions is not own_table  # the rows' table while the engine serves
        results = [future.result(timeout=120) for future in [engine.submit(**request) for request in batch]]
    assert decoder.embed_positions is own_table  # and the model's own back once it closed
    for index, (request, result) in enumerate(zip(batch, results, strict=True)):
        assert torch.equal(result, zoo.generate_tokens(built.model, request)), index


# The family's other models, each by its transformers class name's prefix (`<prefix>Config`,
# `<prefix>ForConditionalGeneration`); Pegasus's table is sinusoidal.
FAMILIES = ("MBart", "PLBart", "Pegasus", "Blenderbot", "BlenderbotSmall")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_rest_of_the_family_decodes_in_the_rows_as_model_generate(family: str) -> None:
    model = family_model(family)
    sharpen(model)
    batch: list[dict[str, Any]] = []
    for index in range(6):
        ids = torch.randint(3, 320, (1, 3 + (5 * index) % 9), generator=torch.Generator().manual_seed(index))
        # Blenderbot's config bans the encoder's n-grams, a rule the engine refuses: left out here.
        batch.append({"input_ids": ids, "max_new_tokens": 3 + (7 * index) % 11, "encoder_no_repeat_ngram_size": 0})
    with Engine(model, rows=3, max_length=40, compile_step=False, encoder_length=16) as engine:
        results = [future.result(timeout=120) for future in [engine.submit(**request) for request in batch]]
    for index, (request, result) in enumerate(zip(batch, results, strict=True)):
        expected = model.generate(**request)
        assert isinstance(expected, torch.Tensor)
        assert torch.equal(result, expected), index


@pytest.mark.slow
def test_the_compiled_step_reads_each_rows_positions_at_every_step_of_a_call() -> None:
    built = sharpened("bart")
    batch = requests(built, "bart", 6)
    expected = [alone(built.model, **request) for request in batch]
    with Engine(built.model, rows=2, max_length=40, steps_per_call=2, encoder_length=16) as engine:
        results = [future.result(timeout=300) for future in [engine.submit(**request) for request in batch]]
    for index, (want, got) in enumerate(zip(expected, results, strict=True)):
        assert torch.equal(got, want), index


class _Computed(nn.Module):
    """A position embedding that is not a lookup table: the engine cannot read it at a row's position."""

    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        self.table = table

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        result: torch.Tensor = self.table(*args, **kwargs)
        return result


def test_a_decoder_whose_positions_are_not_a_table_is_refused_and_left_as_it_was() -> None:
    built = zoo.build("bart")
    decoder = built.model.get_decoder()
    table = decoder.embed_positions
    assert isinstance(table, nn.Embedding)
    decoder.embed_positions = _Computed(table)
    unchanged = decoder.embed_positions
    with pytest.raises(UnsupportedGenerationError, match="not a position table the engine can read"):
        Engine(built.model, encoder_length=16, compile_step=False)
    assert decoder.embed_positions is unchanged
