"""Planted bugs: does each kernel test fail when the kernel it tests is broken?

    python -m bench.planted_bugs [--device cpu|cuda] [--bugs NAME,...] [--quick] [--workers N]
                                 [--pytest-workers N] [--out DIR]

Each bug of `BUGS` is a few text replacements in one module of src/cachelife, each text found exactly once.
For each bug the script copies src/ to a scratch folder, plants the bug there, and runs pytest on every test
file meant to catch it, with the copy first on PYTHONPATH (each run checks that `cachelife` is imported from
the copy): on the CPU the tests that are not `gpu` with `TRITON_INTERPRET=1`, so that Triton's interpreter runs
the kernels; on CUDA the `gpu` tests, so that the compiled kernels run. A run of the same files on the
unchanged copy comes first and must pass. Writes `planted-bugs-<device>-<date>-tf<version>.json` (every bug x
test file: "caught", a test failed; "survived", none did; the tests that failed) and prints the table; exits
1 if the unchanged run failed or any bug survived a file meant to catch it. `--quick` (CI's run) leaves out
the slow tests and the compilations for a GPU, which no planted bug changes, and stops each planted run at its
first failing test (so its table names one failing test per cell, not all).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import torch
from attrs import frozen

from bench.results_file import ROOT, bench_parser, results_file

ATTENTION = "kernels/attention.py"
LINEAR = "kernels/linear.py"
REPEATABLE = "generation/repeatable.py"
ATTENTION_TESTS = ("tests/kernels/test_attention.py", "tests/kernels/test_decode_attention_option.py")
# Bugs that only the kernel's own tests can see: the tiny models' attention is too short for two splits, and a
# scaling of their nearly uniform scores (test_attention.py sharpens its models' attention to see it) changes
# no token.
UNIT_ATTENTION_TESTS = ATTENTION_TESTS[:1]
LINEAR_TESTS = ("tests/kernels/test_linear.py", "tests/kernels/test_small_linear_option.py")
# The fused layer product's prologue and epilogue (in the linear kernel): its own tests, and on a GPU the fused
# layers' tokens as well.
LAYER_CPU_TESTS = ("tests/kernels/test_layer_linear.py",)
LAYER_TESTS = (*LAYER_CPU_TESTS, "tests/model_rewrites/test_fused_layers.py")
# The products' sums, from the tensor cores and the lanes.
_SUMS = "products + tl.sum(partial, axis=2)"
# The product's loop over the input features (the norm's statistics loop over them too).
_PRODUCT_LOOP = (
    "for start in range(0, inputs, BLOCK_K):\n        k = start + tl.arange(0, BLOCK_K)\n        k_in = k < inputs"
)
# The GPU tests of the attention kernel are all in its own file.
ATTENTION_GPU_TESTS = ATTENTION_TESTS[:1]
# The repeatability tests that a step choosing cuDNN's attention fails: on the CPU the check of the backends a
# step may choose; on CUDA the identical calls whose decoding steps run torch's attention (with the kernel
# options they run cachelife's own, so cuDNN is never reached there).
_REPEATABLE = "tests/generation/test_repeatable.py::test_"
REPEATABLE_CPU_TESTS = (f"{_REPEATABLE}cudnn_attention_is_left_out_and_math_attention_is_always_there",)
REPEATABLE_GPU_TESTS = (
    *(f"{_REPEATABLE}four_identical_calls_give_identical_tokens_and_scores_on_cuda[{case}]"
      for case in ("enabled-padded", "enabled-4-steps-padded")),
    f"{_REPEATABLE}four_identical_rounds_of_engine_requests_give_identical_tokens_on_cuda",
)  # fmt: skip

# The split kernel's lines that drop the last live key position of each row (the newest key of a decoding
# cache): a position is live only if the one after it is live too.
_LIVE = """        visit = True\n"""
_NEWEST_DROPPED = """        following = (n + 1 < positions)[None, :] & (g < GROUP)[:, None]
        if MASK != 0:
            after = tl.load(mask + batch * m_sb + head[:, None] * m_sh + (n[None, :] + 1) * m_sp,
                            mask=following, other=0)
            if MASK == 1:
                following = following & (after != 0)
            else:
                following = following & (after.to(tl.float32) > float("-inf"))
        live = live & following
        visit = True\n"""


@frozen
class Bug:
    """One planted bug: `replacements` (old text, new text) in src/cachelife/`module`, and the test files meant
    to catch it on each device."""

    name: str
    description: str
    module: str
    replacements: tuple[tuple[str, str], ...]
    cpu_tests: tuple[str, ...]  # test files, or pytest node ids
    cuda_tests: tuple[str, ...]

    def tests(self, device: str) -> tuple[str, ...]:
        return self.cpu_tests if device == "cpu" else self.cuda_tests


BUGS = (
    Bug(
        "attention-scores-scaled", "the split kernel's scores scaled by 1.25", ATTENTION,
        (("axis=2) * scale", "axis=2) * scale * 1.25"),), UNIT_ATTENTION_TESTS, ATTENTION_GPU_TESTS,
    ),
    Bug(
        "attention-newest-key-dropped", "the last position the mask admits (the newest key) left out", ATTENTION,
        ((_LIVE, _NEWEST_DROPPED),), ATTENTION_TESTS, ATTENTION_GPU_TESTS,
    ),
    Bug(
        "attention-mask-ignored", "the split kernel reads no mask (every position attends)", ATTENTION,
        (("if MASK != 0:\n            bias", "if MASK < 0:\n            bias"),
         ("if MASK == 2:\n                scores += bias", "if MASK < 0:\n                scores += bias")),
        ATTENTION_TESTS, ATTENTION_GPU_TESTS,
    ),
    Bug(
        "attention-wrong-kv-head", "a query group reads the next key/value head", ATTENTION,
        (("batch * k_sb + kv_head * k_sh", "batch * k_sb + ((kv_head + 1) % kv_heads) * k_sh"),
         ("batch * v_sb + kv_head * v_sh", "batch * v_sb + ((kv_head + 1) % kv_heads) * v_sh")),
        ATTENTION_TESTS, ATTENTION_GPU_TESTS,
    ),
    Bug(
        "attention-split-dropped", "the combine kernel leaves out the last split's partial result", ATTENTION,
        (("    s_in = s < splits\n", "    s_in = s < splits - 1\n"),), UNIT_ATTENTION_TESTS, ATTENTION_GPU_TESTS,
    ),
    Bug(
        "linear-products-scaled", "the linear kernel's products scaled by 1.25", LINEAR,
        ((_SUMS, f"({_SUMS}) * 1.25"),), LINEAR_TESTS, LINEAR_TESTS,
    ),
    Bug(
        "linear-last-input-dropped", "the linear kernel leaves out the last input feature", LINEAR,
        (("k_in = k < inputs", "k_in = k < inputs - 1"),), LINEAR_TESTS, LINEAR_TESTS,
    ),
    Bug(
        "linear-last-tile-dropped", "the linear kernel leaves out the last tile of input features", LINEAR,
        ((_PRODUCT_LOOP, _PRODUCT_LOOP.replace("range(0, inputs, BLOCK_K)", "range(0, inputs - BLOCK_K, BLOCK_K)")),),
        LINEAR_TESTS, LINEAR_TESTS,
    ),
    Bug(
        "layer-norm-uncentred", "the fused product's layer norm leaves out the mean", LINEAR,
        (("mean = total / inputs", "mean = total / inputs * 0.0"),), LAYER_CPU_TESTS, LAYER_TESTS,
    ),
    Bug(
        "layer-rms-weight-dropped", "the fused product's RMS norm leaves out its weight", LINEAR,
        (("(a * rstd[:, None]).to(dtype).to(tl.float32) * scale", "(a * rstd[:, None]).to(dtype).to(tl.float32)"),),
        LAYER_CPU_TESTS, LAYER_TESTS,
    ),
    Bug(
        "layer-gelu-misscaled", "the fused product's GELU reads its input scaled by 0.75, not 1/sqrt(2)", LINEAR,
        (("acc * 0.7071067811865476", "acc * 0.75"),), LAYER_CPU_TESTS, LAYER_TESTS,
    ),
    Bug(
        "layer-residual-dropped", "the fused product adds no residual", LINEAR,
        (("acc += tl.load(residual +", "acc += 0.0 * tl.load(residual +"),), LAYER_CPU_TESTS, LAYER_TESTS,
    ),
    Bug(
        "step-attention-cudnn", "compiled steps may choose cuDNN's attention again", REPEATABLE,
        (("    SDPBackend.MATH,\n)", "    SDPBackend.MATH,\n    SDPBackend.CUDNN_ATTENTION,\n)"),),
        REPEATABLE_CPU_TESTS, REPEATABLE_GPU_TESTS,
    ),
)  # fmt: skip
BY_NAME = {bug.name: bug for bug in BUGS}
# The tests a device runs: the kernels in Triton's interpreter on the CPU, compiled on CUDA.
MARKS = {"cpu": "not gpu", "cuda": "gpu"}


def planted_copy(scratch: Path, bug: Bug | None) -> Path:
    """A copy of src/ under `scratch` with `bug` planted (none: unchanged); its path, for PYTHONPATH."""
    target = scratch / (bug.name if bug else "unchanged") / "src"
    shutil.copytree(ROOT / "src", target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    if bug is not None:
        path = target / "cachelife" / bug.module
        text = path.read_text()
        for old, new in bug.replacements:
            if text.count(old) != 1:
                found = text.count(old)
                msg = f"bug {bug.name}: expected the text {old!r} once in {bug.module}, found it {found} times"
                raise SystemExit(msg)
            text = text.replace(old, new)
        path.write_text(text)
    return target


def run_file(source: Path, test_file: str, device: str, scratch: Path, extra: tuple[str, ...]) -> dict[str, Any]:
    """pytest on one test file (or test) against the copy at `source`, with `extra` arguments: its outcome and
    the tests that failed."""
    slug = f"{source.parent.name}-{''.join(c if c.isalnum() else '-' for c in test_file)}"
    junit = scratch / f"{slug}.xml"
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    # The copy first; then what the caller's path holds (the GPU suite's transformers release, say).
    paths = [str(source), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONDONTWRITEBYTECODE="1")
    if device == "cpu":
        env.update(TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    imported = subprocess.run(
        [sys.executable, "-c", "import cachelife; print(cachelife.__file__)"],
        env=env, cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not Path(imported).is_relative_to(source):
        msg = f"the tests would import cachelife from {imported}, not from the planted copy {source}"
        raise SystemExit(msg)
    command = [
        sys.executable, "-m", "pytest", "-q", "-m", MARKS[device], "-p", "no:cacheprovider", "-p", "no:benchmark",
        f"--junitxml={junit}",
        *extra, test_file,
    ]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    failed, passed = failures(junit)
    return {
        "returncode": done.returncode,
        "passed": passed,
        "failed": failed,
        "errors": [line[:300] for line in done.stdout.splitlines() if line.startswith("E ")][:20],
        # pytest's own failure (usage, collection, an internal error): its last words
        "tail": [] if done.returncode in (0, 1) else (done.stdout + done.stderr).splitlines()[-12:],
    }


def failures(junit: Path) -> tuple[list[str], int]:
    """The names of the tests that failed or errored, and how many passed."""
    if not junit.exists():
        return [], 0
    failed, passed = [], 0
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            failed.append(case.get("name", ""))
        elif "skipped" not in tags:
            passed += 1
    return failed, passed


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--bugs", default=",".join(BY_NAME), help="the bugs to plant, by name")
    parser.add_argument("--workers", type=int, default=2, help="pytest runs at a time")
    parser.add_argument(
        "--quick", action="store_true", help="leave out the slow tests and the compilations for a GPU (CI's run)"
    )
    parser.add_argument("--select", default="", help="a pytest -k expression every run adds")
    parser.add_argument("--pytest-workers", type=int, default=0, help="pytest-xdist workers of each run (0: none)")
    args = parser.parse_args()
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    asked = [BY_NAME[name] for name in args.bugs.split(",") if name]
    bugs = [bug for bug in asked if bug.tests(device)]
    files = sorted({file for bug in bugs for file in bug.tests(device)})
    extra: tuple[str, ...] = ("-n", str(args.pytest_workers)) if args.pytest_workers else ()
    extra = (*extra, "-k", args.select) if args.select else extra
    if args.quick:
        no_compilation = "not compile_for_a_gpu and not compiles_for_a_gpu"
        if args.select:
            no_compilation = f"({args.select}) and {no_compilation}"
        extra = (*extra, "-k", no_compilation, "-m", f"{MARKS[device]} and not slow")
    results = results_file(args.out, "planted-bugs", torch.device(device), "planted-bugs", {
        "bugs": {bug.name: bug.description for bug in bugs}, "quick": args.quick,
        "not_planted_here": {bug.name: f"no test on {device} can see it" for bug in asked if bug not in bugs},
        "unchanged": {}, "table": {},
    })  # fmt: skip
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(args.workers) as pool:
        scratch = Path(folder)
        clean = planted_copy(scratch, None)
        runs: dict[tuple[str | None, str], Future[dict[str, Any]]] = {
            (None, file): pool.submit(run_file, clean, file, device, scratch, extra) for file in files
        }
        for bug in bugs:
            source = planted_copy(scratch, bug)
            # A quick run stops a planted copy's file at its first failure: one failure is enough to catch it.
            planted_extra = (*extra, "--exitfirst") if args.quick else extra
            runs.update({(bug.name, file): pool.submit(run_file, source, file, device, scratch, planted_extra)
                         for file in bug.tests(device)})  # fmt: skip
        for (name, file), future in runs.items():
            outcome = future.result()
            if name is None:
                results.record["unchanged"][file] = outcome
            else:
                verdict = "caught" if outcome["failed"] else "survived"
                results.record["table"].setdefault(name, {})[file] = {"verdict": verdict, **outcome}
    unchanged_pass = all(run["returncode"] == 0 for run in results.record["unchanged"].values())
    all_caught = all(cell["verdict"] == "caught" for row in results.record["table"].values() for cell in row.values())
    results.put("unchanged_runs_pass", unchanged_pass)
    results.put("every_bug_caught", all_caught)
    print_table(results.record, files)
    results.finish()
    return 0 if unchanged_pass and all_caught else 1


def print_table(record: dict[str, Any], files: list[str]) -> None:
    names = [Path(file).name for file in files]
    print("bug".ljust(30), *(name.ljust(34) for name in names))
    print("(unchanged)".ljust(30), *(
        (f"passed {run['passed']}" if run["returncode"] == 0 else f"FAILED {run['failed']}").ljust(34)
        for run in (record["unchanged"][file] for file in files)
    ))  # fmt: skip
    for bug, row in record["table"].items():
        cells = [row.get(file) for file in files]
        print(bug.ljust(30), *(
            ("-" if cell is None else f"{cell['verdict']} ({len(cell['failed'])} failed)").ljust(34) for cell in cells
        ))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
