"""Command line: `python -m cachelife demo` (or `cachelife demo`) runs the main job; `recipe` runs the recipe.

`recipe --json` prints one `RESULT {...}` line, for tests and benchmarks that run it in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch

from cachelife.tools import zoo
from cachelife.tools.demo import run_demo
from cachelife.tools.recipe import run_recipe


def program_name(argv0: str) -> str:
    """How the user started us: `cachelife` (the console script) or `python -m cachelife`."""
    name = os.path.basename(argv0)
    return "python -m cachelife" if name in ("__main__.py", "-m", "") else name


def build_parser(prog: str) -> argparse.ArgumentParser:
    """The command line, every option with its help and its default."""
    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=defaults)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,recipe}")
    demo = commands.add_parser(
        "demo",
        help="compiled static-cache generation with cachelife, checked against eager",
        description="Compiled static-cache generation with cachelife on a small model, checked against eager.",
        formatter_class=defaults,
    )
    recipe = commands.add_parser(
        "recipe",
        help="the compiled static-cache recipe, with or without cachelife",
        description="transformers' compiled static-cache recipe, with or without cachelife; prints a report.",
        formatter_class=defaults,
    )
    for command, calls, batch, length, tokens in ((demo, 2, 2, 12, 16), (recipe, 3, 4, 48, 64)):
        command.add_argument("--model", default="t5", choices=zoo.MODEL_NAMES, help="model of cachelife.tools.zoo")
        command.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda where available)")
        command.add_argument("--batch-size", type=int, default=batch, help="sequences per generate call")
        command.add_argument("--input-length", type=int, default=length, help="prompt (encoder input) length")
        command.add_argument("--new-tokens", type=int, default=tokens, help="tokens generated per call")
        command.add_argument("--calls", type=int, default=calls, help="compiled generate calls")
    recipe.add_argument("--without-cachelife", action="store_true", help="run transformers as released")
    recipe.add_argument(
        "--compile", choices=("forward", "auto"), default="forward", help="compile model.forward, or let generate"
    )
    recipe.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="model dtype")
    recipe.add_argument("--num-beams", type=int, default=1, help="beam search with this many beams")
    recipe.add_argument("--json", action="store_true", help="print one RESULT line of JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, run it, and return the process exit status."""
    args = build_parser(program_name(sys.argv[0])).parse_args(argv)
    if args.command == "demo":
        demo = run_demo(
            model_name=args.model,
            device=args.device,
            batch_size=args.batch_size,
            input_length=args.input_length,
            new_tokens=args.new_tokens,
            calls=args.calls,
            out=sys.stdout,
        )
        return 0 if demo.ok else 1
    report = run_recipe(
        args.model,
        use_cachelife=not args.without_cachelife,
        compile_mode=args.compile,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        batch_size=args.batch_size,
        input_length=args.input_length,
        new_tokens=args.new_tokens,
        calls=args.calls,
        num_beams=args.num_beams,
    )
    if args.json:
        print("RESULT " + json.dumps(report.to_json()), flush=True)
    else:
        print(json.dumps(report.to_json(), indent=2))
    return 0 if report.ok else 1
