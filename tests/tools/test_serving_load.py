"""bench/serving_load.py, the serving load generator: its plan, its percentiles and how it counts answers, then
short runs on a tiny Llama against the engine in this process (closed and open loop, a full queue, the results
file) and over HTTP through Ray Serve (skipped without the serve extra)."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from bench.serving_load import (
    BAD_KINDS,
    Outcome,
    Planned,
    Reply,
    arrivals,
    main,
    outcome,
    plan,
    run_load,
    summary,
    target,
    verdict,
)
from bench.timing import milliseconds, percentile

SHAPES: dict[str, Any] = {"prompt_tokens": (4, 24), "new_tokens": (2, 10), "vocab": 512, "max_length": 40}
# The engine of the runs below: the tiny Llama's step uncompiled (compiling it takes most of a minute on a CPU).
ENGINE: dict[str, Any] = {"rows": 4, "max_length": 40, "queue_size": 16, "steps_per_call": 1, "compile_step": False}
CPU = torch.device("cpu")


def test_percentiles_are_nearest_rank_and_in_milliseconds() -> None:
    values = [0.007, 0.001, 0.010, 0.003, 0.002, 0.009, 0.004, 0.006, 0.005, 0.008]  # 1 to 10 ms, shuffled
    assert [percentile(values, share) for share in (10, 50, 51, 99, 100)] == [0.001, 0.005, 0.006, 0.010, 0.010]
    assert milliseconds(values) == {"p50": 5.0, "p99": 10.0, "max": 10.0, "mean": 5.5}
    assert milliseconds([0.25]) == {"p50": 250.0, "p99": 250.0, "max": 250.0, "mean": 250.0}


def test_a_plan_is_its_seeds_and_its_bad_requests_take_each_kind_in_turn() -> None:
    kinds = BAD_KINDS["http"]
    requests = plan(60, seed=3, bad_share=0.25, bad_kinds=kinds, **SHAPES)
    assert requests == plan(60, seed=3, bad_share=0.25, bad_kinds=kinds, **SHAPES)
    assert requests != plan(60, seed=4, bad_share=0.25, bad_kinds=kinds, **SHAPES)
    expected: dict[str | None, int] = {None: 45, **dict.fromkeys(kinds, 3)}
    assert Counter(request.bad for request in requests) == expected
    for request in requests:
        if request.bad is None:
            assert 4 <= len(request.prompt) <= 24
            assert 2 <= request.new_tokens <= 10
            assert all(3 <= token < 512 for token in request.prompt)
        assert (len(request.prompt) > 40) == (request.bad == "prompt_too_long")
        assert (512 in request.prompt) == (request.bad == "token_out_of_vocabulary")
        assert (request.new_tokens == -1) == (request.bad == "negative_max_tokens")


def test_arrivals_are_a_poisson_process_from_the_seed() -> None:
    requests = plan(2000, seed=0, **SHAPES)
    timed = arrivals(requests, 50.0, seed=1)
    assert timed == arrivals(requests, 50.0, seed=1)
    assert [(request.prompt, request.new_tokens) for request in timed] == [(r.prompt, r.new_tokens) for r in requests]
    times = [request.arrival_s for request in timed]
    assert times[0] == 0.0
    assert all(earlier < later for earlier, later in itertools.pairwise(times))
    assert times[-1] / (len(times) - 1) == pytest.approx(1 / 50, rel=0.1)


def answered_by(reply: Reply, requests: Sequence[Planned]) -> list[Outcome]:
    """Each request answered with `reply` (and, for "tokens", exactly its new tokens, 1 ms apart)."""
    tokens = reply == "tokens"
    return [outcome(request, reply, 0.0, [0.001 * (1 + i) for i in range(request.new_tokens if tokens else 0)])
            for request in requests]  # fmt: skip


@pytest.mark.parametrize(
    ("reply", "good_as", "bad_as", "server_errors"),
    [
        ("tokens", "completed", "bad_answered_wrongly", 0),  # a server that serves bad requests
        ("refused", "failed", "bad_answered_correctly", 0),  # a server that refuses everything as invalid
        ("rejected", "rejected", "rejected", 0),  # a full queue
        ("error", "failed", "bad_answered_wrongly", 20),  # a broken server
    ],
)
def test_each_reply_counts_as_what_it_is_for_good_and_bad_requests(
    reply: Reply, good_as: str, bad_as: str, server_errors: int
) -> None:
    requests = plan(20, seed=0, bad_share=0.25, bad_kinds=BAD_KINDS["engine"], **SHAPES)
    counted = summary(answered_by(reply, requests), wall=1.0)
    tally = Counter({good_as: 15}) + Counter({bad_as: 5})
    for answer in ("completed", "failed", "rejected", "bad_answered_correctly", "bad_answered_wrongly"):
        assert counted[answer] == tally[answer], answer
    assert (counted["bad_requests"], counted["server_errors"]) == (5, server_errors)


def check_every_answer(outcomes: list[Outcome], requests: Sequence[Planned]) -> dict[str, Any]:
    """Every good request completed with exactly its tokens, one at a time, its first before its end; every bad one
    refused as the client's fault; nothing else. The run's summary."""
    assert [done.request for done in outcomes] == list(requests)
    for done in outcomes:
        if done.request.bad is not None:
            assert (done.answer, done.server_error, done.token_times) == ("bad_answered_correctly", False, ()), done
            continue
        assert (done.answer, done.server_error) == ("completed", False), done
        assert len(done.token_times) == done.request.new_tokens
        assert done.sent < done.token_times[0] <= done.token_times[-1] <= done.ended  # TTFT <= latency
        assert all(earlier < later for earlier, later in itertools.pairwise(done.token_times))
    counted = summary(outcomes, wall=1.0)
    good = [request for request in requests if request.bad is None]
    assert counted["completed"] == len(good)
    assert counted["bad_answered_correctly"] == counted["bad_requests"] == len(requests) - len(good)
    assert counted["failed"] == counted["rejected"] == counted["bad_answered_wrongly"] == counted["server_errors"] == 0
    assert counted["output_tokens"] == sum(request.new_tokens for request in good)
    assert counted["token_counts_equal_asked"] is True
    assert counted["ttft_ms"]["max"] <= counted["latency_ms"]["max"]
    return counted


# At most 16 requests in flight, under the engine's 20 places: a slow machine makes requests wait, never refused.
@pytest.mark.parametrize(("clients", "rate"), [(4, None), (16, 400.0)], ids=["closed-loop", "open-loop"])
def test_the_engine_completes_every_good_request_and_refuses_every_bad_one(clients: int, rate: float | None) -> None:
    requests = plan(32, seed=0, bad_share=0.25, bad_kinds=BAD_KINDS["engine"], **SHAPES)
    timed = requests if rate is None else arrivals(requests, rate, seed=0)
    with target("engine", "tiny", CPU, torch.float32, ENGINE) as send:
        outcomes, wall = run_load(send, timed, clients=clients)
    counted = check_every_answer(outcomes, timed)
    assert set(counted["bad_by_kind"]) == set(BAD_KINDS["engine"])
    assert wall >= timed[-1].arrival_s


def test_the_verdict_reads_the_tokens_each_request_got() -> None:
    requests = [request for request in plan(6, seed=0, **SHAPES) if request.bad is None][:3]
    with target("engine", "tiny", CPU, torch.float32, ENGINE) as send:
        outcomes, _ = run_load(send, requests, clients=3)
    assert all(len(outcome.tokens) == outcome.request.new_tokens for outcome in outcomes)
    assert verdict("tiny", CPU, torch.float32, outcomes)["tokens_agree_with_transformers"]
    wrong = attrs.evolve(outcomes[1], tokens=tuple((token + 1) % 64 for token in outcomes[1].tokens))
    assert not verdict("tiny", CPU, torch.float32, [outcomes[0], wrong])["tokens_agree_with_transformers"]


def test_a_full_queue_is_counted_as_rejected_not_as_failed() -> None:
    requests = plan(24, seed=0, **SHAPES)
    with target("engine", "tiny", CPU, torch.float32, {**ENGINE, "rows": 1, "queue_size": 0}) as send:
        outcomes, _ = run_load(send, requests, clients=8)
    counted = summary(outcomes, wall=1.0)
    assert counted["rejected"] > 0
    assert counted["completed"] + counted["rejected"] == 24
    assert counted["failed"] == counted["server_errors"] == 0


def test_the_command_line_writes_one_result_per_run(tmp_path: Path) -> None:
    arguments = ["--device", "cpu", "--model", "tiny", "--dtype", "float32", "--concurrency", "2", "--rate", "200",
                 "--requests", "20", "--rows", "2", "--prompt-tokens", "4,12", "--new-tokens", "2,6", "--eager-step",
                 "--warmup", "2", "--out", str(tmp_path)]  # fmt: skip
    assert main(arguments) == 0
    (written,) = tmp_path.glob("serving-load-tiny-engine-cpu-*.json")
    record = json.loads(written.read_text())
    assert {"date", "device", "torch", "transformers", "commit"} <= record.keys()
    assert record["verdict"]["tokens_agree_with_transformers"]  # float32: the engine's tokens are transformers
    assert [(run["mode"], run.get("concurrency", run.get("rate"))) for run in record["results"]] == [
        ("concurrency", 2), ("rate", 200.0),
    ]  # fmt: skip
    for run in record["results"]:
        assert (run["completed"], run["bad_answered_correctly"], run["server_errors"]) == (18, 2, 0)
        assert run["ttft_ms"]["p50"] <= run["latency_ms"]["p50"]
        assert run["tpot_ms"]["p50"] > 0
        assert run["output_tokens_per_s"] == pytest.approx(run["output_tokens"] / run["wall_s"], rel=0.01)


# The harness over HTTP: the server itself is tested in tests/serving/test_ray_serve.py, which CI runs.
@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.xdist_group("ray")  # one local Ray at a time, on the worker that runs tests/serving/test_ray_serve.py
def test_the_http_server_streams_every_good_request_and_answers_every_bad_one_4xx() -> None:
    pytest.importorskip("ray", reason="the serve extra (pip install -e '.[serve]') is not installed")
    requests = plan(30, seed=0, bad_share=0.2, bad_kinds=BAD_KINDS["http"], **SHAPES)
    with target("http", "tiny", CPU, torch.float32, ENGINE) as send:
        outcomes, _ = run_load(send, requests, clients=4)
        counted = check_every_answer(outcomes, requests)
        assert set(counted["bad_by_kind"]) == set(BAD_KINDS["http"])
        answered = [outcome for outcome in outcomes if outcome.answer == "completed"][:4]
        assert verdict("tiny", CPU, torch.float32, answered)["tokens_agree_with_transformers"]  # words read back
        timed = arrivals(requests, 100.0, seed=0)
        check_every_answer(run_load(send, timed, clients=len(timed))[0], timed)
