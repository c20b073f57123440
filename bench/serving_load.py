"""Serving load as vLLM's benchmark_serving measures it: clients against a `cachelife.Engine`, here or over HTTP.

    python -m bench.serving_load [--device auto] [--model tiny|llama|llama-small|llama-3.2-1b] [--dtype bfloat16]
                                 [--target engine|http] [--concurrency 16,64] [--rate R,...] [--max-concurrency N]
                                 [--requests 256] [--prompt-tokens 16,128] [--new-tokens 16,64] [--bad-share 0.1]
                                 [--seed 0] [--rows 16] [--queue-size 64] [--steps-per-call 1] [--eager-step]
                                 [--warmup 4] [--out DIR]

`--requests` greedy requests of random token ids drawn from `--seed` (prompt lengths and new tokens from the two
ranges); the model (random weights) has no end token, so each gets exactly the tokens it asks for (vLLM's
ignore_eos). A `--bad-share` of them, chosen from the seed, are invalid in the target's named ways (BAD_KINDS), kind
after kind, and must be refused as the client's fault: a 4xx but 429 over HTTP, `InvalidArgumentError` or
`UnsupportedGenerationError` in-process. The same requests run once per `--concurrency N` (N clients in a closed
loop) and per `--rate R` (an open loop of Poisson arrivals, R a second, at most `--max-concurrency` in flight;
a request's clock starts when it is sent); `--concurrency 16` if neither is given. Targets: `engine`, an `Engine`
(`--rows`, `--queue-size`, `--steps-per-call`, its step compiled unless `--eager-step`) in this process, each
request submitted from a client thread with a streamer timing each token; `http`, the same engine in
`cachelife.serving.ray_serve.application` on a local Ray Serve (a free port; a GPU on CUDA), each request a streamed
`POST /v1/completions` over the standard library's HTTP whose server-sent events are timed as they come (the
stand-in tokenizer writes each token as one word: an event per token). `--warmup` good requests go first, one at a
time, untimed, after the engine's own warm-up (`Engine.warm_up`; over HTTP the replica's). Per run:
requests completed, failed (a good request refused or broken), rejected (the queue full: `QueueFullError`, 503,
429), bad requests answered correctly and wrongly (and per kind), server errors (a 5xx but 503, an error event in a
stream, any other exception), wall seconds, output tokens and requests per second, and over the completed requests
milliseconds (p50, p99, max, mean) of time to first token (TTFT), time per output token (TPOT: (latency - TTFT) /
(tokens - 1)), inter-token latency (ITL: every gap between a request's tokens) and
end-to-end latency. The tokens the first `--verdicts` completed requests of each run got (over HTTP, read back
from their words) are judged against transformers (`bench.verdict`). Writes
`<out>/serving-load-<model>-<target>-<device>-<date>-tf<version>.json`.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import importlib
import itertools
import json
import random
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, Literal

import attrs
import torch
from attrs import frozen
from transformers import PreTrainedModel
from transformers.generation.streamers import BaseStreamer

import bench
from bench.padded import MODEL_NAMES, build_model
from bench.results_file import bench_parser, results_file
from bench.timing import milliseconds
from bench.verdict import judge_requests
from cachelife.errors import InvalidArgumentError, QueueFullError, UnsupportedGenerationError
from cachelife.serving.engine import Engine
from cachelife.tools.recipe import pick_device

COMPLETIONS: Final = "/v1/completions"
# How a bad request is bad, per target: its prompt, its budget, its arguments or its body.
BAD_KINDS: Final[dict[str, tuple[str, ...]]] = {
    "engine": ("engine_setting", "prompt_too_long", "token_out_of_vocabulary", "ids_not_a_tensor"),
    "http": ("unsupported_field", "prompt_too_long", "token_out_of_vocabulary", "negative_max_tokens",
             "malformed_json"),
}  # fmt: skip
# What came back: new tokens, a refusal as the client's fault, a full queue, or anything else.
Reply = Literal["tokens", "refused", "rejected", "error"]
# What a request's reply counts as, by (whether the request was bad, the reply).
ANSWERS: Final[dict[tuple[bool, Reply], str]] = {
    (False, "tokens"): "completed", (False, "refused"): "failed", (False, "error"): "failed",
    (True, "refused"): "bad_answered_correctly", (True, "tokens"): "bad_answered_wrongly",
    (True, "error"): "bad_answered_wrongly", (False, "rejected"): "rejected", (True, "rejected"): "rejected",
}  # fmt: skip


@frozen(kw_only=True)
class Planned:
    """One request as it is sent: its prompt's token ids, its new tokens, when it arrives (seconds after the run's
    start) and, for a bad request, how it is bad."""

    prompt: tuple[int, ...]
    new_tokens: int
    arrival_s: float = 0.0
    bad: str | None = None


@frozen(kw_only=True)
class Outcome:
    """A request's answer: what it counts as, whether it was a server error, when it was sent, when each new token
    came and when the answer ended (`time.perf_counter()` seconds), and what an error said."""

    request: Planned
    answer: str
    server_error: bool
    sent: float
    token_times: tuple[float, ...]
    ended: float
    detail: str = ""
    tokens: tuple[int, ...] = ()  # the new tokens it got


Send = Callable[[Planned], Outcome]


def plan(
    count: int, *, seed: int, prompt_tokens: tuple[int, int], new_tokens: tuple[int, int], vocab: int,
    max_length: int, bad_share: float = 0.0, bad_kinds: Sequence[str] = (),
) -> list[Planned]:  # fmt: skip
    """`count` requests drawn from `seed`; `round(bad_share * count)` of them, chosen from the seed, bad in turn in
    each of `bad_kinds`' ways (a prompt longer than `max_length`, a token id past `vocab`, a budget of -1 here; the
    target applies the others)."""
    draw = random.Random(seed)
    bad = sorted(draw.sample(range(count), round(bad_share * count)))
    kinds = {index: bad_kinds[turn % len(bad_kinds)] for turn, index in enumerate(bad)}
    made = []
    for index in range(count):
        kind = kinds.get(index)
        length = max_length + 1 if kind == "prompt_too_long" else draw.randint(*prompt_tokens)
        prompt = [draw.randrange(3, vocab) for _ in range(length)]  # clear of the usual special tokens 0, 1, 2
        if kind == "token_out_of_vocabulary":
            prompt[-1] = vocab
        tokens = draw.randint(*new_tokens)
        made.append(Planned(prompt=tuple(prompt), new_tokens=-1 if kind == "negative_max_tokens" else tokens, bad=kind))
    return made


def arrivals(requests: Sequence[Planned], rate: float, seed: int) -> list[Planned]:
    """`requests` arriving at `rate` per second, the first at once: exponential gaps drawn from `seed`."""
    draw = random.Random(seed)
    times = itertools.accumulate((draw.expovariate(rate) for _ in requests[1:]), initial=0.0)
    return [attrs.evolve(request, arrival_s=at) for request, at in zip(requests, times, strict=True)]


def outcome(request: Planned, reply: Reply, sent: float, token_times: Sequence[float], detail: str = "", *,
            tokens: Sequence[int] = ()) -> Outcome:  # fmt: skip
    """The request's outcome, ended now."""
    return Outcome(request=request, answer=ANSWERS[request.bad is not None, reply], server_error=reply == "error",
                   sent=sent, token_times=tuple(token_times), ended=time.perf_counter(), detail=detail,
                   tokens=tuple(tokens))  # fmt: skip


