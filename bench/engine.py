"""Many clients at once: `cachelife.Engine` against one request at a time, throughput and latency.

    python -m bench.engine [--device auto] [--model whisper-large-v3|llama-3.2-1b|...] [--dtype bfloat16]
                           [--clients 1,4,16,64] [--requests 64] [--rows 16] [--new-tokens 16,64]
                           [--paths engine,engine_decode,engine_one_prefill,engine_eager_prefill,sequential,...]
                           [--num-beams 1] [--ttft] [--verdicts 8]
                           [--switch-interval SECONDS] [--out DIR]

`--requests` requests with mixed lengths (new tokens spread over `--new-tokens`, exactly that many each:
`min_new_tokens = max_new_tokens`; decoder-only prompts of 16-128 tokens; Whisper's 30-second windows of
random features) are served, per path:
- `engine_cN`: an `Engine(rows=--rows)` with N client threads, each submitting its share of the requests one
  after the other (closed loop), once per `--clients` value;
- `sequential`: `cachelife.generate` on each request in turn, one thread, the model enabled
  (`cachelife.enable`: its caches and graphs kept between calls), run first when named (the engine paths'
  `equal_to_sequential` and a lone request's latency come from it);
  both at `--steps-per-call` steps per graph replay;
- `auto`: `model.generate` with transformers' auto-compile, in turn;
- `engine_eager_prefill`: `engine` with every newcomer prefilled by transformers' eager prefill (a
  decoder-only model's engine compiles its prefill otherwise); the engine paths run in the order given, and
  one named twice runs again (`<path>_again_cN`), for a machine whose speed drifts;
- `engine_prefill_without_graphs` (decoder-only): `engine` with newcomers prefilled by the compiled forward at
  their own prompt length, without graphs (their prefill is replayed from a graph of their group size and prompt
  bucket otherwise: `cachelife.serving.joint_prefill`);
- `engine_row_starts_eager`: `engine` with each newcomer's row start (its rows, settings and first token) run
  operation by operation, each launched from the scheduler's thread (`cachelife.serving.row_starts` replays one
  graph per join otherwise);
- `engine_read_lag_1`: `engine` with the rows' state read one call late (`cachelife.serving.snapshots` reads it
  two calls late otherwise, two calls queued on the device);
- `engine_unmasked_kernel` (encoder-decoder): `engine` with cross-attention without a mask through the decode
  attention kernel's matrix products (`cachelife.model_rewrites.decode_attention.UNMASKED_BY_KERNEL`; SDPA
  otherwise);
- `engine_one_prefill`: `engine` with every newcomer prefilled alone, in a forward of its own (newcomers that
  join at one boundary share one forward otherwise: `cachelife.serving.joint_prefill`);
- `engine_encoders_alone` (encoder-decoder): `engine` with every newcomer's encoder run alone in its request's
  thread (encoder calls that arrive together share one forward otherwise: `cachelife.serving.encoder_calls`);
- `engine_decode` and `engine_model_attention`: `engine` with cachelife's decode attention kernel in the rows
  (`Engine(attention="decode")`, `cachelife.serving.step_attention`: each row reads the slots it attends), and
  with the model's own attention (`attention="model"`: SDPA over the whole cache for every row), where `engine`
  takes the engine's default (`attention="auto"`: the kernel on a GPU over SDPA models);
- `engine_cudnn`: `engine` with its steps allowed torch's cuDNN attention (as before they kept to attention that
  repeats exactly: the cost of repeatable attention);
- `engine_sampling_one` and `engine_sampling_mixed`: `engine` with every request sampling (seeded), all with one
  setting (temperature 0.8, top-k 50, top-p 0.95), or with 16 settings spread over the requests (temperatures,
  top-k, top-p, min-p and repetition penalties of their own): what a mix of client-chosen settings costs;
- `generate_batch` (decoder-only): transformers' continuous batching, every request given at once.
A warm-up (every request once, for the engine from `--rows` clients) runs before anything is timed, so that nothing
done the first time (compilation, captures, a prompt length that transformers' eager prefill has not met yet) lands
in whichever client count runs first. Per path: wall seconds, new tokens per second, each request's latency (submit
to result: p50, p99, max), a lone request's latency (`sequential`'s first), for the engine the steps, joins and
prefill forwards of that run and the scheduler's seconds spent admitting newcomers and running steps, with `--ttft`
each path's time to first token (submit to the streamer's first new token: every timed request gets a streamer; not
with beams, which transformers does not stream), with `--device-profile` one more run per engine at the first
`--clients` value under torch.profiler (`engine_cN_profiled`: the device's busy share of the run's wall time, its
kernels per step, and the kernel time launched from CUDA graphs apart from the kernels launched one by one),
with `--num-beams` every request a beam search (a group of that
many rows in the engine), whether each engine run gave every request the tokens of its warm-up (identical
submissions, identical tokens), for a decoder-only model the verdict against transformers on the first `--verdicts`
requests' warm-up tokens (bench.verdict), and, with `sequential` among the paths, how many requests' tokens equal
`sequential`'s (in bf16 a batch's matrix products may round otherwise than one row's, so near ties can break
otherwise).
Writes `<out>/engine-<model>-<device>-<date>-tf<version>.json`. A benchmark, not a timed test.
"""

