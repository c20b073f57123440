"""Command line: `python -m cachelife demo` runs the main job (see `cachelife.demo`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from cachelife import zoo
from cachelife.demo import run_demo


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, run it, and return the process exit status."""
    parser = argparse.ArgumentParser(prog="python -m cachelife", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo", help="compiled static-cache generation with cachelife on a small model, checked against eager"
    )
    demo.add_argument("--model", default="t5", choices=zoo.MODEL_NAMES, help="zoo model (default: t5)")
    demo.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda if available)")
    demo.add_argument("--batch-size", type=int, default=2)
    demo.add_argument("--input-length", type=int, default=12)
    demo.add_argument("--new-tokens", type=int, default=16)
    demo.add_argument("--calls", type=int, default=2, help="compiled generate calls to check (default: 2)")
    args = parser.parse_args(argv)
    result = run_demo(
        model_name=args.model,
        device=args.device,
        batch_size=args.batch_size,
        input_length=args.input_length,
        new_tokens=args.new_tokens,
        calls=args.calls,
        out=sys.stdout,
    )
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
