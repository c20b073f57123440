"""nox sessions. `nox` runs the default set:

- `tests`: the fast tests (`-m "not slow and not gpu"`) on the oldest and the newest supported transformers. On the
  newest, in the same environment: one compiled test per feature of the slow tests (compiled models, long loops;
  the further variants, marked `exhaustive`, are left to `slow` and `full`) and cachelife's Triton kernels
  in Triton's CPU interpreter (`TRITON_INTERPRET=1`), in the same pytest run; then mypy --strict and the
  documentation site (warnings as errors), which `typecheck` and `docs` run alone. Two pytest-xdist workers
  (`CACHELIFE_TEST_WORKERS`), each on one thread (`OMP_NUM_THREADS=1`) and compiling in its own process
  (`TORCHINDUCTOR_COMPILE_THREADS=1`); and the planted-bug runs (`planted`, quick): the kernel tests against copies
  of the source with one bug each;
- `lint`: ruff.

`nox -s slow` runs the slow tests alone, every family; `nox -s full` runs the whole CPU suite on both
transformers releases. Every session runs on the Python that runs nox (3.11 to 3.13). torch is installed
first, on its own, so that no later requirement lets pip pick another build; where pip's own configuration
would hand out a CUDA build (several GB, PyPI on Linux) on a machine without a GPU, run
`CACHELIFE_TORCH_INDEX=https://download.pytorch.org/whl/cpu nox`. `gpu` runs on a GPU machine with the
interpreter and packages already there, and skips (never passes) where CUDA is absent.
"""

from __future__ import annotations

import os
import subprocess

import nox

nox.options.sessions = ["tests", "lint"]  # the newest release's tests session type-checks and builds the docs too
nox.options.default_venv_backend = "venv"
# A second `nox` on the same checkout keeps each session's environment (pip only checks what is installed);
# `nox --reuse-venv=no` starts afresh. A clean clone, as in CI, creates every environment once.
nox.options.reuse_venv = "yes"

TORCH = "torch==2.13.0"
# Where torch comes from: by default ("") wherever pip's own configuration finds it, so that a machine without a
# route to PyTorch's index does not wait on it. On Linux, PyPI's torch brings CUDA libraries (several GB):
# CACHELIFE_TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the CPU build from PyTorch's index instead.
TORCH_INDEX = os.environ.get("CACHELIFE_TORCH_INDEX", "")
# The tested transformers range: the oldest supported release and the newest one.
TRANSFORMERS = ["5.17.0", "5.25.0"]
# Releases whose requirements the package index CI uses cannot meet in full: transformers 5.25.0 requires
# `kernels>=0.19.1` (Hugging Face's loader of hub kernels, imported only for a model that asks for them), which
# that index lacks. Such a release is installed without its requirements, over the release before it (whose
# requirements are installed) and the newer requirements listed with it.
OVER = {"5.25.0": ("5.24.0", ("huggingface-hub>=2.4.0,<3.0",))}
FAST = "not slow and not gpu"
# The default run's slow tests on the newest transformers: all but the `exhaustive` ones (one compiled test a feature).
CI = "not gpu and not exhaustive"
# pytest-xdist workers for the CPU suite, which is mostly compilation: one per core of a 2-core CI machine.
# Tests that share one Ray instance run on one worker (`xdist_group`, `--dist loadgroup`).
WORKERS = os.environ.get("CACHELIFE_TEST_WORKERS", "2")
# Triton for the kernel tests on the CPU: no torch requirement of its own, so pip keeps the installed torch.
TRITON = "triton==3.9.0"


def install(session: nox.Session, transformers: str = TRANSFORMERS[-1], extra: str = "dev") -> None:
    """torch first, on its own, then cachelife with one of its extras (the dev tools unless told) and one
    transformers release."""
    session.install(TORCH, *(["--index-url", TORCH_INDEX] if TORCH_INDEX else []))
    if transformers not in OVER:
        session.install("-e", f".[{extra}]", f"transformers=={transformers}")
        return
    before, requirements = OVER[transformers]
    session.install("-e", f".[{extra}]", f"transformers=={before}", *requirements)
    session.install("--no-deps", f"transformers=={transformers}")


def pytest(session: nox.Session, marks: str, *args: str, env: dict[str, str] | None = None) -> None:
    """pytest on the selected marks; with extra arguments (`nox -- -k name`), selecting no test is no failure.

    pytest exits 5 when nothing was collected: without arguments that means a broken suite; with them, the
    selection may simply fall outside this session's marks (`nox -- tests/test_stubs.py` in `slow`).
    """
    success = [0, 5] if session.posargs else [0]
    # One thread per worker, no compile pool: each worker keeps to one core (OpenMP threads that outnumber the
    # cores spin and slow every worker down).
    env = {"OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", **(env or {})}
    session.run(
        "python", "-m", "pytest", "-n", WORKERS, "--dist", "loadgroup", "-m", marks, *args, *session.posargs,
        env=env, success_codes=success,
    )  # fmt: skip