from __future__ import annotations

import contextlib
import cProfile
import math
import pstats
import sys
import threading
import time
import unittest.mock
from collections.abc import Callable, Iterator
from typing import Any, Final, cast

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

import cachelife
from bench.engine_step import kernel_figures
from bench.generate import auto_compile
from bench.padded import MODEL_NAMES, build_model
from bench.results_file import bench_parser, results_file
from bench.timing import as_tokens, cudnn_attention_allowed, milliseconds, synchronize
from bench.verdict import judge_requests
from cachelife.model_rewrites import decode_attention as decode_attention_module
from cachelife.serving import batch as batch_module
from cachelife.serving import engine as engine_module
from cachelife.serving import joint_prefill
from cachelife.serving import row_starts as row_starts_module
from cachelife.serving import snapshots as snapshots_module
from cachelife.serving.engine import Engine
from cachelife.serving.joint_prefill import JointPrefill
from cachelife.serving.prefill import Prefill
from cachelife.tools import zoo
from cachelife.tools.recipe import pick_device

Request = dict[str, Any]
# The engine paths that differ in their `Engine(attention=...)` alone.
ATTENTIONS: Final[dict[str, str]] = {"engine": "auto", "engine_decode": "decode", "engine_model_attention": "model"}


def requests_for(
    model: PreTrainedModel, count: int, new_tokens: tuple[int, int], seed: int = 0, beams: int = 1
) -> list[Request]:
    generator = torch.Generator().manual_seed(seed)
    shortest, longest = new_tokens
    made = []
    for index in range(count):
        tokens = shortest + (index * 37) % (longest - shortest + 1)
        if model.config.model_type == "whisper":
            frames = 2 * model.config.max_source_positions
            features = torch.randn(1, model.config.num_mel_bins, frames, generator=generator)
            inputs: Request = {"input_features": features.to(model.device, model.dtype)}
            if getattr(model.generation_config, "lang_to_id", None):
                inputs["language"] = "en"  # no language detection: one decoder prompt for every request
        else:
            length = 16 + (index * 53) % 113
            ids = torch.randint(3, int(model.config.vocab_size), (1, length), generator=generator)
            inputs = {"input_ids": ids.to(model.device), "attention_mask": torch.ones_like(ids, device=model.device)}
        made.append({**inputs, "max_new_tokens": tokens, "min_new_tokens": tokens, "num_beams": beams})
    return made


