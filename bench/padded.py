"""Left-padded prompts on a Llama-3.2-1B-shaped model: `cachelife.generate` against transformers' auto-compile.

    python -m bench.padded [--device auto] [--model llama-3.2-1b|tiny|llama|llama-small] [--dtype bfloat16]
                           [--batch 8] [--prompt-lengths 20,128] [--new-tokens 16,64] [--beams 1,4]
                           [--steps-per-call 1,4] [--paths eager,auto,cachelife] [--repeats 3] [--out DIR]

`--batch` prompts of random token ids (seed 0) whose lengths are spread evenly over `--prompt-lengths`,
left-padded to the longest with the pad token, the attention mask 0 on the padding. Greedy search and beam
search (`--beams`; 1 is greedy; one returned sequence per prompt) decode exactly N new tokens
(`min_new_tokens = max_new_tokens = N`, so no row ends early) on each path, each path on its own copy of the
model (same seed, same weights) after `torch._dynamo.reset()`, in one process:
- `eager`: `model.generate`, dynamic cache;
- `auto`: `model.generate` with transformers' auto-compile (static cache and `compile_config`, as
  bench/decode.py sets them up: `reduce-overhead` on CUDA);
- `cachelife_spcN`: `cachelife.generate` with its defaults (`cuda_graphs="cachelife"`, `fallback=True`), once
  per `--steps-per-call` value.
Per path: the first call's seconds (compilation included) and the short one's after it, then `--repeats`
alternating calls of both lengths: every call's seconds, the marginal ms per step ((best long call - best short
call) / (long - short), as bench/timing.py computes it), the GPU kernel ms per step on CUDA, whether every call
gave the tokens of the path's first call of that length, new dynamo graphs after the first calls, the graphs
cachelife captured, and the WARNING lines logged under the `cachelife` logger (a fallback to transformers'
loop says so there). The tokens of the long call are compared with those of `auto` and of `eager`: equal, or
the first new-token position where they differ (bf16 rounds differently on each path; the difference is
recorded, not hidden). `speedup_over_auto` divides auto's figures by cachelife's. `--model tiny` is the same
family at toy sizes, for a CPU run in seconds. The host's load averages at the start and the end are recorded
(CPU figures from a shared machine are as good as its quiet). Writes
`<out>/padded-<model>-<device>-<date>-tf<version>.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, Final

import torch
from attrs import field, frozen
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

import cachelife
from bench.decode import auto_compile
from bench.results_file import bench_parser, results_file
from bench.timing import as_tokens, kernels_per_step, marginal_runs, timed
from cachelife.integration.runtime import existing_runtime
from cachelife.tools import zoo
from cachelife.tools.recipe import CudaGraphHealth, pick_device

Run = Callable[[int], torch.Tensor]


def llama_3_2_1b_shaped() -> LlamaConfig:
    """Shaped like Llama-3.2-1B: 16 layers, hidden 2048, MLP 8192, 32 heads of 64 with 8 key/value heads,
    vocab 128256, rope theta 500000 with its llama3 scaling, tied embeddings; its special tokens (begin 128000,
    end 128001) and the pad token its tokenizer ships (128004)."""
    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
        "low_freq_factor": 1.0, "original_max_position_embeddings": 8192,
    }  # fmt: skip
    return LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters=rope, tie_word_embeddings=True, bos_token_id=128000, eos_token_id=128001,
        pad_token_id=128004,
    )  # fmt: skip


def llama_3_2_tiny() -> LlamaConfig:
    """The same family at toy sizes: 2 layers, hidden 64, 4 heads of 16 with 1 key/value head (the 4:1 grouping
    of the 1B shape), rope theta 500000, tied embeddings, vocab 512."""
    return LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


CONFIGS: Final[dict[str, Callable[[], LlamaConfig]]] = {"llama-3.2-1b": llama_3_2_1b_shaped, "tiny": llama_3_2_tiny}
ZOO_MODELS: Final[tuple[str, ...]] = ("llama", "llama-small")
MODEL_NAMES: Final[tuple[str, ...]] = (*CONFIGS, *ZOO_MODELS)


def build_model(model_name: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> PreTrainedModel:
    """The named model in eval mode with seeded random weights (initialised on `device`, then cast to `dtype`),
    its generation config holding the config's special tokens. Zoo names build the zoo's model."""
    if model_name in ZOO_MODELS:
        return zoo.build(model_name, device=device, dtype=dtype, seed=seed).model
    config = CONFIGS[model_name]()
    torch.manual_seed(seed)
    with torch.device(device):
        model: PreTrainedModel = LlamaForCausalLM(config)
    model = model.to(dtype=dtype).eval()
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, name, getattr(config, name))
    return model


def spread_lengths(batch: int, shortest: int, longest: int) -> list[int]:
    """`batch` prompt lengths spread evenly from `shortest` to `longest`."""
    return [int(length) for length in torch.linspace(shortest, longest, batch).round().tolist()]


def padded_prompts(model: PreTrainedModel, lengths: list[int], seed: int = 0) -> zoo.Inputs:
    """Random token ids (none of the special tokens) of the given lengths, left-padded with the pad token to the
    longest, and their attention mask (0 on the padding), on the model's device."""
    config = model.config
    pad = int(config.pad_token_id)
    specials = [token for token in (config.bos_token_id, config.eos_token_id, pad) if isinstance(token, int)]
    high = min((token for token in specials if token >= 5), default=int(config.vocab_size))
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(5, high, (length,), generator=generator)
        mask[row, width - length :] = 1
    return {"input_ids": ids.to(model.device), "attention_mask": mask.to(model.device)}


