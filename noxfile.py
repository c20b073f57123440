"""nox sessions: `nox` runs tests (on the oldest and newest supported transformers), typecheck and lint.

The CPU build of torch is installed first, on its own, so that no later requirement lets pip pick a CUDA
build (several GB) on a machine without a GPU. `gpu` runs on a GPU machine with the interpreter and
packages already there, and skips (never passes) where CUDA is absent.
"""

from __future__ import annotations

import subprocess

import nox

nox.options.sessions = ["tests", "typecheck", "lint"]
nox.options.default_venv_backend = "venv"

PYTHON = "3.11"
TORCH = "torch==2.13.0"
# The tested transformers range: the oldest supported release and the newest one.
TRANSFORMERS = ["5.17.0", "5.24.0"]


def install(session: nox.Session, transformers: str = TRANSFORMERS[-1]) -> None:
    """torch first (CPU build from this machine's disk), then cachelife with its dev tools."""
    session.install(TORCH)
    session.install("-e", ".[dev]", f"transformers=={transformers}")


@nox.session(python=PYTHON)
@nox.parametrize("transformers", TRANSFORMERS)
def tests(session: nox.Session, transformers: str) -> None:
    """Run the CPU test suite (compiled CPU tests included) against one transformers release."""
    install(session, transformers)
    session.run("python", "-m", "pytest", "-m", "not gpu", *session.posargs)


@nox.session(python=PYTHON, default=False)
def fuzz(session: nox.Session) -> None:
    """The stateful property tests with the long `fuzz` hypothesis profile (1500 examples of up to 60 steps)."""
    install(session)
    session.run(
        "python", "-m", "pytest", "tests/test_state_machine.py", *session.posargs, env={"HYPOTHESIS_PROFILE": "fuzz"}
    )


@nox.session(python=PYTHON, default=False)
def soak(session: nox.Session) -> None:
    """200 consecutive generate calls with cachelife on the CPU; writes bench/results/soak-cpu-*.json."""
    install(session)
    session.run("python", "-m", "bench.soak", "--device", "cpu", "--calls", "200", *session.posargs)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy --strict on src, tests, bench and noxfile.py, against the stubs in typings/."""
    install(session)
    session.run("mypy", "--strict")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff lint (assert banned in src/) and format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", "src", "tests", "bench", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "bench", "noxfile.py")


@nox.session(venv_backend="none", default=False)
def gpu(session: nox.Session) -> None:
    """GPU tests (pytest -m gpu) with the interpreter and packages already installed; skips without CUDA."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    if subprocess.run(["python", "-c", probe], check=False).returncode != 0:
        session.skip("no CUDA device (or no torch) here: GPU tests skipped, not passed")
    session.run("python", "-m", "pytest", "-m", "gpu", *session.posargs, env={"PYTHONPATH": "src"})