def summary(name: str, wall: float, latencies: list[float], new: int, ttft: list[float] | None) -> dict[str, Any]:
    return {
        "path": name, "wall_s": round(wall, 4), "new_tokens": new, "tokens_per_s": round(new / wall, 1),
        "latency_ms": milliseconds(latencies), **({"ttft_ms": milliseconds(ttft)} if ttft else {}),
    }  # fmt: skip


class FirstToken(BaseStreamer):
    """A streamer that notes when its first new token came (`generate` puts the prompt first)."""

    def __init__(self) -> None:
        self.puts = 0
        self.at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def timed(streamer: FirstToken | None, began: float) -> float:
    if streamer is None or streamer.at is None:
        return math.nan
    return streamer.at - began


def one_at_a_time(
    call: Callable[[Request], torch.Tensor], requests: list[Request], device: torch.device, *, ttft: bool = False
) -> Any:
    for request in requests:  # warm-up: every shape compiled and captured
        call(request)
    latencies, outputs, firsts = [], [], []
    synchronize(device)
    started = time.perf_counter()
    for request in requests:
        streamer = FirstToken() if ttft else None
        began = time.perf_counter()
        outputs.append(call({**request, "streamer": streamer} if streamer is not None else request))
        synchronize(device)
        latencies.append(time.perf_counter() - began)
        firsts.append(timed(streamer, began))
    return time.perf_counter() - started, latencies, outputs, firsts if ttft else None


ONE_SETTING: Request = {"do_sample": True, "temperature": 0.8, "top_k": 50, "top_p": 0.95}


def mixed_setting(index: int) -> Request:
    """The 16 settings of `engine_sampling_mixed`, by request index."""
    kind = index % 16
    setting: Request = {"do_sample": True, "temperature": 0.6 + 0.05 * kind, "top_k": (0, 20, 50, 100)[kind % 4]}
    if kind % 3 == 1:
        setting["top_p"] = 0.9
    if kind % 5 == 2:
        setting["min_p"] = 0.05
    if kind % 7 == 3:
        setting["repetition_penalty"] = 1.1
    return setting


def sampling_requests(requests: list[Request], mixed: bool) -> list[Request]:
    """Every request sampling, seeded by its index (`_seed`, which `with_engine` turns into a generator)."""
    return [{**request, **(mixed_setting(index) if mixed else ONE_SETTING), "_seed": index}
            for index, request in enumerate(requests)]  # fmt: skip


def with_engine(
    engine: cachelife.Engine, requests: list[Request], clients: int, *, device: torch.device, ttft: bool = False
) -> Any:
    latencies: list[float] = [0.0] * len(requests)
    firsts: list[float] = [math.nan] * len(requests)
    outputs: list[torch.Tensor] = [torch.empty(0)] * len(requests)

    def client(indices: list[int]) -> None:
        for index in indices:
            streamer = FirstToken() if ttft else None
            request = dict(requests[index])
            seed = request.pop("_seed", None)
            generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
            began = time.perf_counter()
            outputs[index] = engine.submit(**request, streamer=streamer, generator=generator).result()
            latencies[index] = time.perf_counter() - began
            firsts[index] = timed(streamer, began)

    threads = [threading.Thread(target=client, args=(list(range(len(requests)))[start::clients],))
               for start in range(clients)]  # fmt: skip
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - started, latencies, outputs, firsts if ttft else None


def profile_scheduler(path: str) -> None:
    """Run every engine's scheduler thread under cProfile, its statistics written to `path` (and a text
    summary beside it) when the engine closes: where the scheduler's host time goes."""
    serve = Engine._serve

    def profiled(self: Engine) -> None:
        profile = cProfile.Profile()
        profile.enable()
        try:
            serve(self)
        finally:
            profile.disable()
            profile.dump_stats(path)
            with open(f"{path}.txt", "w") as text:
                stats = pstats.Stats(profile, stream=text)
                stats.sort_stats("cumulative").print_stats(60)
                stats.sort_stats("tottime").print_stats(40)

    Engine._serve = profiled  # type: ignore[method-assign]  # a benchmark's instrument


