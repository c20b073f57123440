"""Every benchmark the project runs, in one table: the GPU suite's stages and the CPU runs behind bench/results.

`python -m bench list` prints it, `python -m bench run NAME [extra arguments]` runs one entry
(`python -m MODULE ARGUMENTS... [extra arguments]`; argparse keeps the last value of an option given twice, so
extra arguments override the entry's), `python3 bench/gpu_suite.py --stages NAME,...` runs the CUDA entries as
stages, and `python -m bench readme` names the entry behind each results file. The docs build imports
`BENCHMARKS` too (the performance page shows each entry's newest file), which is why this module imports
nothing but attrs.

A file belongs to the entry whose command it recorded; `results` is the glob its name matches, for a file that
recorded none (bench/results_file.py writes `<stem>-<device>-<date>-tf<version>.json`).
"""

from __future__ import annotations

from attrs import field, frozen
from attrs.validators import in_


@frozen
class Benchmark:
    """One benchmark command: `python -m <module> <arguments...>` on `device` ("cpu" or "cuda")."""

    name: str
    module: str
    arguments: tuple[str, ...]
    description: str
    device: str = field(validator=in_(("cpu", "cuda")))
    results: str

    @property
    def command(self) -> tuple[str, ...]:
        """The arguments after `python`."""
        return ("-m", self.module, *self.arguments)


# The CPU serving load, in-process or over HTTP: a Llama of toy sizes, 4 rows, 128 requests, a tenth invalid.
_TINY_LOAD = ("--device", "cpu", "--model", "tiny", "--dtype", "float32", "--concurrency", "1,4", "--rate", "50",
              "--requests", "128", "--rows", "4", "--queue-size", "16", "--prompt-tokens", "8,32", "--new-tokens",
              "4,16", "--bad-share", "0.1")  # fmt: skip

ALL_LEVERS = (
    "exact,fuse_projections,decode_attention,small_linear,fused_layers,layers_projections,fast_kernels,"
    "unmasked_kernel,fast,all"
)
"""bench.generate's `--levers`, every one."""

# The engine-step profiles' shapes: 1 and 16 rows, every row decoding (see bench.engine_step).
LLAMA_STEP = ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--rows", "1,16",
              "--max-length", "512", "--prompt", "64", "--window", "0.3")  # fmt: skip
# The engine's Llama throughput runs: 16 rows, 64 requests of 16-128 prompt tokens and 128 new tokens, from 16
# and 64 clients (see bench.engine).
LLAMA_ENGINE = ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--clients", "16,64",
                "--requests", "64", "--rows", "16", "--new-tokens", "128,128")  # fmt: skip
WHISPER_STEP = ("--device", "cuda", "--model", "whisper-large-v3", "--dtype", "bfloat16", "--rows", "1,16",
                "--max-length", "448", "--window", "0.3")  # fmt: skip

