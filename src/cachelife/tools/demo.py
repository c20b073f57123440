"""The main job: compiled static-cache generation with cachelife on the embedded default model, both ways.

Builds a small T5 from a config in code (`cachelife.tools.zoo`) and generates eagerly with a dynamic cache for
reference. Then the headline API: `cachelife.generate(model, **inputs, ...)`, which decodes in one compiled
step on pinned caches (a CUDA graph cachelife captures, on a GPU). Then the compiled-forward recipe:
`cachelife.enable(model)`, `model.forward` compiled (CUDA graphs via mode="reduce-overhead" on a GPU, inductor
on a CPU) and `generate(cache_implementation="static")`, with the per-layer lifecycle table seen at the first
forward call. Every call's tokens are checked against the reference.
"""

from __future__ import annotations

import time
from typing import TextIO

import torch
from attrs import frozen

from cachelife.generation.api import generate
from cachelife.integration.enabling import enable
from cachelife.tools import zoo
from cachelife.tools.recipe import pick_device, run_recipe


@frozen
class DemoReport:
    """Whether every call of both paths gave the reference tokens."""

    generate_equal: tuple[bool, ...]
    recipe_ok: bool

    @property
    def ok(self) -> bool:
        return all(self.generate_equal) and self.recipe_ok


def run_demo(
    *,
    model_name: str = "t5",
    device: str = "auto",
    batch_size: int = 2,
    input_length: int = 12,
    new_tokens: int = 16,
    calls: int = 2,
    out: TextIO,
) -> DemoReport:
    """Run the demo and write its report to `out`; see the module docstring."""
    built = zoo.build(model_name, device=pick_device(device))
    inputs = built.inputs(batch_size, input_length, 1)
    reference = zoo.generate_tokens(built.model, inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    model = enable(built.model)
    out.write(f"cachelife demo: {model_name} on {model.device}\n\n")
    out.write(f"1. cachelife.generate(model, **inputs, max_new_tokens={new_tokens}): one compiled step per token\n")
    equal = []
    for index in range(calls):
        started = time.perf_counter()
        tokens = generate(model, fallback=False, **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        seconds = time.perf_counter() - started
        equal.append(isinstance(tokens, torch.Tensor) and torch.equal(tokens, reference))
        note = " (compiles the step)" if index == 0 else ""
        verdict = "equal to" if equal[-1] else "DIFFERENT from"
        out.write(f"   call {index}: {seconds:.2f} s{note}, {new_tokens} tokens {verdict} eager generate\n")

    recipe = run_recipe(
        model_name,
        device=device,
        batch_size=batch_size,
        input_length=input_length,
        new_tokens=new_tokens,
        calls=calls,
    )
    out.write(
        "\n2. the compiled-forward recipe: cachelife.enable(model), model.forward compiled (fullgraph), "
        "generate(cache_implementation='static')\n"
        f"   eager dynamic-cache generate (reference): {recipe.eager_seconds:.2f} s\n"
        f"   per-layer lifecycle at the first forward call:\n{recipe.table_at_first_forward or '(none seen)'}\n"
    )
    for call in recipe.calls:
        if call.error is not None:
            out.write(f"   call {call.index}: FAILED {call.error}\n")
            continue
        verdict = "equal to" if call.equal_to_eager else "DIFFERENT from"
        out.write(f"   call {call.index}: {call.seconds:.2f} s, {new_tokens} tokens {verdict} eager\n")
    report = DemoReport(tuple(equal), recipe.ok)
    out.write("\nOK: both compiled paths equal eager generation\n" if report.ok else "\nFAILED\n")
    return report