@contextlib.contextmanager
def one_prefill_each() -> Iterator[None]:
    """Engines made within prefill every newcomer alone, in a forward of its own (what the engine did before its
    joint prefill): a benchmark's instrument, for the side-by-side comparison."""
    takes = JointPrefill.takes
    JointPrefill.takes = lambda self, joining: False  # type: ignore[method-assign]  # a benchmark's instrument
    try:
        yield
    finally:
        JointPrefill.takes = takes  # type: ignore[method-assign]


@contextlib.contextmanager
def prefills_with(**attributes: bool) -> Iterator[None]:
    """Engines made within have their `Prefill` made with `attributes` set (a benchmark's instrument)."""
    made = Prefill.__init__

    def changed(self: Prefill, *arguments: Any, **options: Any) -> None:
        made(self, *arguments, **options)
        for name, value in attributes.items():
            setattr(self, name, value)

    Prefill.__init__ = changed  # type: ignore[method-assign]  # a benchmark's instrument
    try:
        yield
    finally:
        Prefill.__init__ = made  # type: ignore[method-assign]


@contextlib.contextmanager
def prefills_without_graphs() -> Iterator[None]:
    """Engines made within prefill a decoder-only model's newcomers with the compiled forward at their own
    prompt length, no graphs (what the engine did before its prefill graphs of prompt buckets): a benchmark's
    instrument, for the side-by-side comparison."""
    with prefills_with(captures_joint=False), unittest.mock.patch.object(joint_prefill, "bucket", lambda n, _: n):
        yield


@contextlib.contextmanager
def read_one_call_late() -> Iterator[None]:
    """Engines made within read the rows' state one call late, one call queued on the device (what the engine
    did before it read two calls late): a benchmark's instrument, for the side-by-side comparison."""
    with (
        unittest.mock.patch.object(batch_module, "READ_LAG", 1),
        unittest.mock.patch.object(snapshots_module, "READ_LAG", 1),
    ):
        yield


def row_starts_eager() -> contextlib.AbstractContextManager[Any]:
    """Engines made within start newcomers' rows with their operations launched one by one, no graph (what the
    engine launched before its row starts were captured): a benchmark's instrument, for the side-by-side
    comparison."""
    return unittest.mock.patch.object(row_starts_module, "uses_own_graphs", return_value=False)


def unmasked_by_kernel() -> contextlib.AbstractContextManager[Any]:
    """Engines made within run attention without a mask (cross-attention) through the decode attention kernel's
    matrix products: a benchmark's instrument, for the side-by-side comparison before it is a default."""
    return unittest.mock.patch.object(decode_attention_module, "UNMASKED_BY_KERNEL", True)


def encoders_alone() -> contextlib.AbstractContextManager[Any]:
    """Engines made within run every newcomer's encoder alone (what the engine did before it gathered encoder
    calls): a benchmark's instrument, for the side-by-side comparison."""
    return unittest.mock.patch.object(engine_module, "gather_encoder_calls", return_value=None)


def eager_prefills() -> contextlib.AbstractContextManager[None]:
    """Engines made within prefill every newcomer with transformers' eager prefill (what a decoder-only model's
    engine did before its prefill was compiled): a benchmark's instrument, for the side-by-side comparison."""
    return prefills_with(compiles=False)