@nox.session
@nox.parametrize("transformers", TRANSFORMERS)
def tests(session: nox.Session, transformers: str) -> None:
    """The fast tests against one transformers release; against the newest, the slow tests too."""
    newest = transformers == TRANSFORMERS[-1]
    install(session, transformers, "dev,serve,docs" if newest else "dev")  # Ray Serve's tests once, on the newest
    if not newest:
        pytest(session, FAST)  # without Triton: cachelife's kernels take their plain-torch paths
        return
    # One environment and one pytest run for the slow tests, and mypy and the docs in the same environment:
    # separate sessions would install torch, transformers and Ray again (`typecheck` and `docs` run them alone).
    # Triton in its interpreter runs cachelife's kernels on the CPU (tests/kernels); CUDA builds of torch bring
    # their own Triton.
    session.install(TRITON)
    pytest(session, CI, env={"TRITON_INTERPRET": "1"})
    if not session.posargs:
        planted_bugs(session)
        mypy(session)
        sphinx(session)


def planted_bugs(session: nox.Session) -> None:
    """The kernel tests against copies of the source with one planted bug each, in Triton's interpreter
    (bench/planted_bugs.py, without the slow tests): every bug must fail a test, the unchanged copy none."""
    out = session.create_tmp()
    session.run("python", "-m", "bench.planted_bugs", "--device", "cpu", "--quick", "--out", out)


@nox.session(default=False)
def planted(session: nox.Session) -> None:
    """The planted-bug runs alone, every kernel test (slow ones too); writes bench/results/planted-bugs-cpu-*.json."""
    install(session)
    session.install(TRITON)
    session.run("python", "-m", "bench.planted_bugs", "--device", "cpu", *session.posargs)


@nox.session(default=False)
def slow(session: nox.Session) -> None:
    """The slow tests (compiled CPU models, long loops) once, against the newest transformers."""
    install(session)
    pytest(session, "slow and not gpu")


@nox.session(default=False)
@nox.parametrize("transformers", TRANSFORMERS)
def full(session: nox.Session, transformers: str) -> None:
    """The whole CPU suite (fast and slow tests) against one transformers release."""
    install(session, transformers)
    pytest(session, "not gpu")


@nox.session(default=False)
def fuzz(session: nox.Session) -> None:
    """The stateful property tests with the long `fuzz` hypothesis profile (1500 examples of up to 60 steps)."""
    install(session)
    pytest(session, "not gpu", "tests/core/test_state_machine.py", env={"HYPOTHESIS_PROFILE": "fuzz"})


@nox.session(default=False)
def soak(session: nox.Session) -> None:
    """200 consecutive generate calls with cachelife on the CPU; writes bench/results/soak-cpu-*.json."""
    install(session)
    session.run("python", "-m", "bench.soak", "--device", "cpu", "--calls", "200", *session.posargs)


@nox.session(default=False)
def typecheck(session: nox.Session) -> None:
    """mypy --strict alone (the default run's newest `tests` session runs it too)."""
    install(session, extra="dev,serve")  # ray_serve.py's imports are checked against Ray's own types
    mypy(session)


def mypy(session: nox.Session) -> None:
    """mypy --strict on src, tests, bench and noxfile.py, against the stubs in typings/."""
    session.run("mypy", "--strict")


@nox.session
def lint(session: nox.Session) -> None:
    """ruff lint (assert banned in src/) and format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "src", "tests", "bench", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "bench", "noxfile.py")


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """The documentation site alone (the default run's newest `tests` session builds it too)."""
    install(session, extra="docs")
    sphinx(session, *session.posargs)


def sphinx(session: nox.Session, *args: str) -> None:
    """The documentation site (Sphinx, from docs/), with warnings as errors, into docs/_build/html."""
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", "docs", "docs/_build/html", *args)


@nox.session(venv_backend="none", default=False)
def gpu(session: nox.Session) -> None:
    """GPU tests (pytest -m gpu) with the interpreter and packages already installed; skips without CUDA."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    if subprocess.run(["python", "-c", probe], check=False).returncode != 0:
        session.skip("no CUDA device (or no torch) here: GPU tests skipped, not passed")
    session.run("python", "-m", "pytest", "-m", "gpu", *session.posargs, env={"PYTHONPATH": "src"})