def run_load(send: Send, requests: Sequence[Planned], *, clients: int) -> tuple[list[Outcome], float]:
    """Every request sent at its arrival by the first of `clients` threads that is free (a closed loop when all
    arrive at 0), their outcomes in order, and the wall seconds until the last was answered."""
    started = time.perf_counter()
    with ThreadPoolExecutor(clients, thread_name_prefix="serving-load-client") as pool:
        futures = []
        for request in requests:
            time.sleep(max(0.0, started + request.arrival_s - time.perf_counter()))
            futures.append(pool.submit(send, request))
        outcomes = [future.result() for future in futures]
    return outcomes, time.perf_counter() - started


class TokenTimes(BaseStreamer):
    """A streamer that notes when each new token came (`generate` puts the prompt first)."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if self.prompt_seen:
            self.times.extend([time.perf_counter()] * value.numel())
        self.prompt_seen = True

    def end(self) -> None:
        pass


def engine_request(engine: Engine, device: torch.device, request: Planned) -> Outcome:
    """One greedy request submitted to `engine`, its tokens timed by a streamer."""
    ids = torch.tensor([request.prompt], device=device)
    arguments: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "do_sample": False,
                                 "max_new_tokens": request.new_tokens}  # fmt: skip
    if request.bad == "engine_setting":
        arguments["steps_per_call"] = 2
    if request.bad == "ids_not_a_tensor":
        arguments["input_ids"] = [list(request.prompt)]
    streamer, sent = TokenTimes(), time.perf_counter()
    try:
        sequence = engine.submit(**arguments, streamer=streamer).result()
    except QueueFullError as error:
        return outcome(request, "rejected", sent, streamer.times, repr(error))
    except (InvalidArgumentError, UnsupportedGenerationError) as error:
        return outcome(request, "refused", sent, streamer.times, repr(error))
    except Exception as error:  # any other failure is the engine's: counted, not raised
        return outcome(request, "error", sent, streamer.times, repr(error))
    return outcome(request, "tokens", sent, streamer.times, tokens=sequence[0, len(request.prompt) :].tolist())


def http_request(port: int, model_name: str, request: Planned) -> Outcome:
    """One greedy streamed completion from the server on `port`, each server-sent event's tokens timed."""
    body: dict[str, Any] = {"model": model_name, "prompt": list(request.prompt), "max_tokens": request.new_tokens,
                            "temperature": 0, "stream": True}  # fmt: skip
    if request.bad == "unsupported_field":
        body["best_of"] = 2  # a field of OpenAI's this server refuses
    data = json.dumps(body).encode()
    if request.bad == "malformed_json":
        data = data[:-1]  # the closing brace cut off
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    times: list[float] = []
    tokens: list[int] = []
    sent = time.perf_counter()
    try:
        connection.request("POST", COMPLETIONS, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        status = response.status
        if status != 200:  # 429 and 503: a full queue; another 4xx: the client's fault
            reply: Reply = "rejected" if status in (429, 503) else "refused" if 400 <= status < 500 else "error"
            return outcome(request, reply, sent, times, f"{status} {response.read()!r:.300}")
        for line in response:
            if not line.startswith(b"data: {"):  # blank lines between events, and the closing "[DONE]"
                continue
            event = json.loads(line.removeprefix(b"data: "))
            if "error" in event:
                return outcome(request, "error", sent, times, f"an error event: {event['error']!r:.300}")
            new = IdWords().encode(event["choices"][0]["text"])
            times.extend([time.perf_counter()] * len(new))
            tokens.extend(new)
        return outcome(request, "tokens", sent, times, tokens=tokens)
    except (OSError, http.client.HTTPException, ValueError) as error:
        return outcome(request, "error", sent, times, repr(error))
    finally:
        connection.close()


class IdWords:
    """A stand-in tokenizer for a model with random weights: token id 7 is the word "t7", special or not."""

    def encode(self, text: str) -> list[int]:
        return [int(word[1:]) for word in text.split() if word[1:].isdigit()]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(f"t{token}" for token in token_ids)


def served_model(model_name: str, device: torch.device, dtype: torch.dtype) -> tuple[PreTrainedModel, IdWords]:
    """The named model (seeded random weights) without an end token, and the stand-in tokenizer: both targets'
    factory, which Ray's replica calls."""
    model = build_model(model_name, device, dtype)
    model.generation_config.eos_token_id = None
    return model, IdWords()


def routed(port: int, seconds: float = 300.0) -> None:
    """Wait until Serve's proxy routes the completions path to the app: it answers 404 until it has learned it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=seconds)
        try:
            connection.request("POST", COMPLETIONS, body=b"{}")
            if connection.getresponse().status != 404:
                return
        except (OSError, http.client.HTTPException):
            pass  # the proxy not listening yet
        finally:
            connection.close()
        time.sleep(0.5)
    msg = f"Serve's proxy still routes no {COMPLETIONS} on port {port} after {seconds} s"
    raise TimeoutError(msg)


@contextlib.contextmanager
def served(factory: Callable[[], tuple[PreTrainedModel, IdWords]], *, name: str, num_gpus: float,
           engine_options: dict[str, Any]) -> Iterator[int]:  # fmt: skip
    """The port of a local Ray Serve that serves `factory`'s model at /v1/completions, one replica."""
    # The serve extra, for the http target only (Ray's own functions are untyped: reached through the module).
    ray, serve = importlib.import_module("ray"), importlib.import_module("ray.serve")
    from cachelife.serving.ray_serve import application  # noqa: PLC0415

    # The replica unpickles the factory: bench is no installed package, so its functions travel by value.
    ray.cloudpickle.register_pickle_by_value(bench)
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        with socket.socket() as probe:  # a free port, as the system hands one out
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(application(factory, name=name, num_gpus=num_gpus, **engine_options), name=name, route_prefix="/")
        routed(port)
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()
        ray.cloudpickle.unregister_pickle_by_value(bench)


@contextlib.contextmanager
def target(kind: str, model_name: str, device: torch.device, dtype: torch.dtype,
           engine_options: dict[str, Any]) -> Iterator[Send]:  # fmt: skip
    """How to send one request to the engine (`kind` "engine") or the HTTP server ("http") serving the model."""
    factory = functools.partial(served_model, model_name, device, dtype)
    if kind == "engine":
        model, _ = factory()
        with Engine(model, **engine_options) as engine:
            ids = torch.arange(3, 19, device=model.device)[None] % int(model.config.vocab_size)
            engine.warm_up(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False)  # as Ray's replica
            yield functools.partial(engine_request, engine, model.device)
        return
    num_gpus = 1 if device.type == "cuda" else 0
    with served(factory, name=model_name, num_gpus=num_gpus, engine_options=engine_options) as port:
        yield functools.partial(http_request, port, model_name)


def summary(outcomes: Sequence[Outcome], wall: float) -> dict[str, Any]:
    """A run's counts, rates and latency spreads (milliseconds, over the completed requests; None without any)."""
    counts = Counter(outcome.answer for outcome in outcomes)
    done = [outcome for outcome in outcomes if outcome.answer == "completed"]
    timed = [outcome for outcome in done if outcome.token_times]
    tokens = sum(len(outcome.token_times) for outcome in done)
    sent = Counter(outcome.request.bad for outcome in outcomes if outcome.request.bad is not None)
    right = Counter(outcome.request.bad for outcome in outcomes if outcome.answer == "bad_answered_correctly")

    def spread(values: list[float]) -> dict[str, float] | None:
        return milliseconds(values) if values else None

    return {
        "requests": len(outcomes), "bad_requests": sent.total(),
        **{answer: counts[answer] for answer in dict.fromkeys(ANSWERS.values())},
        "server_errors": sum(outcome.server_error for outcome in outcomes),
        "bad_by_kind": {kind: {"sent": sent[kind], "answered_correctly": right[kind]} for kind in sorted(sent)},
        "token_counts_equal_asked": all(len(o.token_times) == o.request.new_tokens for o in done),
        "wall_s": round(wall, 3), "output_tokens": tokens, "output_tokens_per_s": round(tokens / wall, 1),
        "requests_per_s": round(counts["completed"] / wall, 2),
        "ttft_ms": spread([o.token_times[0] - o.sent for o in timed]),
        "tpot_ms": spread([(o.ended - o.token_times[0]) / (len(o.token_times) - 1) for o in timed
                           if len(o.token_times) > 1]),
        "itl_ms": spread([later - earlier for o in timed for earlier, later in itertools.pairwise(o.token_times)]),
        "latency_ms": spread([o.ended - o.sent for o in done]),
        "unexpected_answers": sorted({o.detail for o in outcomes if o.answer in ("failed", "bad_answered_wrongly")
                                      or o.server_error})[:5],
    }  # fmt: skip


def pair(text: str) -> tuple[int, int]:
    low, high = (int(part) for part in text.split(","))
    return low, high


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="llama-3.2-1b", choices=MODEL_NAMES)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--target", default="engine", choices=tuple(BAD_KINDS))
    parser.add_argument("--concurrency", default="", help="closed-loop client counts, comma-separated")
    parser.add_argument("--rate", default="", help="open-loop request rates per second, comma-separated")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most, at a rate")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=pair, default=(16, 128), help="shortest,longest prompt")
    parser.add_argument("--new-tokens", type=pair, default=(16, 64), help="fewest,most new tokens")
    parser.add_argument("--bad-share", type=float, default=0.1, help="share of invalid requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--queue-size", type=int, default=64)
    parser.add_argument("--steps-per-call", type=int, default=1)
    parser.add_argument("--eager-step", action="store_true", help="the engine's step uncompiled")
    parser.add_argument("--warmup", type=int, default=4, help="good requests sent one at a time before timing")
    parser.add_argument("--verdicts", type=int, default=4, help="answers of each run judged against transformers")
    args = parser.parse_args(argv)
    device, dtype = pick_device(args.device), getattr(torch, args.dtype)
    runs: list[tuple[str, float]] = [("concurrency", int(n)) for n in args.concurrency.split(",") if n]
    runs += [("rate", float(r)) for r in args.rate.split(",") if r]
    max_length = args.prompt_tokens[1] + args.new_tokens[1] + args.steps_per_call
    options = {"rows": args.rows, "max_length": max_length, "queue_size": args.queue_size,
               "steps_per_call": args.steps_per_call, "compile_step": not args.eager_step}  # fmt: skip
    vocab = int(build_model(args.model, torch.device("meta"), dtype).config.vocab_size)  # its config alone
    shapes = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "vocab": vocab,
              "max_length": max_length}  # fmt: skip
    requests = plan(args.requests, seed=args.seed, bad_share=args.bad_share, bad_kinds=BAD_KINDS[args.target], **shapes)
    out = results_file(args.out, f"serving-load-{args.model}-{args.target}", device, "bench.serving_load", {
        "model": args.model, "dtype": args.dtype, "target": args.target, "requests": args.requests,
        "bad_share": args.bad_share, "seed": args.seed, "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens, "engine": options, "argv": sys.argv[1:] if argv is None else list(argv),
        "results": [],
    })  # fmt: skip
    with target(args.target, args.model, device, dtype, options) as send:
        warm, _ = run_load(send, plan(args.warmup, seed=args.seed + 1, **shapes), clients=1)
        if any(outcome.answer != "completed" for outcome in warm):
            msg = f"the warm-up's requests did not all complete: {[outcome.detail for outcome in warm]}"
            raise RuntimeError(msg)
        judged: list[Outcome] = []
        for mode, value in runs or [("concurrency", 16)]:
            timed = requests if mode == "concurrency" else arrivals(requests, value, args.seed)
            clients = int(value) if mode == "concurrency" else args.max_concurrency or len(requests)
            outcomes, wall = run_load(send, timed, clients=clients)
            limit = {"max_concurrency": args.max_concurrency} if mode == "rate" else {}  # None: no limit
            out.add({"mode": mode, mode: value, **limit, **summary(outcomes, wall)})
            judged += [outcome for outcome in outcomes if outcome.answer == "completed"][: args.verdicts]
    if judged:
        out.put("verdict", verdict(args.model, device, dtype, judged))
    out.finish()
    return 0


def verdict(model_name: str, device: torch.device, dtype: torch.dtype, judged: Sequence[Outcome]) -> dict[str, Any]:
    """The verdict against transformers (bench.verdict, tokens) on the tokens the load's requests got."""
    model, _ = served_model(model_name, device, dtype)  # the served weights: seeded
    decoded = []
    for answer in judged:
        ids = torch.tensor([answer.request.prompt], device=device)
        sequence = torch.cat([ids, torch.tensor([answer.tokens], dtype=ids.dtype, device=device)], dim=1)
        decoded.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, sequence))
    return judge_requests(model, decoded)


if __name__ == "__main__":
    raise SystemExit(main())