def engine_runs(
    out: Any, model: PreTrainedModel, requests: list[Request], args: Any, *, reference: list[torch.Tensor] | None,
    new: int, label: str = "engine", judge_tokens: bool = True, attention: str = "auto",
) -> None:  # fmt: skip
    """One engine, warmed up, then every request from each `--clients` count of client threads."""
    longest = int(args.new_tokens.split(",")[1])
    prompts = [int(r["input_ids"].shape[1]) for r in requests if "input_ids" in r]
    options = {"rows": args.rows, "max_length": max(prompts, default=8) + longest + 8,
               "queue_size": max(64, args.requests), "steps_per_call": args.steps_per_call,
               "attention": attention}  # fmt: skip
    if args.profile_scheduler:
        profile_scheduler(args.profile_scheduler)
    with cachelife.Engine(model, **options) as engine:
        implementation = model.config._attn_implementation  # what the engine's rows decode with
        # Warm-up: compile, capture, every prompt shape once. Its tokens are what every later run must repeat.
        _, _, first, _ = with_engine(engine, requests, args.rows, device=model.device)
        verdicts = judged(model, requests, first, args.verdicts if judge_tokens else 0)
        for clients in (int(c) for c in args.clients.split(",")):
            before = engine.stats()
            wall, latencies, outputs, firsts = with_engine(
                engine, requests, clients, device=model.device, ttft=args.ttft
            )
            after = engine.stats()
            same = [reference is not None and torch.equal(got, want)
                    for got, want in zip(outputs, reference or outputs, strict=True)]  # fmt: skip
            repeated = all(torch.equal(got, want) for got, want in zip(outputs, first, strict=True))
            out.add({**summary(f"{label}_c{clients}", wall, latencies, new, firsts), "clients": clients,
                     "attention": implementation,
                     "same_tokens_as_warm_up": repeated, **verdicts,
                     **({"equal_to_sequential": all(same), "requests_equal": sum(same)} if reference else {}),
                     "steps": after.steps - before.steps, "joins": after.joins - before.joins,
                     "prefills": after.prefills - before.prefills,
                     "encoder_calls": after.encoder_calls - before.encoder_calls,
                     "encoder_forwards": after.encoder_forwards - before.encoder_forwards,
                     "programs": after.programs,
                     "scheduler_join_s": round(after.join_seconds - before.join_seconds, 4),
                     "scheduler_prefill_s": round(after.prefill_seconds - before.prefill_seconds, 4),
                     "scheduler_step_s": round(after.step_seconds - before.step_seconds, 4),
                     "scheduler_collect_s": round(after.collect_seconds - before.collect_seconds, 4)})  # fmt: skip
        if args.device_profile and model.device.type == "cuda":
            clients = int(args.clients.split(",")[0])
            out.add({**device_profile(engine, requests, clients, model.device), "label": label})


def device_profile(engine: cachelife.Engine, requests: list[Request], clients: int, device: torch.device) -> Request:
    """One more run of every request from `clients` client threads under torch.profiler (device activity and
    the CUDA runtime's calls, no host operators): per step of the run, its kernels as `bench.engine_step`
    figures them, the share of the run's wall time the device was busy, and the kernel time launched from
    CUDA graphs (the steps and row writes) apart from the kernels launched one by one (prefills, joins)."""
    before = engine.stats()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        wall, _, _, _ = with_engine(engine, requests, clients, device=device)
    steps = max(engine.stats().steps - before.steps, 1)
    events = list(profiler.profiler.kineto_results.events())
    graphed = {event.correlation_id() for event in events if event.name() == "cudaGraphLaunch"}
    kernels, from_graphs = [], 0.0
    for event in events:
        if event.device_type() == DeviceType.CUDA and event.duration_ns() > 0:
            start = event.start_ns()
            kernels.append((event.name(), start, start + event.duration_ns()))
            from_graphs += event.duration_ns() / 1e6 if event.correlation_id() in graphed else 0.0
    figures = kernel_figures(kernels, steps)
    busy_ms = figures["device_busy_ms_per_step"] * steps
    return {
        "path": f"engine_c{clients}_profiled", "wall_s": round(wall, 4), "steps": steps,
        "device_busy_share": round(busy_ms / (1000 * wall), 4),
        "graph_launches_seen": len(graphed),
        "kernel_ms_from_graphs": round(from_graphs, 2) if graphed else None,
        "kernel_ms": round(figures["kernel_ms_per_step"] * steps, 2), **figures,
    }  # fmt: skip


