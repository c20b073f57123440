"""The demo, the README's first command: both compiled paths on the embedded model equal eager generation."""

from __future__ import annotations

import io

import pytest

from cachelife.tools.demo import run_demo


@pytest.mark.slow
def test_the_demo_shows_cachelife_generate_and_the_recipe_and_both_equal_eager() -> None:
    out = io.StringIO()
    report = run_demo(device="cpu", out=out)
    text = out.getvalue()
    assert report.ok, text
    assert report.generate_equal == (True, True)
    assert "cachelife.generate(model, **inputs" in text
    assert "per-layer lifecycle at the first forward call" in text
    assert text.rstrip().endswith("OK: both compiled paths equal eager generation")
