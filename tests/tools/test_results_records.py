"""The results tables of the documentation (docs/_ext/cachelife_docs/records.py): which nested values of a results
file become columns of their parent's row. Loaded from its file: the extension's package imports Sphinx."""

from __future__ import annotations

from support import docs_module

records = docs_module("records")


def test_a_timeline_with_its_idle_breakdown_stays_columns_of_its_path() -> None:
    # bench.timing's record: four plain fields and the idle time by kernel group, which the tables leave out (it
    # made the timeline a section of its own, and the performance page's busy and span columns empty).
    path = {
        "ms_per_step": 3.1,
        "timeline": {
            "kernel_ms_per_step": 2.8, "busy_ms_per_step": 2.8, "span_ms_per_step": 3.2, "kernels_per_step": 710.5,
            "idle_ms_per_step_before": {"norms": 0.15, "matrix_products": 0.16},
        },
    }  # fmt: skip
    cells, nested = records._split(path)
    assert nested == {}
    assert cells["timeline.busy_ms_per_step"] == records.cell(2.8)
    assert "timeline.idle_ms_per_step_before" not in cells


def test_a_larger_object_is_a_section_of_its_own() -> None:
    path = {"ms_per_step": 3.1, "timeline": dict.fromkeys("abcde", 1.0)}
    cells, nested = records._split(path)
    assert list(nested) == ["timeline"]
    assert "timeline.a" not in cells


def test_an_empty_list_shows_as_none_and_a_list_as_its_items() -> None:
    # An engine step's `enable` is [] for the model without levers: a blank cell read as a missing column.
    assert records.cell([]) == "none"
    assert records.cell(["fuse_projections", "small_linear"]) == "fuse_projections, small_linear"