def judged(model: PreTrainedModel, requests: list[Request], outputs: list[torch.Tensor], count: int) -> Request:
    """The verdict against transformers on the first `count` greedy requests: for a decoder-only model
    bench.verdict's (tokens only: the engine returns no logits); for an encoder-decoder model in float32, whether
    its tokens equal `model.generate`'s (its processors, Whisper's token rules among them, suppress tokens, which
    the raw greedy verdict does not model); nothing otherwise."""
    if count == 0 or any(r.get("num_beams", 1) > 1 for r in requests):
        return {}
    if model.config.is_encoder_decoder:
        if model.dtype != torch.float32:
            return {}
        pairs = zip(requests[:count], outputs[:count], strict=True)
        same = [torch.equal(got, zoo.generate_tokens(model, request)) for request, got in pairs]
        return {"verdict_requests": len(same), "tokens_equal_transformers": all(same)}
    found = judge_requests(model, list(zip(requests[:count], outputs[:count], strict=True)))
    return {"verdict_requests": found.pop("requests"), **found}


def generate_batch_run(model: PreTrainedModel, requests: list[Request], longest: int, device: torch.device) -> Request:
    """transformers' continuous batching, every request given at once (each `longest` new tokens)."""
    ids = [request["input_ids"][0].tolist() for request in requests]
    config = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                              eos_token_id=model.generation_config.eos_token_id,
                              pad_token_id=model.generation_config.pad_token_id)  # fmt: skip
    generate_batch = cast("Callable[..., object]", model.generate_batch)
    generate_batch(inputs=ids[:4], generation_config=config)  # warm-up
    synchronize(device)
    started = time.perf_counter()
    generate_batch(inputs=ids, generation_config=config)
    synchronize(device)
    wall = time.perf_counter() - started
    longest_new = longest * len(requests)
    return {"path": "generate_batch", "wall_s": round(wall, 4), "new_tokens": longest_new,
            "tokens_per_s": round(longest_new / wall, 1),
            "note": f"every request {longest} new tokens (one generation config for the batch)"}  # fmt: skip


def file_stem(args: Any) -> str:
    """The results file's name before its device, date and version: the model and what sets this run apart."""
    stem = f"engine-{args.model}" + (f"-spc{args.steps_per_call}" if args.steps_per_call > 1 else "")
    stem += "-ttft" if args.ttft else ""
    stem += "-profiled" if args.device_profile else ""
    stem += f"-beams{args.num_beams}" if args.num_beams > 1 else ""
    stem += "-sampling" if any(path.startswith("engine_sampling") for path in args.paths.split(",")) else ""
    return stem + (f"-switch{1000 * args.switch_interval:g}ms" if args.switch_interval is not None else "")


def engine_parser() -> Any:
    """The benchmark's command line (see the module docstring)."""
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="whisper-large-v3", choices=sorted({*MODEL_NAMES, *zoo.MODEL_NAMES}))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new-tokens", default="16,64")
    parser.add_argument("--paths", default="engine,sequential")
    parser.add_argument(
        "--verdicts", type=int, default=8, help="requests judged against transformers (bench.verdict), decoder-only"
    )
    parser.add_argument("--steps-per-call", type=int, default=1, help="for the engine and sequential paths")
    parser.add_argument("--num-beams", type=int, default=1, help="beam search with this many beams per request")
    parser.add_argument(
        "--ttft", action="store_true", help="give every timed request a streamer and report time to first token"
    )
    parser.add_argument(
        "--profile-scheduler", default="", help="write cProfile statistics of the engine's scheduler thread here"
    )
    parser.add_argument(
        "--device-profile",
        action="store_true",
        help="after each engine's timed runs, one more at the first --clients value under torch.profiler",
    )
    parser.add_argument(
        "--switch-interval", type=float, default=None,
        help="sys.setswitchinterval(seconds) for the whole run: how long a thread holds Python's lock before "
        "another that waits for it may take it (the scheduler thread waits behind the requests' threads)",
    )  # fmt: skip
    return parser


