"""bench.timing's kernel timeline (the union of kernel intervals, and the idle time before each group of kernels)
that bench.engine_step and bench.generate read the device's idle time from, and a CPU run of bench.engine_step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from bench import engine_step, timing


@pytest.mark.parametrize(
    ("intervals", "covered"),
    [
        ([], 0),
        ([(0, 10)], 10),
        ([(0, 10), (5, 15)], 15),  # overlapping
        ([(0, 10), (2, 4)], 10),  # nested
        ([(20, 30), (0, 10)], 20),  # apart, out of order
        ([(0, 10), (10, 12)], 12),  # touching
    ],
)
def test_busy_time_is_the_union_of_the_kernels_intervals(intervals: list[tuple[int, int]], covered: int) -> None:
    seen = timing.timeline(("k", start, end) for start, end in intervals)
    assert seen.busy_ms == covered
    assert seen.span_ms - seen.busy_ms == sum(seen.idle_ms_before.values())


def test_each_gap_counts_for_the_group_of_the_kernel_that_ends_it() -> None:
    kernels = [
        ("triton_poi_fused_add_0", 0.0, 2.0),
        ("ampere_bf16_gemv", 3.0, 5.0),  # 1 ms idle before a matrix product
        ("flash_fwd_splitkv_kernel", 5.0, 6.0),  # none: touching
        ("small_linear_kernel", 6.5, 7.0),  # 0.5 ms before a linear kernel (a matrix product)
        ("triton_red_fused_native_layer_norm_1", 9.0, 10.0),  # 2 ms before a norm
        ("nested", 9.2, 9.5),  # inside the norm's interval: no gap
        ("empty", 11.0, 11.0),  # no duration: left out
    ]
    seen = timing.timeline(kernels)
    assert seen.idle_ms_before == {"matrix_products": 1.5, "norms": 2.0}
    assert (seen.kernels, seen.span_ms, seen.busy_ms) == (6, 10.0, 6.5)
    assert seen.kernel_ms == pytest.approx(6.8)


def test_a_steps_idle_time_is_what_more_steps_added_per_step() -> None:
    short = timing.timeline([("gemm", 0.0, 1.0), ("norm", 2.0, 3.0)])
    long = timing.timeline([("gemm", 0.0, 1.0), ("norm", 2.0, 3.0), ("gemm", 5.0, 6.0), ("norm", 8.0, 9.0)])
    step = timing.per_step(short, long, 2)
    assert step["idle_ms_per_step_before"] == {"matrix_products": 1.0, "norms": 1.0}
    assert (step["span_ms_per_step"], step["busy_ms_per_step"], step["kernels_per_step"]) == (3.0, 1.0, 1.0)


def test_a_step_names_the_kernels_and_groups_that_added_most_time() -> None:
    short = timing.timeline([("ampere_bf16_gemv", 0.0, 1.0), ("triton_red_fused_layer_norm_0", 1.0, 1.5)])
    long = timing.timeline([
        ("ampere_bf16_gemv", 0.0, 1.0), ("triton_red_fused_layer_norm_0", 1.0, 1.5),
        ("ampere_bf16_gemv", 2.0, 5.0), ("triton_red_fused_layer_norm_0", 5.0, 5.5),
        ("ampere_bf16_gemv", 6.0, 7.0), ("flash_fwd_kernel", 7.0, 7.25),
    ])  # fmt: skip
    step = timing.per_step(short, long, 2)
    assert step["top"] == [
        {"kernel": "ampere_bf16_gemv", "kernels_per_step": 1.0, "ms_per_step": 2.0},
        {"kernel": "triton_red_fused_layer_norm_0", "kernels_per_step": 0.5, "ms_per_step": 0.25},
        {"kernel": "flash_fwd_kernel", "kernels_per_step": 0.5, "ms_per_step": 0.125},
    ]
    assert step["groups"] == {
        "matrix_products": {"kernels_per_step": 1.0, "ms_per_step": 2.0},
        "norms": {"kernels_per_step": 0.5, "ms_per_step": 0.25},
        "attention": {"kernels_per_step": 0.5, "ms_per_step": 0.125},
    }


def test_an_engine_step_names_the_kernels_that_took_most_time() -> None:
    kernels = [  # two steps, in nanoseconds
        ("ampere_bf16_gemv", 0, 3_000_000), ("flash_fwd_kernel", 3_000_000, 3_500_000),
        ("ampere_bf16_gemv", 4_000_000, 5_000_000), ("flash_fwd_kernel", 5_000_000, 5_500_000),
    ]  # fmt: skip
    figures = engine_step.kernel_figures(kernels, 2)
    assert figures["top"] == [
        {"kernel": "ampere_bf16_gemv", "kernels_per_step": 1.0, "ms_per_step": 2.0},
        {"kernel": "flash_fwd_kernel", "kernels_per_step": 1.0, "ms_per_step": 0.5},
    ]
    assert figures["kernel_ms_per_step"] == 2.5
    assert figures["device_idle_ms_per_step"] == 0.25
    assert figures["groups"]["matrix_products"] == {"ms_per_step": 2.0, "kernels_per_step": 1.0}


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_cpu_run_writes_each_rows_wall_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arguments = ["--device", "cpu", "--model", "llama", "--dtype", "float32", "--rows", "1,2", "--max-length", "64",
                 "--prompt", "8", "--window", "0.1", "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["engine_step", *arguments])
    assert engine_step.main() == 0
    (written,) = tmp_path.glob("engine-step-llama-cpu-*.json")
    results = json.loads(written.read_text())["results"]
    assert [result["rows"] for result in results] == [1, 2]
    assert all(result["steps_timed"] > 0 and result["wall_ms_per_step"] > 0 for result in results)
    assert results[0]["wall_ratio_to_first"] == 1.0
    assert all(result["tokens_agree_with_transformers"] for result in results)  # float32: tokens equal


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_cpu_run_measures_whisper_and_each_attention(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arguments = ["--device", "cpu", "--model", "whisper", "--dtype", "float32", "--rows", "2", "--max-length", "40",
                 "--window", "0.1", "--attention", "model,decode", "--out", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["engine_step", *arguments])
    assert engine_step.main() == 0
    (written,) = tmp_path.glob("engine-step-whisper-cpu-*.json")
    results = json.loads(written.read_text())["results"]
    assert [(result["rows"], result["attention"]) for result in results] == [(2, "model"), (2, "decode")]
    assert all(result["steps_timed"] > 0 for result in results)
    assert all("tokens_agree_with_transformers" not in result for result in results)  # no raw-greedy verdict
