"""bench.engine_step: the union of kernel intervals it reads the device's idle time from, and a CPU run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from bench import engine_step


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
    assert engine_step.busy_union(intervals) == covered


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