def main() -> int:
    parser = engine_parser()
    args = parser.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    device = pick_device(args.device)
    dtype = getattr(torch, args.dtype)
    paths = args.paths.split(",")
    shortest, longest = (int(part) for part in args.new_tokens.split(","))
    model = (
        build_model(args.model, device, dtype)
        if args.model in MODEL_NAMES
        else zoo.build(args.model, device=device, dtype=dtype).model
    )
    if args.num_beams > 1 and (args.ttft or "generate_batch" in paths):
        parser.error("--num-beams: transformers streams no beam search and its generate_batch runs none")
    requests = requests_for(model, args.requests, (shortest, longest), beams=args.num_beams)
    new = sum(int(request["max_new_tokens"]) for request in requests)
    out = results_file(args.out, file_stem(args), device, "bench.engine", {
        "model": args.model, "dtype": args.dtype, "requests": args.requests, "rows": args.rows,
        "steps_per_call": args.steps_per_call, "num_beams": args.num_beams,
        "switch_interval_s": sys.getswitchinterval(),
        "new_tokens": [shortest, longest], "argv": sys.argv[1:], "results": [],
    })  # fmt: skip
    reference: list[torch.Tensor] | None = None
    # As the docs ask of every user: without it, each sequential call gets new cache addresses and captures a
    # new CUDA graph. The engine keeps caches of its own either way.
    cachelife.enable(model)
    if "sequential" in paths:

        def ours(request: Request) -> torch.Tensor:
            return as_tokens(cachelife.generate(model, fallback=False, steps_per_call=args.steps_per_call, **request))

        wall, latencies, reference, firsts = one_at_a_time(ours, requests, device, ttft=args.ttft)
        out.add({**summary("sequential", wall, latencies, new, firsts), "lone_ms": round(1000 * latencies[0], 2)})
    for index, path in enumerate(paths):  # in the order given; a path named again runs again, as `<path>_again`
        instrument = {"engine_eager_prefill": eager_prefills, "engine_cudnn": cudnn_attention_allowed,
                      "engine_one_prefill": one_prefill_each, "engine_encoders_alone": encoders_alone,
                      "engine_prefill_without_graphs": prefills_without_graphs,
                      "engine_read_lag_1": read_one_call_late, "engine_row_starts_eager": row_starts_eager,
                      "engine_unmasked_kernel": unmasked_by_kernel}  # fmt: skip
        if path in (*ATTENTIONS, *instrument):
            label = path if path not in paths[:index] else f"{path}_again"
            cachelife.release(model)  # each path compiles its own steps (cuDNN's attention, or not)
            with instrument.get(path, contextlib.nullcontext)():
                engine_runs(
                    out,
                    model,
                    requests,
                    args,
                    reference=reference,
                    new=new,
                    label=label,
                    attention=ATTENTIONS.get(path, "auto"),
                )
        if path in ("engine_sampling_one", "engine_sampling_mixed"):
            sampled = sampling_requests(requests, mixed=path.endswith("mixed"))
            engine_runs(out, model, sampled, args, reference=None, new=new, label=path, judge_tokens=False)
    if "auto" in paths:
        auto = auto_compile(device)

        def theirs(request: Request) -> torch.Tensor:
            return as_tokens(model.generate(**request, **auto))

        wall, latencies, _, firsts = one_at_a_time(theirs, requests, device, ttft=args.ttft)
        out.add(summary("auto", wall, latencies, new, firsts))
    if "generate_batch" in paths and not model.config.is_encoder_decoder:
        out.add(generate_batch_run(model, requests, longest, device))
    out.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
