"""The main job: compiled static-cache generation with cachelife on the embedded default model.

Builds a small T5 from a config in code (`cachelife.tools.zoo`), generates eagerly with a dynamic cache for
reference, enables cachelife, compiles `model.forward` (CUDA graphs via mode="reduce-overhead" on a GPU,
inductor on a CPU), generates with `cache_implementation="static"` several times, prints the per-layer
lifecycle table seen at the first forward call, and checks every call's tokens against the reference.
"""

from __future__ import annotations

from typing import TextIO

from cachelife.tools.recipe import RecipeReport, run_recipe


def run_demo(
    *,
    model_name: str = "t5",
    device: str = "auto",
    batch_size: int = 2,
    input_length: int = 12,
    new_tokens: int = 16,
    calls: int = 2,
    out: TextIO,
) -> RecipeReport:
    """Run the demo and write its report to `out`; see the module docstring."""
    report = run_recipe(
        model_name,
        device=device,
        batch_size=batch_size,
        input_length=input_length,
        new_tokens=new_tokens,
        calls=calls,
    )
    out.write(
        f"cachelife demo: {report.model} on {report.device}, torch {report.torch}, "
        f"transformers {report.transformers}\n"
        f"eager dynamic-cache generate (reference): {report.eager_seconds:.2f} s\n"
        "compiled model.forward (fullgraph) + generate(cache_implementation='static') with cachelife enabled\n\n"
        f"per-layer lifecycle at the first forward call:\n{report.table_at_first_forward or '(none seen)'}\n\n"
    )
    for call in report.calls:
        if call.error is not None:
            out.write(f"call {call.index}: FAILED {call.error}\n")
            continue
        verdict = "equal to" if call.equal_to_eager else "DIFFERENT from"
        out.write(f"call {call.index}: {call.seconds:.2f} s, {new_tokens} tokens {verdict} eager\n")
    out.write("OK: compiled static-cache generation equals eager\n" if report.ok else "FAILED\n")
    return report