def search(beams: int, tokens: int) -> dict[str, Any]:
    """`generate` settings for exactly `tokens` new tokens, greedy (`beams` 1) or beam search with one returned
    sequence per prompt."""
    settings: dict[str, Any] = {"do_sample": False, "max_new_tokens": tokens, "min_new_tokens": tokens}
    if beams > 1:
        settings.update(num_beams=beams, num_return_sequences=1)
    return settings


class _Collect(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def cachelife_warnings() -> Iterator[list[str]]:
    """The WARNING (and worse) lines logged under the `cachelife` logger while the block runs, a fallback's
    among them (one per model and feature: later ones go to DEBUG)."""
    lines: list[str] = []
    handler = _Collect(lines)
    logger = logging.getLogger("cachelife")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def compare(tokens: torch.Tensor, reference: torch.Tensor, prompt_width: int) -> dict[str, Any]:
    """Whether `tokens` equal `reference`; if not, the first new-token position at which any row differs, the
    rows differing there and how many rows differ anywhere."""
    if tokens.shape != reference.shape:
        return {"equal": False, "shapes": [list(tokens.shape), list(reference.shape)]}
    differs = tokens.cpu() != reference.cpu()
    if not bool(differs.any()):
        return {"equal": True}
    column = int(differs.any(dim=0).nonzero()[0])
    return {
        "equal": False,
        "first_difference_new_token": column - prompt_width,
        "rows_differing_there": differs[:, column].nonzero().flatten().tolist(),
        "rows_differing": int(differs.any(dim=1).sum()),
    }


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def captures(model: object) -> int:
    """CUDA graphs cachelife captured for `model` so far (0 for a model it never decoded)."""
    runtime = existing_runtime(model)
    return 0 if runtime is None else runtime.captures


def measure_path(
    run: Run, model: PreTrainedModel, device: torch.device, *, short: int, long: int, repeats: int
) -> tuple[dict[str, Any], torch.Tensor]:
    """One path's figures (see the module docstring) and the tokens of its first long call."""
    with cachelife_warnings() as warnings:
        start = CudaGraphHealth.now()
        first_s, first = timed(device, lambda: run(long))
        # The long call first: transformers keeps the largest static cache it made, so the short one reuses it.
        second_s, second = timed(device, lambda: run(short))
        after_first = CudaGraphHealth.now()
        captured = captures(model)
        expected = {long: first, short: second}

        def again(tokens: int) -> tuple[float, bool]:
            seconds, out = timed(device, lambda: run(tokens))
            return seconds, out.shape == expected[tokens].shape and bool(torch.equal(out, expected[tokens]))

        timing = marginal_runs(again, short, long, repeats)
        kernels = kernels_per_step(device, run, short, long)
        end = CudaGraphHealth.now()
    best_long = min(timing["call_s"][str(long)])
    return {
        "first_call_s": round(first_s, 3),
        "first_short_call_s": round(second_s, 3),
        "call_ms": round(1000 * best_long, 3),
        "call_s": timing["call_s"],
        "ms_per_step": timing["marginal_ms_per_step"],
        "kernel_ms_per_step": None if kernels is None else round(kernels[0], 4),
        "kernel_launches_per_step": None if kernels is None else round(kernels[1], 1),
        "repeat_calls_same_tokens": timing["all_equal"],
        "cudagraph_skips": end.cudagraph_skips - start.cudagraph_skips,
        "new_graphs_after_first_calls": end.graphs - after_first.graphs,
        "cachelife_captures": captures(model),
        "cachelife_captures_after_first_calls": captures(model) - captured,
        "warnings": warnings,
        "fallback": any("falls back" in line for line in warnings),
    }, first


@frozen
class Plan:
    """One path: `model.generate` with `extra` settings, or `cachelife.generate` at `steps` steps per call."""

    name: str
    extra: dict[str, Any] = field(factory=dict)
    steps: int | None = None

    def runner(self, model: PreTrainedModel, inputs: zoo.Inputs, beams: int) -> Run:
        """run(tokens): this path's call for `tokens` new tokens on `model`."""
        steps = self.steps
        if steps is None:
            return lambda n: as_tokens(model.generate(**inputs, **search(beams, n), **self.extra))
        return lambda n: as_tokens(cachelife.generate(model, steps_per_call=steps, **inputs, **search(beams, n)))


def plans(args: argparse.Namespace, device: torch.device) -> list[Plan]:
    """The paths `--paths` names, cachelife's once per `--steps-per-call` value."""
    wanted = args.paths.split(",")
    chosen = [Plan("eager")] if "eager" in wanted else []
    if "auto" in wanted:
        chosen.append(Plan("auto", auto_compile(device)))
    if "cachelife" in wanted:
        chosen += [Plan(f"cachelife_spc{steps}", steps=int(steps)) for steps in args.steps_per_call.split(",")]
    return chosen


def measure(args: argparse.Namespace, beams: int, lengths: list[int], device: torch.device) -> dict[str, Any]:
    """Every path for one search (`beams`), then the token comparisons and the speedups."""
    short, long = (int(value) for value in args.new_tokens.split(","))
    results: dict[str, dict[str, Any]] = {}
    outputs: dict[str, torch.Tensor] = {}
    for plan in plans(args, device):
        torch._dynamo.reset()  # each path pays its own compilation; no graphs carried over from the last
        model = build_model(args.model, device, getattr(torch, args.dtype))
        run = plan.runner(model, padded_prompts(model, lengths), beams)
        path = plan.name
        results[path], outputs[path] = measure_path(run, model, device, short=short, long=long, repeats=args.repeats)
        del run, model
        release(device)
        print(json.dumps({"beams": beams, "path": path, **results[path]}), flush=True)
    for path, tokens in outputs.items():
        for reference in ("auto", "eager"):
            if reference in outputs and reference != path:
                results[path][f"tokens_vs_{reference}"] = compare(tokens, outputs[reference], max(lengths))
    return {"beams": beams, "paths": results, "speedup_over_auto": speedups(results)}


def speedups(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per cachelife path: auto's ms per step over the path's, and auto's long call over the path's."""
    auto = results.get("auto")
    if auto is None:
        return {}

    def ratio(ours: float, theirs: float) -> float | None:
        return round(theirs / ours, 3) if ours > 0 and theirs > 0 else None

    return {
        path: {
            "per_step": ratio(row["ms_per_step"], auto["ms_per_step"]),
            "per_call": ratio(row["call_ms"], auto["call_ms"]),
        }
        for path, row in results.items()
        if path.startswith("cachelife")
    }


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per search and path: call ms, ms per step, speedup over auto, token equality, fallback."""
    lines = []
    for entry in runs:
        for path, row in entry["paths"].items():
            versus = row.get("tokens_vs_auto", {})
            lines.append({
                "beams": entry["beams"], "path": path, "call_ms": row["call_ms"], "ms_per_step": row["ms_per_step"],
                "speedup_per_step_over_auto": entry["speedup_over_auto"].get(path, {}).get("per_step"),
                "tokens_equal_auto": versus.get("equal"),
                "first_difference_vs_auto": versus.get("first_difference_new_token"),
                "tokens_equal_eager": row.get("tokens_vs_eager", {}).get("equal"), "fallback": row["fallback"],
            })  # fmt: skip
    return lines


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--model", default="llama-3.2-1b", choices=MODEL_NAMES)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-lengths", default="20,128", help="SHORTEST,LONGEST prompt, the rest spread between")
    parser.add_argument("--new-tokens", default="16,64", help="SHORT,LONG new tokens for the marginal step time")
    parser.add_argument("--beams", default="1,4", help="num_beams values, 1 for greedy search")
    parser.add_argument("--steps-per-call", default="1,4", help="cachelife.generate's steps_per_call values")
    parser.add_argument("--paths", default="eager,auto,cachelife")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = pick_device(args.device)
    lengths = spread_lengths(args.batch, *(int(value) for value in args.prompt_lengths.split(",")))
    body = {"settings": vars(args).copy(), "prompt_lengths": lengths, "load_average": [os.getloadavg()]}
    body["results"] = []
    results = results_file(args.out, f"padded-{args.model}", device, "padded", body)
    for beams in (int(value) for value in args.beams.split(",")):
        results.add(measure(args, beams, lengths, device), show=False)  # measure prints each path's line
    results.record["load_average"].append(os.getloadavg())
    results.put("summary", summary(results.record["results"]))
    print(json.dumps({"summary": results.record["summary"]}, indent=1), flush=True)
    results.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