_ENTRIES = (
    # -- CUDA: the GPU suite's benchmark stages (bench/gpu_suite.py), each writing to --out/<name> ---------------
    # One decoding step of cachelife.generate against transformers' auto-compile, each figure with its verdict
    # against transformers (bench.verdict), and the cost of attention that repeats exactly against cuDNN's.
    # Whisper's decoder prompt is 4 tokens, so 16 and 56 new tokens share cachelife's 64-column buffers.
    Benchmark(
        "repeatable-whisper", "bench.generate",
        ("--device", "cuda", "--models", "whisper-large-v3", "--batches", "1", "--dtype", "bfloat16", "--tokens",
         "16,56", "--steps-per-call", "1", "--paths", "auto,cachelife,cachelife_cudnn", "--cuda-graphs", "cachelife",
         "--repeats", "3", "--tag", "repeatable-whisper"),
        "one decoding step of cachelife.generate (repeatable attention, the default) against the same step allowed "
        "cuDNN's attention and against transformers' auto-compile, whisper-large-v3 shape with its generation "
        "config, greedy, bf16, batch 1",
        "cuda", "generate-repeatable-whisper-*cuda*.json",
    ),
    Benchmark(
        "repeatable-llama", "bench.generate",
        ("--device", "cuda", "--models", "llama-3.2-1b", "--batches", "1", "--input-length", "128", "--dtype",
         "bfloat16", "--tokens", "16,64", "--steps-per-call", "1", "--paths", "auto,cachelife,cachelife_cudnn",
         "--cuda-graphs", "cachelife", "--repeats", "3", "--tag", "repeatable-llama"),
        "the repeatable-whisper comparison on the Llama-3.2-1B shape, one prompt of 128 tokens",
        "cuda", "generate-repeatable-llama-*cuda*.json",
    ),
    Benchmark(
        "levers-whisper", "bench.generate",
        ("--device", "cuda", "--models", "whisper-large-v3", "--batches", "1", "--dtype", "bfloat16", "--tokens",
         "16,64", "--steps-per-call", "1", "--paths", "forward,cachelife", "--cuda-graphs", "cachelife", "--levers",
         ALL_LEVERS, "--repeats", "3", "--tag", "levers-whisper"),
        "each of cachelife.enable's levers alone, fused layers with fused projections, FAST, and FAST with the "
        "few-row linear kernel on the whisper-large-v3 shape, bf16, greedy, one call: wall ms per step beside the "
        "kernels' time, the device's busy time and the span from first kernel to last, against the default and "
        "transformers' compiled forward (the bf16 reference), with the verdict against transformers",
        "cuda", "generate-levers-whisper-*cuda*.json",
    ),
    Benchmark(
        "levers-whisper-unmasked", "bench.generate",
        ("--device", "cuda", "--models", "whisper-large-v3", "--batches", "1", "--dtype", "bfloat16", "--tokens",
         "16,64", "--steps-per-call", "1", "--paths", "forward,cachelife", "--cuda-graphs", "cachelife", "--levers",
         "decode_attention,unmasked_kernel", "--repeats", "3", "--tag", "levers-whisper-unmasked"),
        "the decode attention kernel for masked calls alone, and with cross-attention (calls without a mask) through "
        "its matrix products too, on the whisper-large-v3 shape, bf16, greedy, one call: wall ms per step, tokens "
        "against transformers' compiled forward and the verdict against transformers (the products change rounding: "
        "a default only if both hold)",
        "cuda", "generate-levers-whisper-unmasked-*cuda*.json",
    ),
    Benchmark(
        "levers-llama", "bench.generate",
        ("--device", "cuda", "--models", "llama-3.2-1b", "--batches", "1", "--input-length", "128", "--dtype",
         "bfloat16", "--tokens", "16,64", "--steps-per-call", "1", "--paths", "forward,cachelife", "--cuda-graphs",
         "cachelife", "--levers", ALL_LEVERS, "--repeats", "3", "--tag", "levers-llama"),
        "the levers-whisper comparison on the Llama-3.2-1B shape, one prompt of 128 tokens",
        "cuda", "generate-levers-llama-*cuda*.json",
    ),
    Benchmark(
        "warm-start-whisper", "bench.warm_start",
        ("--device", "cuda", "--models", "whisper-large-v3", "--paths", "cachelife-generate,cachelife-generate-regions",
         "--dtype", "bfloat16", "--batch", "1", "--new-tokens", "32", "--tag", "whisper"),
        "first calls of cachelife.generate on the whisper-large-v3 shape (bf16, batch 1, greedy) in fresh "
        "processes: an empty compile-cache directory, a shared one, and an empty one with loaded artifacts; "
        "with and without Options(compile_regions=True)",
        "cuda", "warm-start-whisper-*cuda*.json",
    ),
    Benchmark(
        "engine-llama-throughput", "bench.engine",
        (*LLAMA_ENGINE, "--paths", "sequential,engine,engine_model_attention", "--verdicts", "4"),
        "cachelife.Engine (16 rows) on the Llama-3.2-1B shape, bf16, greedy: 64 requests of 16-128 prompt tokens "
        "and 128 new tokens from 16 and 64 clients, the engine's default (cachelife's decode attention kernel in "
        "the rows) against the model's SDPA (attention='model'), with the scheduler's time split and the verdict "
        "against transformers",
        "cuda", "engine-llama-3.2-1b-cuda-*.json",
    ),
    Benchmark(
        "engine-whisper-throughput", "bench.engine",
        ("--device", "cuda", "--model", "whisper-large-v3", "--dtype", "bfloat16", "--clients", "1,16",
         "--requests", "48", "--rows", "16", "--new-tokens", "96,96", "--paths",
         "sequential,engine,engine_encoders_alone,engine_model_attention", "--ttft"),
        "cachelife.Engine (16 rows) on the whisper-large-v3 shape, bf16, greedy: 48 requests of 96 new tokens "
        "from 1 and 16 clients, every request streamed (time to first token p50/p99 against a lone request's), "
        "the engine's default (the decode attention kernel in the rows, newcomers' encoders run together) against "
        "each newcomer's encoder alone and against the model's SDPA",
        "cuda", "engine-whisper-large-v3-ttft-*cuda*.json",
    ),
    Benchmark(
        "engine-llama-prefill-lag", "bench.engine",
        (*LLAMA_ENGINE, "--paths", "engine_prefill_without_graphs,engine_read_lag_1,engine", "--verdicts", "4",
         "--device-profile"),
        "cachelife.Engine (16 rows) on the Llama-3.2-1B shape, bf16, greedy, 64 requests of 16-128 prompt tokens and "
        "128 new tokens from 16 and 64 clients: the default (prefills replayed from graphs of prompt buckets, the "
        "rows read two calls late) against prefills compiled at their own length without graphs and against rows "
        "read one call late; each engine once more under the profiler (the device's busy share, kernels per step)",
        "cuda", "engine-llama-3.2-1b-profiled-cuda-*.json",
    ),
    Benchmark(
        "engine-llama-row-starts", "bench.engine",
        (*LLAMA_ENGINE, "--paths", "engine_row_starts_eager,engine", "--verdicts", "4"),
        "cachelife.Engine (16 rows) on the Llama-3.2-1B shape, bf16, greedy, 64 requests of 16-128 prompt tokens and "
        "128 new tokens from 16 and 64 clients: each newcomer's row start (rows, settings, first token) replayed "
        "from one graph (the default) against its operations launched one by one",
        "cuda", "engine-llama-3.2-1b-cuda-*.json",
    ),
    Benchmark(
        "engine-whisper-unmasked-kernel", "bench.engine",
        ("--device", "cuda", "--model", "whisper-large-v3", "--dtype", "bfloat16", "--clients", "16",
         "--requests", "48", "--rows", "16", "--new-tokens", "96,96", "--paths", "engine,engine_unmasked_kernel",
         "--device-profile"),
        "cachelife.Engine (16 rows, 16 clients) on the whisper-large-v3 shape, bf16, greedy, 48 requests of 96 new "
        "tokens: cross-attention through SDPA (the default) against the decode attention kernel's matrix products "
        "(each engine once more under the profiler: kernel time per step)",
        "cuda", "engine-whisper-large-v3-profiled-cuda-*.json",
    ),
    Benchmark(
        "engine-sampling-llama", "bench.engine",
        ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--clients", "16", "--requests", "64",
         "--rows", "16", "--new-tokens", "64,128", "--paths",
         "sequential,engine,engine_sampling_one,engine_sampling_mixed", "--verdicts", "4"),
        "cachelife.Engine (16 rows, 16 clients), Llama-3.2-1B shape, bf16, 64 requests of 16-128 prompt and 64-128 "
        "new tokens: greedy (with the verdict against transformers), every request sampling with one setting, and "
        "with 16 settings spread over the requests (one program for every mix)",
        "cuda", "engine-llama-3.2-1b-sampling-cuda-*.json",
    ),
    Benchmark(
        "repeatable-engine-llama", "bench.engine",
        ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--clients", "16", "--requests", "64",
         "--rows", "16", "--new-tokens", "64,128", "--paths", "sequential,engine,engine_cudnn"),
        "cachelife.Engine (16 rows, 16 clients) with repeatable attention against cuDNN's, Llama-3.2-1B shape, bf16, "
        "64 requests of 16-128 prompt and 64-128 new tokens: throughput, identical tokens on repeated submissions, "
        "and the verdict against transformers",
        "cuda", "engine-llama-3.2-1b-cuda-*.json",
    ),
    Benchmark(
        "engine-step-llama", "bench.engine_step",
        (*LLAMA_STEP, "--attention", "model,decode"),
        "where a step of the engine goes on the Llama-3.2-1B shape, bf16, with every row decoding: wall ms per "
        "step, device kernels by kind and the device's idle time, for 1 and 16 rows, the rows on the model's "
        "SDPA and on cachelife's decode attention kernel (attention='decode')",
        "cuda", "engine-step-llama-3.2-1b-cuda-*.json",
    ),
    Benchmark(
        "engine-step-whisper", "bench.engine_step",
        (*WHISPER_STEP, "--attention", "model,decode"),
        "the engine-step-llama profile on the whisper-large-v3 shape (every row decoding to Whisper's 448 "
        "positions over its own 1500 encoder frames), 1 and 16 rows, model's SDPA and the decode kernel",
        "cuda", "engine-step-whisper-large-v3-cuda-*.json",
    ),
    Benchmark(
        "engine-step-llama-default", "bench.engine_step",
        (*LLAMA_STEP, "--enable", "none/fuse_projections"),
        "the engine-step-llama profile, 1 and 16 rows, the default attention: the model not enabled (no levers) "
        "and enabled with fused projections alone (enable's default)",
        "cuda", "engine-step-llama-3.2-1b-cuda-*-default-*.json",
    ),
    Benchmark(
        "engine-step-whisper-default", "bench.engine_step",
        (*WHISPER_STEP, "--enable", "none/fuse_projections"),
        "the engine-step-llama-default comparison on the whisper-large-v3 shape (448 positions, 1500 encoder frames "
        "per row)",
        "cuda", "engine-step-whisper-large-v3-cuda-*-default-*.json",
    ),
    Benchmark(
        "engine-step-llama-levers", "bench.engine_step",
        ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--rows", "16", "--max-length", "512",
         "--prompt", "64", "--window", "0.3",
         "--enable", "decode_attention/decode_attention,fuse_projections,small_linear"),
        "the engine-step-llama profile of the 16-row step with cachelife.enable's kernel options: the decode "
        "attention kernel alone, and with fused projections and the few-row linear kernel",
        "cuda", "engine-step-llama-3.2-1b-cuda-*-levers-*.json",
    ),
    Benchmark(
        "serving-load-llama", "bench.serving_load",
        ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--target", "engine",
         "--concurrency", "16,64", "--requests", "256", "--rows", "16", "--queue-size", "64", "--prompt-tokens",
         "16,128", "--new-tokens", "16,64", "--bad-share", "0.1"),
        "serving load on cachelife.Engine (16 rows) in-process, Llama-3.2-1B shape, bf16, greedy: 256 requests of "
        "16-128 prompt and 16-64 new tokens, a tenth of them invalid, from 16 and 64 clients in a closed loop; "
        "TTFT, TPOT, inter-token and end-to-end latency p50/p99, tokens and requests per second, bad requests "
        "refused, server errors",
        "cuda", "serving-load-llama-3.2-1b-engine-cuda-*.json",
    ),
    Benchmark(
        "decode-attention", "bench.decode_attention", ("--device", "cuda", "--dtype", "bfloat16"),
        "cachelife's decode attention kernel against SDPA, one call at the engine's shapes (whisper-large-v3's "
        "cross- and self-attention, the Llama-3.2-1B shape's grouped-query attention; 1 and 16 rows), bf16, "
        "device time per call in CUDA graphs: the op's own plan and a sweep of splits, tile lengths and warps, "
        "each within SDPA's distance from the float32 reference",
        "cuda", "decode-attention-cuda-*.json",
    ),
    Benchmark(
        "layer-linear", "bench.layer_linear",
        ("--device", "cuda", "--dtype", "bfloat16", "--rows", "1,4,8,16", "--dot-plans",
         "16x256,32x64,32x128,64x64,64x128"),
        "cachelife's fused layer product (norm, product, activation, residual in one kernel) against the same "
        "operations compiled by inductor, at whisper-large-v3's and the Llama-3.2-1B shape's decoder products, "
        "1 to 16 rows, bf16, device time per call in CUDA graphs, each within its distance from float64; at 16 "
        "rows also the plan without tensor cores and five other tensor-core tiles",
        "cuda", "layer-linear-cuda-*.json",
    ),
    Benchmark(
        "planted-bugs-cuda", "bench.planted_bugs",
        ("--device", "cuda", "--workers", "4", "--pytest-workers", "2", "--select", "not compiled_step_captures"),
        "the kernels' and the repeatability's GPU tests against copies of the source with one planted bug each "
        "(all but the fp32 compiled-step captures, which the GPU suite runs): every bug fails a test meant to "
        "catch it, the unchanged copy none",
        "cuda", "planted-bugs-cuda-*.json",
    ),
    # -- CPU: the runs behind the CPU files in bench/results --------------------------------------------------
    Benchmark(
        "planted-bugs-cpu", "bench.planted_bugs", ("--device", "cpu"),
        "the kernel tests in Triton's interpreter against copies of the source with one planted bug each (what "
        "`nox -s planted` runs; CI runs it with --quick)",
        "cpu", "planted-bugs-cpu-*.json",
    ),
    Benchmark(
        "serving-load-cpu", "bench.serving_load", ("--target", "engine", *_TINY_LOAD),
        "serving load on cachelife.Engine (4 rows) in-process on the CPU, a Llama of toy sizes, fp32, greedy: "
        "128 requests, a tenth of them invalid, from 1 and 4 clients in a closed loop and at 50 requests a second "
        "(Poisson arrivals); latency spreads, throughput, bad requests refused, server errors",
        "cpu", "serving-load-tiny-engine-cpu-*.json",
    ),
    Benchmark(
        "serving-load-http-cpu", "bench.serving_load", ("--target", "http", *_TINY_LOAD),
        "the serving-load-cpu load over HTTP: the same engine in cachelife's Ray Serve app on a local Ray (a free "
        "port), every request a streamed POST /v1/completions, a tenth of them invalid in the HTTP ways (bad "
        "fields, malformed JSON); needs the serve extra",
        "cpu", "serving-load-tiny-http-cpu-*.json",
    ),
    Benchmark(
        "engine-encoders-cpu", "bench.engine",
        ("--device", "cpu", "--model", "whisper-small", "--dtype", "float32", "--clients", "8", "--requests", "32",
         "--rows", "8", "--new-tokens", "8,16", "--ttft", "--paths",
         "sequential,engine_encoders_alone,engine,engine_encoders_alone,engine"),
        "cachelife.Engine (8 rows, 8 clients) on a small Whisper on the CPU, float32: newcomers' encoders run "
        "together (the default) against each alone, twice each in turn; throughput, time to first token, the "
        "encoder forwards, and every request's tokens against cachelife.generate's",
        "cpu", "engine-whisper-small-ttft-cpu-*.json",
    ),
    Benchmark(
        "warm-start-cpu", "bench.warm_start",
        ("--device", "cpu", "--models", "t5", "--paths", "cachelife-generate", "--new-tokens", "8", "--batch", "1"),
        "the warm-start-whisper first calls on the CPU, tiny T5 with its generation config",
        "cpu", "warm-start-cpu-*.json",
    ),
    Benchmark(
        "warm-start-whisper-cpu", "bench.warm_start",
        ("--device", "cpu", "--models", "whisper-large-v3", "--paths", "cachelife-generate", "--dtype", "float32",
         "--new-tokens", "8", "--batch", "1", "--tag", "whisper-large-v3-cpu"),
        "the warm-start-whisper first calls on the CPU, the whisper-large-v3 shape in float32 (32 decoder layers: "
        "where the compiler's time per phase shows), greedy, batch 1",
        "cpu", "warm-start-whisper-large-v3-cpu-*.json",
    ),
    Benchmark(
        "soak-cpu", "bench.soak", ("--device", "cpu", "--calls", "200"),
        "200 generate calls, tiny T5, eager forward, on the CPU: memory flat, tokens equal eager (what "
        "`nox -s soak` runs)",
        "cpu", "soak-cpu-*.json",
    ),
)  # fmt: skip

BENCHMARKS: dict[str, Benchmark] = {entry.name: entry for entry in _ENTRIES}
