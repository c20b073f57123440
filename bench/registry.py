"""Every benchmark the project runs, in one table: the GPU suite's stages and the CPU runs behind bench/results.

`python -m bench list` prints it, `python -m bench run NAME [extra arguments]` runs one entry
(`python -m MODULE ARGUMENTS... [extra arguments]`; argparse keeps the last value of an option given twice, so
extra arguments override the entry's), `python3 bench/gpu_suite.py --stages NAME,...` runs the CUDA entries as
stages, and `python -m bench readme` names the entry behind each results file. The docs build imports
`BENCHMARKS` too, which is why this module imports nothing but attrs.

An entry's `results` glob matches the names of the JSON files its runs left in bench/results (or
bench/results/gpu), as they were committed: a benchmark writes `<stem>-<device>-<date>-tf<version>.json` and
runs that share a script were renamed by hand when committed (a model, a tag, the GPU-suite run) so that they
keep apart.
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


def _levers(presets: str, *overrides: str) -> tuple[str, ...]:
    """`bench.levers` arguments: the whisper-large-v3 shape in bf16 at batch 1 unless `overrides` say otherwise
    (argparse keeps the last value of an option given twice)."""
    return ("--device", "cuda", "--model", "whisper-large-v3", "--dtypes", "bfloat16", "--presets", presets,
            *overrides)  # fmt: skip


_ENTRIES = (
    # -- CUDA: the GPU suite's benchmark stages (bench/gpu_suite.py), each writing to --out/<name> ---------------
    Benchmark(
        "decode-loop", "bench.decode_loop", ("--device", "cuda"),
        "cachelife.generate's decoding loop (steps_per_call 1 and 4) against model.generate with a compiled "
        "forward and against the step's GPU kernel time, t5-small shape, fp32 and bf16",
        "cuda", "decode-loop-cuda-*.json",
    ),
    Benchmark(
        "soak", "bench.soak", ("--device", "cuda", "--compile", "--calls", "100"),
        "100 generate calls, tiny T5, compiled forward with CUDA graphs: memory flat, tokens equal eager",
        "cuda", "soak-compiled-cuda-*.json",
    ),
    Benchmark(
        "decode", "bench.decode", ("--device", "cuda"),
        "transformers' decoding paths and cachelife's side by side (eager, auto-compile, compiled forward, "
        "transformers as released), t5, bart, whisper and llama small shapes",
        "cuda", "decode-cuda-*.json",
    ),
    Benchmark(
        "threads", "bench.threads",
        ("--device", "cuda", "--model", "llama-small", "--calls", "16", "--threads", "1,2,4"),
        "what a second thread costs: the same cachelife.generate calls on one model from 1, 2 and 4 threads "
        "(calls on one model wait for each other), cachelife's graphs, fp32",
        "cuda", "threads-llama-small-cuda-*.json",
    ),
    Benchmark(
        "buckets", "bench.buckets", ("--device", "cuda"),
        "encoder-length buckets: 20 compiled-forward generate calls over encoder lengths 33..64, with and "
        "without buckets, and the padding cost",
        "cuda", "buckets-cuda-*.json",
    ),
    Benchmark(
        "beams", "bench.beams", ("--device", "cuda", "--models", "t5-small,whisper-small,llama-small"),
        "beam search: eager, auto-compile and cachelife with a compiled forward (in-place reorders, "
        "cross-attention reordered), each path in a fresh compile-cache directory",
        "cuda", "beams-cuda-*.json",
    ),
    # Whisper's decoder prompt is 4 tokens, so 16 and 56 new tokens share cachelife's 64-column buffers.
    Benchmark(
        "generate-whisper", "bench.generate",
        ("--device", "cuda", "--models", "whisper-large-v3", "--batches", "1", "--dtype", "bfloat16", "--tokens",
         "16,56", "--steps-per-call", "1,4,8", "--paths", "auto,forward,cachelife", "--repeats", "3"),
        "cachelife.generate on the whisper-large-v3 shape with its generation config, greedy, bf16, batch 1: "
        "auto-compile, compiled forward, cachelife's graphs at 1, 4 and 8 steps per call and torch's trees at 1",
        "cuda", "generate-whisper-large-v3-*cuda*.json",
    ),
    Benchmark(
        "generate-whisper-b8", "bench.generate",
        ("--device", "cuda", "--models", "whisper-large-v3", "--batches", "8", "--dtype", "bfloat16", "--tokens",
         "16,56", "--steps-per-call", "1,4", "--paths", "auto,forward,cachelife", "--repeats", "2", "--tag", "b8"),
        "the generate-whisper comparison at batch 8, 1 and 4 steps per call",
        "cuda", "generate-whisper-large-v3-b8-*cuda*.json",
    ),
    Benchmark(
        "generate-whisper-beams", "bench.generate",
        ("--device", "cuda", "--models", "whisper-large-v3", "--batches", "1", "--dtype", "bfloat16", "--tokens",
         "16,48", "--beams", "5", "--steps-per-call", "1,4", "--paths", "forward,cachelife", "--repeats", "2",
         "--tag", "beams5"),
        "cachelife.generate on the whisper-large-v3 shape with 5 beams against the compiled forward, bf16, batch 1",
        "cuda", "generate-whisper-large-v3-beams5-*cuda*.json",
    ),
    Benchmark(
        "generate-bart", "bench.generate",
        ("--device", "cuda", "--models", "bart-large-cnn", "--batches", "1,8", "--dtype", "bfloat16", "--tokens",
         "16,48", "--steps-per-call", "1,4", "--repeats", "2", "--tag", "bart"),
        "cachelife.generate against transformers' paths on the bart-large-cnn shape with its generation config "
        "(4 beams, no-repeat 3, forced BOS/EOS), bf16, batches 1 and 8",
        "cuda", "generate-bart-large-cnn-*cuda*.json",
    ),
    Benchmark(
        "generate-t5", "bench.generate",
        ("--device", "cuda", "--models", "t5-base", "--batches", "1,8", "--dtype", "bfloat16", "--tokens", "16,48",
         "--steps-per-call", "1,4", "--repeats", "2", "--tag", "t5"),
        "cachelife.generate against transformers' paths on the t5-base shape, bf16, batches 1 and 8",
        "cuda", "generate-t5-base-*cuda*.json",
    ),
    Benchmark(
        "profile", "bench.profile_step",
        ("--device", "cuda", "--model", "whisper-large-v3", "--batch-sizes", "1,8"),
        "where one decoding step of cachelife.generate goes on the whisper-large-v3 shape (its generation "
        "config, bf16, batches 1 and 8): kernels grouped by kind against the bandwidth floor",
        "cuda", "profile-step-whisper-large-v3-cuda-*.json",
    ),
    # Each preset list runs its own baseline: correctness is judged against the baseline of the same run.
    Benchmark(
        "levers-a", "bench.levers", _levers("baseline,attention_math,attention_flash,freezing"),
        "inductor options and attention kernels on cachelife.generate's step, whisper-large-v3 shape, bf16, "
        "batch 1: attention_math, attention_flash and freezing against the baseline",
        "cuda", "levers-whisper-large-v3-b1-bfloat16-attention_math-*cuda*.json",
    ),
    Benchmark(
        "levers-b", "bench.levers", _levers("baseline,coordinate_descent,combo_kernels,max_autotune_gemm"),
        "the levers comparison with coordinate_descent, combo_kernels and max_autotune_gemm",
        "cuda", "levers-whisper-large-v3-b1-bfloat16-coordinate_descent-*cuda*.json",
    ),
    Benchmark(
        "levers-c", "bench.levers", _levers("baseline,together,attention_flex", "--logits"),
        "the levers comparison of what helped together (cachelife.FAST_KERNELS) and flex attention, with "
        "teacher-forced logit differences against the baseline",
        "cuda", "levers-whisper-large-v3-b1-bfloat16-together-attention_flex-*cuda*.json",
    ),
    Benchmark(
        "levers-t5-small", "bench.levers",
        _levers("baseline,combo_kernels,coordinate_descent,max_autotune_gemm,attention_flash,attention_flex,together",
                "--model", "t5-small"),
        "the levers comparison on the t5-small shape, bf16, batch 1, every preset but freezing and attention_math",
        "cuda", "levers-t5-small-b1-bfloat16-*cuda*.json",
    ),
    Benchmark(
        "levers-fp32", "bench.levers", _levers("baseline,together", "--dtypes", "float32"),
        "the baseline against cachelife.FAST_KERNELS on the whisper-large-v3 shape in float32, batch 1",
        "cuda", "levers-whisper-large-v3-b1-float32-together-*cuda*.json",
    ),
    Benchmark(
        "levers-b8", "bench.levers", _levers("baseline,together", "--batch-size", "8"),
        "the baseline against cachelife.FAST_KERNELS on the whisper-large-v3 shape in bf16 at batch 8",
        "cuda", "levers-whisper-large-v3-b8-bfloat16-together-*cuda*.json",
    ),
    # cachelife's own kernels (issue #22): fused projections, the decode attention kernel, both with FAST_KERNELS.
    Benchmark(
        "kernels-whisper", "bench.levers", _levers("baseline,fused,decode_attention,all", "--logits"),
        "cachelife's kernels on cachelife.generate's step, whisper-large-v3 shape, bf16, batch 1: fused "
        "projections, the decode attention kernel, and both with cachelife.FAST_KERNELS (all) against the "
        "baseline, with teacher-forced logit differences",
        "cuda", "levers-whisper-large-v3-b1-bfloat16-fused-decode_attention-all-*cuda*.json",
    ),
    Benchmark(
        "kernels-whisper-attention", "bench.levers", _levers("baseline,decode_attention,all", "--logits"),
        "the decode attention kernel alone and all of cachelife's kernels with cachelife.FAST_KERNELS against the "
        "baseline, whisper-large-v3 shape, bf16, batch 1 (kernels-whisper without its fused preset, to fit a "
        "machine's 10-minute command)",
        "cuda", "levers-whisper-large-v3-b1-bfloat16-decode_attention-all-*cuda*.json",
    ),
    Benchmark(
        "kernels-whisper-launches", "bench.levers", _levers("baseline,decode_attention,pdl,all"),
        "the decode attention kernel, inductor's programmatic dependent launch (pdl) and all of cachelife's kernels "
        "with cachelife.FAST_KERNELS against the baseline, whisper-large-v3 shape, bf16, batch 1, without the "
        "teacher-forced logits (a second compilation per preset), to fit a machine's 10-minute command",
        "cuda", "levers-whisper-large-v3-b1-bfloat16-decode_attention-pdl-all-*cuda*.json",
    ),
    Benchmark(
        "kernels-whisper-linear", "bench.levers",
        _levers("baseline,small_linear,fused,fused_small_linear", "--concurrent"),
        "cachelife's small-batch linear kernel in the step (Options(small_linear=True)), alone and with fused "
        "projections, against the baseline and fused projections alone, whisper-large-v3 shape, bf16, batch 1, "
        "the presets compiled at once",
        "cuda", "levers-whisper-large-v3-b1-bfloat16-small_linear-fused-fused_small_linear-*cuda*.json",
    ),
    Benchmark(
        "linear-kernel", "bench.linear", ("--device", "cuda", "--dtype", "bfloat16", "--rows", "1,8"),
        "cachelife's small-batch linear kernel against torch's product (cuBLAS), one product at a time in CUDA "
        "graphs, at the whisper-large-v3 and Llama-3.2-1B decoders' shapes, 1 and 8 rows, bf16",
        "cuda", "linear-bfloat16-cuda-*.json",
    ),
    Benchmark(
        "kernels-turbo", "bench.levers",
        _levers("baseline,fused,decode_attention,together,all", "--model", "whisper-large-v3-turbo", "--concurrent"),
        "the baseline against each of cachelife's kernels, cachelife.FAST_KERNELS and all of them together on the "
        "whisper-large-v3-turbo shape (4 decoder layers), bf16, batch 1, the presets compiled at once",
        "cuda", "levers-whisper-large-v3-turbo-b1-bfloat16-fused-decode_attention-together-all-*cuda*.json",
    ),
    Benchmark(
        "kernels-llama", "bench.levers",
        _levers("baseline,fused,decode_attention,together,all", "--model", "llama-3.2-1b", "--concurrent"),
        "the baseline against each of cachelife's kernels, cachelife.FAST_KERNELS and all of them together on the "
        "Llama-3.2-1B shape (a prompt of 16 tokens), bf16, batch 1, the presets compiled at once",
        "cuda", "levers-llama-3.2-1b-b1-bfloat16-fused-decode_attention-together-all-*cuda*.json",
    ),
    Benchmark(
        "kernels-whisper-b8", "bench.levers",
        _levers("baseline,fused,decode_attention,all", "--batch-size", "8", "--concurrent"),
        "the baseline against each of cachelife's kernels and all of them with cachelife.FAST_KERNELS on the "
        "whisper-large-v3 shape, bf16, batch 8, the presets compiled at once",
        "cuda", "levers-whisper-large-v3-b8-bfloat16-fused-decode_attention-all-*cuda*.json",
    ),
    Benchmark(
        "generate-t5-small", "bench.generate",
        ("--device", "cuda", "--models", "t5-small", "--batches", "1", "--dtype", "bfloat16", "--tokens", "16,48",
         "--steps-per-call", "1,4,8", "--paths", "forward,cachelife", "--cuda-graphs", "cachelife", "--repeats", "3",
         "--tag", "t5-small"),
        "cachelife.generate on the t5-small shape at 1, 4 and 8 steps per graph against the compiled forward, "
        "bf16, batch 1",
        "cuda", "generate-t5-small-*cuda*.json",
    ),
    Benchmark(
        "profile-b8", "bench.profile_step",
        ("--device", "cuda", "--model", "whisper-large-v3", "--batch-sizes", "8"),
        "the whisper-large-v3 step profile at batch 8 only",
        "cuda", "profile-step-whisper-large-v3-b8-*cuda*.json",
    ),
    Benchmark(
        "warm-start", "bench.warm_start",
        ("--device", "cuda", "--models", "t5-small", "--paths", "cachelife-generate", "--dtype", "bfloat16"),
        "warm starts of cachelife.generate on the t5-small shape (bf16, batch 4): the first call of a fresh "
        "process with an empty compile-cache directory, a shared one, and loaded artifacts",
        "cuda", "warm-start-t5-small-*cuda*.json",
    ),
    Benchmark(
        "warm-start-whisper", "bench.warm_start",
        ("--device", "cuda", "--models", "whisper-large-v3", "--paths", "cachelife-generate", "--dtype", "bfloat16"),
        "warm starts of cachelife.generate on the whisper-large-v3 shape (bf16, batch 4)",
        "cuda", "warm-start-whisper-large-v3-*cuda*.json",
    ),
    Benchmark(
        "warm-start-whisper-beams", "bench.warm_start",
        ("--device", "cuda", "--models", "whisper-large-v3", "--paths", "cachelife-generate,cachelife-generate-beams",
         "--dtype", "bfloat16", "--tag", "beams"),
        "warm starts and where the first call's compile time goes, greedy against 5 beams, cachelife.generate on "
        "the whisper-large-v3 shape (bf16, batch 4)",
        "cuda", "warm-start-beams-*cuda*.json",
    ),
    Benchmark(
        "warm-start-whisper-regions", "bench.warm_start",
        ("--device", "cuda", "--models", "whisper-large-v3", "--paths",
         "cachelife-generate,cachelife-generate-regions,cachelife-generate-beams-regions", "--dtype", "bfloat16",
         "--tag", "regions"),
        "warm starts of cachelife.generate on the whisper-large-v3 shape (bf16, batch 4) with and without "
        "Options(compile_regions=True) (each layer class compiled once), greedy, and 5 beams with regions",
        "cuda", "warm-start-regions-*cuda*.json",
    ),
    Benchmark(
        "kernels-whisper-regions", "bench.levers", _levers("baseline,regions,all,all_regions", "--concurrent"),
        "the step with Options(compile_regions=True) against the baseline, alone and with all of cachelife's kernels "
        "and cachelife.FAST_KERNELS, whisper-large-v3 shape, bf16, batch 1, the presets compiled at once",
        "cuda", "levers-whisper-large-v3-b1-bfloat16-regions-all-all_regions-*cuda*.json",
    ),
    Benchmark(
        "padded-llama", "bench.padded",
        ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--steps-per-call", "4",
         "--paths", "auto,cachelife"),
        "8 left-padded prompts (20-128 tokens) on the Llama-3.2-1B shape, bf16, greedy and 4 beams, 16 and 64 "
        "new tokens: model.generate auto-compiled against cachelife.generate at 4 steps per call",
        "cuda", "padded-llama-3.2-1b-*cuda*.json",
    ),
    Benchmark(
        "streaming", "bench.streaming", ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16"),
        "per-token streaming latency on the Llama-3.2-1B shape, bf16, batch 1, greedy, 64 new tokens: time to "
        "first token and inter-token p50/p99 of model.generate (eager, auto-compile) and cachelife.generate "
        "(stop_check_every 1 and 8), streamed tokens checked equal",
        "cuda", "streaming-llama-3.2-1b-*cuda*.json",
    ),
    Benchmark(
        "engine-whisper", "bench.engine",
        ("--device", "cuda", "--model", "whisper-large-v3", "--dtype", "bfloat16", "--clients", "1,4,16,64",
         "--requests", "64", "--rows", "16", "--new-tokens", "16,64", "--paths", "engine,sequential,auto"),
        "cachelife.Engine (16 rows) on the whisper-large-v3 shape, bf16, greedy: 64 requests of 16-64 new tokens "
        "from 1, 4, 16 and 64 client threads against sequential cachelife.generate and model.generate with "
        "auto-compile; throughput and latency p50/p99, tokens checked equal",
        "cuda", "engine-whisper-large-v3-cuda*.json",
    ),
    Benchmark(
        "engine-whisper-switch", "bench.engine",
        ("--device", "cuda", "--model", "whisper-large-v3", "--dtype", "bfloat16", "--clients", "16",
         "--requests", "64", "--rows", "16", "--new-tokens", "16,64", "--paths", "engine,sequential",
         "--switch-interval", "0.0005"),
        "the engine-whisper comparison (engine and enabled sequential, 16 clients) with Python's thread switch "
        "interval at 0.5 ms instead of 5: whether the scheduler thread's joins wait behind the requests' threads",
        "cuda", "engine-whisper-large-v3-switch*cuda*.json",
    ),
    Benchmark(
        "engine-whisper-beams", "bench.engine",
        ("--device", "cuda", "--model", "whisper-large-v3", "--dtype", "bfloat16", "--clients", "1,4,16",
         "--requests", "32", "--rows", "40", "--new-tokens", "16,64", "--num-beams", "5",
         "--paths", "engine,sequential"),
        "cachelife.Engine (40 rows: 8 groups of 5 beams) on the whisper-large-v3 shape, bf16, 5 beams: 32 requests "
        "of 16-64 new tokens from 1, 4 and 16 client threads against sequential cachelife.generate; throughput "
        "and latency p50/p99, tokens checked equal",
        "cuda", "engine-whisper-large-v3-beams5-*cuda*.json",
    ),
    Benchmark(
        "engine-whisper-ttft", "bench.engine",
        ("--device", "cuda", "--model", "whisper-large-v3", "--dtype", "bfloat16", "--clients", "1,16",
         "--requests", "64", "--rows", "16", "--new-tokens", "16,64", "--ttft"),
        "time to first token on the whisper-large-v3 shape, bf16: every request streamed, the engine (16 rows) "
        "from 1 and 16 clients against sequential cachelife.generate",
        "cuda", "engine-whisper-large-v3-ttft-*cuda*.json",
    ),
    Benchmark(
        "engine-whisper-spc4", "bench.engine",
        ("--device", "cuda", "--model", "whisper-large-v3", "--dtype", "bfloat16", "--clients", "4,16",
         "--requests", "64", "--rows", "16", "--new-tokens", "16,64", "--steps-per-call", "4"),
        "the engine-whisper comparison at 4 steps per graph replay (engine and sequential), 4 and 16 clients",
        "cuda", "engine-whisper-large-v3-spc4-*cuda*.json",
    ),
    Benchmark(
        "engine-llama", "bench.engine",
        ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--clients", "1,16,64",
         "--requests", "64", "--rows", "16", "--new-tokens", "16,64", "--paths", "engine,sequential,generate_batch"),
        "cachelife.Engine (16 rows) on the Llama-3.2-1B shape, bf16, greedy, prompts of 16-128 tokens: 64 "
        "requests from 1, 16 and 64 clients against sequential cachelife.generate and transformers' "
        "generate_batch",
        "cuda", "engine-llama-3.2-1b-*cuda*.json",
    ),
    Benchmark(
        "engine-llama-prefill", "bench.engine",
        ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--clients", "1,16",
         "--requests", "64", "--rows", "16", "--new-tokens", "16,64", "--paths", "engine,engine_eager_prefill"),
        "the engine-llama comparison of a decoder-only newcomer's compiled prefill against transformers' eager "
        "one (the engine before the compiled prefill), 1 and 16 clients, with sequential cachelife.generate",
        "cuda", "engine-llama-3.2-1b-cuda-*.json",
    ),
    Benchmark(
        "engine-step-llama", "bench.engine_step",
        ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--rows", "1,16", "--max-length", "512",
         "--prompt", "64", "--window", "0.3", "--attention", "model,decode"),
        "where a step of the engine goes on the Llama-3.2-1B shape, bf16, with every row decoding: wall ms per "
        "step, device kernels by kind and the device's idle time, for 1 and 16 rows, the rows on the model's "
        "SDPA and on cachelife's decode attention kernel (attention='decode')",
        "cuda", "engine-step-llama-3.2-1b-cuda-*.json",
    ),
    Benchmark(
        "engine-step-whisper", "bench.engine_step",
        ("--device", "cuda", "--model", "whisper-large-v3", "--dtype", "bfloat16", "--rows", "1,16",
         "--max-length", "448", "--window", "0.3", "--attention", "model,decode"),
        "the engine-step-llama profile on the whisper-large-v3 shape (every row decoding to Whisper's 448 "
        "positions over its own 1500 encoder frames), 1 and 16 rows, model's SDPA and the decode kernel",
        "cuda", "engine-step-whisper-large-v3-cuda-*.json",
    ),
    Benchmark(
        "engine-whisper-throughput", "bench.engine",
        ("--device", "cuda", "--model", "whisper-large-v3", "--dtype", "bfloat16", "--clients", "1,16",
         "--requests", "48", "--rows", "16", "--new-tokens", "96,96", "--paths", "engine,engine_model_attention",
         "--ttft"),
        "cachelife.Engine (16 rows) on the whisper-large-v3 shape, bf16, greedy: 48 requests of 96 new tokens "
        "from 1 and 16 clients (issue 33's shape), every request streamed (time to first token p50/p99 against "
        "a lone request's), the engine's default (the decode attention kernel in the rows) against the model's SDPA",
        "cuda", "engine-whisper-large-v3-ttft-*cuda*.json",
    ),
    Benchmark(
        "engine-step-llama-levers", "bench.engine_step",
        ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--rows", "16", "--max-length", "512",
         "--prompt", "64", "--window", "0.3",
         "--enable", "decode_attention/decode_attention,fuse_projections,small_linear"),
        "the engine-step-llama profile of the 16-row step with cachelife.enable's kernel levers: the decode "
        "attention kernel alone, and with fused projections and the few-row linear kernel",
        "cuda", "engine-step-llama-3.2-1b-cuda-*.json",
    ),
    Benchmark(
        "engine-llama-throughput", "bench.engine",
        ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--clients", "16,64",
         "--requests", "64", "--rows", "16", "--new-tokens", "128,128", "--paths", "engine,engine_model_attention",
         "--verdicts", "4"),
        "cachelife.Engine (16 rows) on the Llama-3.2-1B shape, bf16, greedy: 64 requests of 16-128 prompt tokens "
        "and 128 new tokens from 16 and 64 clients (issue 33's shape), the engine's default (cachelife's decode "
        "attention kernel in the rows) against the model's SDPA (attention='model'), with the scheduler's time "
        "split and the verdict against transformers",
        "cuda", "engine-llama-3.2-1b-cuda-*.json",
    ),
    Benchmark(
        "longform", "bench.longform",
        ("--device", "cuda", "--model", "whisper-large-v3", "--minutes", "5", "--new-tokens", "64",
         "--paths", "auto,cachelife"),
        "Whisper long-form transcription with timestamps, 5 minutes of audio features, whisper-large-v3 shape, "
        "bf16, at most 64 tokens per segment: transformers' auto-compiled long-form loop against "
        "cachelife.generate, wall seconds and real-time factor, tokens and segments compared (--paths "
        "eager,auto,forward,cachelife adds the eager loop and the compiled-forward reference)",
        "cuda", "longform-whisper-large-v3-cuda-*.json",
    ),
    Benchmark(
        "planted-bugs-cuda", "bench.planted_bugs",
        ("--device", "cuda", "--workers", "4", "--pytest-workers", "2", "--select", "not compiled_step_captures"),
        "the kernels' and the repeatability's GPU tests against copies of the source with one planted bug each "
        "(all but the fp32 compiled-step captures, which the GPU suite runs): every bug fails a test meant to "
        "catch it, the unchanged copy none",
        "cuda", "planted-bugs-cuda-*.json",
    ),
    # Attention that repeats exactly (cachelife.generation.repeatable): its cost against cuDNN's attention, with
    # transformers' auto-compile beside it and each figure's verdict against transformers (bench.verdict).
    Benchmark(
        "repeatable-whisper", "bench.generate",
        ("--device", "cuda", "--models", "whisper-large-v3", "--batches", "1", "--dtype", "bfloat16", "--tokens",
         "16,56", "--steps-per-call", "1", "--paths", "auto,cachelife,cachelife_cudnn", "--cuda-graphs", "cachelife",
         "--repeats", "3", "--tag", "repeatable-whisper"),
        "cachelife.generate with repeatable attention (the default) against its steps allowed cuDNN's attention and "
        "transformers' auto-compile, whisper-large-v3 shape with its generation config, greedy, bf16, batch 1",
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
        "repeatable-engine-llama", "bench.engine",
        ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--clients", "16", "--requests", "64",
         "--rows", "16", "--new-tokens", "64,128", "--paths", "engine,engine_cudnn"),
        "cachelife.Engine (16 rows, 16 clients) with repeatable attention against cuDNN's, Llama-3.2-1B shape, bf16, "
        "64 requests of 16-128 prompt and 64-128 new tokens: throughput, identical tokens on repeated submissions, "
        "and the verdict against transformers",
        "cuda", "engine-llama-3.2-1b-cuda-*.json",
    ),
    Benchmark(
        "engine-sampling-llama", "bench.engine",
        ("--device", "cuda", "--model", "llama-3.2-1b", "--dtype", "bfloat16", "--clients", "16", "--requests", "64",
         "--rows", "16", "--new-tokens", "64,128", "--paths", "engine,engine_sampling_one,engine_sampling_mixed",
         "--verdicts", "4"),
        "cachelife.Engine (16 rows, 16 clients), Llama-3.2-1B shape, bf16, 64 requests of 16-128 prompt and 64-128 "
        "new tokens: greedy (with the verdict against transformers), every request sampling with one setting, and "
        "with 16 settings spread over the requests (the per-row pipeline: one program for every mix)",
        "cuda", "engine-llama-3.2-1b-sampling-cuda-*.json",
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
    # -- CPU: the runs behind the CPU files in bench/results --------------------------------------------------
    Benchmark(
        "planted-bugs-cpu", "bench.planted_bugs", ("--device", "cpu"),
        "the kernel tests in Triton's interpreter against copies of the source with one planted bug each (what "
        "`nox -s planted` runs; CI runs it with --quick)",
        "cpu", "planted-bugs-cpu-*.json",
    ),
    Benchmark(
        "engine-beams-cpu", "bench.engine",
        ("--device", "cpu", "--model", "llama-small", "--dtype", "float32", "--clients", "1,4", "--requests", "8",
         "--rows", "6", "--new-tokens", "4,12", "--num-beams", "3", "--paths", "engine,sequential"),
        "cachelife.Engine with 3-beam requests (6 rows: 2 groups) on the CPU, llama-small, fp32, 8 requests from "
        "1 and 4 clients against sequential cachelife.generate, tokens checked equal",
        "cpu", "engine-llama-small-beams3-cpu-*.json",
    ),
    Benchmark(
        "decode-cpu", "bench.decode", ("--device", "cpu", "--models", "t5-small,llama-small"),
        "the decode harness on the CPU, t5-small and llama-small shapes",
        "cpu", "decode-cpu-*.json",
    ),
    Benchmark(
        "decode-loop-cpu", "bench.decode_loop",
        ("--device", "cpu", "--model", "t5-small", "--dtypes", "float32", "--steps-per-call", "1,4"),
        "the decode-loop benchmark on the CPU, t5-small shape, fp32, steps_per_call 1 and 4",
        "cpu", "decode-loop-cpu-*.json",
    ),
    Benchmark(
        "soak-cpu", "bench.soak", ("--device", "cpu", "--calls", "200"),
        "200 generate calls, tiny T5, eager forward, on the CPU (what `nox -s soak` runs)",
        "cpu", "soak-cpu-*.json",
    ),
    Benchmark(
        "threads-cpu", "bench.threads",
        ("--device", "cpu", "--model", "llama-small", "--calls", "12", "--threads", "1,2,4"),
        "what a second thread costs on the CPU: 12 cachelife.generate calls on one model (compiled step) from 1, 2 "
        "and 4 threads, tokens checked equal to the same call alone",
        "cpu", "threads-llama-small-cpu-*.json",
    ),
    Benchmark(
        "soak-compiled-cpu", "bench.soak", ("--device", "cpu", "--calls", "200", "--compile"),
        "200 generate calls, tiny T5, compiled forward, on the CPU",
        "cpu", "soak-compiled-cpu-*.json",
    ),
    Benchmark(
        "buckets-cpu", "bench.buckets", ("--device", "cpu", "--calls", "6", "--new-tokens", "24"),
        "encoder-length buckets on the CPU, t5-small shape, 6 calls of 24 new tokens",
        "cpu", "buckets-cpu-*.json",
    ),
    Benchmark(
        "warm-start-cpu", "bench.warm_start",
        ("--device", "cpu", "--models", "t5", "--paths", "generate,cachelife-generate", "--new-tokens", "8"),
        "warm starts on the CPU, tiny T5 with its generation config: model.generate with a compiled forward "
        "and cachelife.generate (the committed file's second path was cachelife.decode, since retired here)",
        "cpu", "warm-start-cpu-*.json",
    ),
    Benchmark(
        "warm-start-beams-cpu", "bench.warm_start",
        ("--device", "cpu", "--models", "t5", "--paths", "cachelife-generate,cachelife-generate-beams",
         "--new-tokens", "8", "--tag", "beams"),
        "warm starts and where the first call's compile time goes, greedy against 5 beams, cachelife.generate "
        "on the CPU, tiny T5 with its generation config",
        "cpu", "warm-start-beams-cpu-*.json",
    ),
    Benchmark(
        "warm-start-regions-cpu", "bench.warm_start",
        ("--device", "cpu", "--models", "t5-base", "--paths", "cachelife-generate,cachelife-generate-regions",
         "--new-tokens", "8", "--tag", "regions"),
        "warm starts of cachelife.generate on the CPU with and without Options(compile_regions=True), t5-base "
        "shape (12+12 layers) with its generation config",
        "cpu", "warm-start-regions-cpu-*.json",
    ),
    Benchmark(
        "warm-start-cachelife-generate-cpu", "bench.warm_start",
        ("--device", "cpu", "--models", "t5", "--paths", "cachelife-generate", "--new-tokens", "8"),
        "warm starts of cachelife.generate alone on the CPU, tiny T5 with its generation config",
        "cpu", "warm-start-cachelife-generate-cpu-*.json",
    ),
    Benchmark(
        "longform-cpu", "bench.longform",
        ("--device", "cpu", "--tiny", "--dtype", "float32", "--minutes", "1", "--new-tokens", "16"),
        "the long-form comparison on the CPU with the zoo's tiny Whisper (two of its windows), fp32",
        "cpu", "longform-tiny-cpu-*.json",
    ),
    Benchmark(
        "padded-llama-cpu", "bench.padded",
        ("--device", "cpu", "--model", "tiny", "--dtype", "float32", "--repeats", "5"),
        "the padded-llama comparison on the CPU with the same family at toy sizes (2 layers, hidden 64), fp32",
        "cpu", "padded-tiny-*cpu*.json",
    ),
    Benchmark(
        "kernels-cpu", "bench.levers",
        ("--device", "cpu", "--model", "whisper", "--dtypes", "float32", "--presets",
         "baseline,fused,decode_attention,fused_decode_attention", "--tokens", "24", "--short", "8", "--long", "24",
         "--eager-step"),
        "a quick check of the kernels comparison on the CPU with the zoo's tiny Whisper, fp32, batch 1, the step "
        "uncompiled (so `all` would be fused_decode_attention): fused projections and the attention kernel (its "
        "torch fallback), alone and together, tokens checked equal to the baseline's",
        "cpu", "levers-whisper-b1-float32-fused-*-eager-step-cpu*.json",
    ),
    Benchmark(
        "streaming-cpu", "bench.streaming",
        ("--device", "cpu", "--model", "llama-small", "--dtype", "float32", "--repeats", "10"),
        "per-token streaming latency on the CPU, llama-small shape, fp32, batch 1, greedy, 64 new tokens",
        "cpu", "streaming-llama-small-*cpu*.json",
    ),
    Benchmark(
        "engine-prefill-cpu", "bench.engine",
        ("--device", "cpu", "--model", "llama-small", "--dtype", "float32", "--clients", "1,4", "--requests", "32",
         "--rows", "4", "--new-tokens", "4,12", "--paths", "engine,engine_eager_prefill,engine"),
        "cachelife.Engine on the CPU, llama-small, fp32: a newcomer's compiled prefill against transformers' eager "
        "one (and the compiled one again, for the machine's drift), 32 requests from 1 and 4 clients, tokens "
        "checked equal to sequential cachelife.generate",
        "cpu", "engine-llama-small-cpu-*.json",
    ),
    Benchmark(
        "engine-cpu", "bench.engine",
        ("--device", "cpu", "--model", "llama-small", "--dtype", "float32", "--clients", "1,4", "--requests", "8",
         "--rows", "4", "--new-tokens", "4,12", "--ttft"),
        "cachelife.Engine on the CPU, llama-small, fp32, greedy: 8 requests from 1 and 4 clients against "
        "sequential cachelife.generate, tokens checked equal, every request streamed (time to first token)",
        "cpu", "engine-llama-small-*cpu-*.json",
    ),
    Benchmark(
        "serving-load-cpu", "bench.serving_load",
        ("--device", "cpu", "--model", "tiny", "--dtype", "float32", "--target", "engine", "--concurrency", "1,4",
         "--rate", "50", "--requests", "128", "--rows", "4", "--queue-size", "16", "--prompt-tokens", "8,32",
         "--new-tokens", "4,16", "--bad-share", "0.1"),
        "serving load on cachelife.Engine (4 rows) in-process on the CPU, the padded-llama family at toy sizes, "
        "fp32, greedy: 128 requests, a tenth of them invalid, from 1 and 4 clients in a closed loop and at 50 "
        "requests a second (Poisson arrivals); latency spreads, throughput, bad requests refused, server errors",
        "cpu", "serving-load-tiny-engine-cpu-*.json",
    ),
)  # fmt: skip

BENCHMARKS: dict[str, Benchmark] = {entry.name: entry for entry in _ENTRIES}
