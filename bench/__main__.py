"""The benchmarks' command line, over the registry in bench/registry.py.

    python -m bench list                      every registered benchmark: name, device, description
    python -m bench run NAME [ARGUMENTS...]   python -m MODULE ITS-ARGUMENTS... ARGUMENTS... (same interpreter,
                                              from the repository root; its exit status is this command's)
    python -m bench readme                    regenerate bench/results/README.md from the results files

Extra arguments come after the entry's own, and argparse keeps the last value of an option given twice, so
`python -m bench run soak-cpu --calls 20 --out /tmp/soak` is the soak-cpu run with 20 calls, written to /tmp.
Nothing here imports torch: `list` and `readme` answer at once, and `run` leaves all of it to the benchmark.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.registry import BENCHMARKS, Benchmark
from bench.results_readme import write_readme

ROOT = Path(__file__).resolve().parents[1]


def list_benchmarks() -> int:
    """One line per entry: its name, its device and what it measures."""
    width = max(len(name) for name in BENCHMARKS)
    for entry in BENCHMARKS.values():
        print(f"{entry.name:<{width}}  {entry.device:<4}  {entry.description}")
    return 0


def environment() -> dict[str, str]:
    """This process's environment with src/ and the repository root first on PYTHONPATH, as the GPU suite sets
    it: the benchmark imports this checkout's cachelife and bench, installed or not."""
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in paths if path)}


def run_benchmark(entry: Benchmark, extra: Sequence[str]) -> int:
    """Run the entry's command with `extra` arguments after its own, in a subprocess of this interpreter from the
    repository root (where `-m bench.<script>` resolves, and cachelife from src/ without an installed copy), and
    return its exit status (128 + the signal's number when a signal ended it, as a shell reports it)."""
    command = [sys.executable, *entry.command, *extra]
    print("running:", " ".join(["python", *command[1:]]), flush=True)
    returncode = subprocess.run(command, cwd=ROOT, env=environment(), check=False).returncode
    return 128 - returncode if returncode < 0 else returncode


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = top.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every registered benchmark")
    # No options of its own: everything after the name, flags included, goes to the benchmark.
    run = commands.add_parser("run", help="run one registered benchmark", prefix_chars="\0", add_help=False)
    run.add_argument("name", help="a name `python -m bench list` prints")
    run.add_argument("extra", nargs="*", help="arguments added after the entry's own")
    commands.add_parser("readme", help="regenerate bench/results/README.md")
    return top


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "list":
        return list_benchmarks()
    if args.command == "readme":
        path, files = write_readme()
        print(f"wrote {path.relative_to(ROOT)} ({files} files)")
        return 0
    entry = BENCHMARKS.get(args.name)
    if entry is None:
        print(f"no benchmark named {args.name!r}; `python -m bench list` names them all", file=sys.stderr)
        return 2
    return run_benchmark(entry, args.extra)


if __name__ == "__main__":
    sys.exit(main())
