"""The whole GPU suite, in one command, for a CUDA machine with torch, pytest and attrs installed.

    python3 bench/gpu_suite.py [--stages STAGE,STAGE/STAGE,...] [--out DIR]

Stages: tests (pytest -m gpu on the files of GPU_TESTS, group after group, against the image's transformers and
every wheel in `.whl/` (`transformers-<version>-*.whl`, installed side by side with --no-deps), all versions at
once; `--tests-k` selects some tests, `--test-groups` some groups; a wheel needing a newer huggingface-hub than
the image's takes it from `.whl/hub/`, made with `pip download huggingface-hub==<version> --python-version 3.12
--platform manylinux2014_x86_64 --only-binary=:all: -d .whl/hub`), health (cachelife's recipe in fresh
processes: CUDA-graph skips and re-records), multidevice and tp (two GPUs: device_map tests on every version,
tensor parallelism under torchrun on the newest), and every CUDA benchmark of bench/registry.py under its
name (`python -m bench list`; newest transformers; each writes its JSON to --out/<stage>).

`/` separates tracks that run at the same time, one after the other within a track; with several GPUs, track i
runs on GPU min(i, last) (CUDA_VISIBLE_DEVICES; multidevice and tp see every GPU), so the first track (put the
timed benchmarks there) has a GPU of its own; each track's processes run on their own equal share of the CPUs,
so that one track's compilations do not slow the host side of another's timings. Writes `gpu-summary.json`
(outcomes, recipe reports and CUDA-graph counters per version; rewritten after every stage) and
`gpu-logs.tar.gz` (every log) to --out (default: $OUT, else bench/results/gpu). `--time-limit SECONDS` ends the
suite in time for a machine's per-command limit: a pytest still running then is interrupted (its junit file
keeps the tests that ended), a benchmark killed, their logs kept, and later stages are recorded as not run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any
from xml.etree import ElementTree
from zipfile import ZipFile

import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# Run as `python3 bench/gpu_suite.py`, its own folder is on the path: the root (bench) and src (cachelife) are not.
for _entry in (ROOT / "src", ROOT):
    if str(_entry) not in sys.path:
        sys.path.insert(0, str(_entry))

from bench.registry import BENCHMARKS  # noqa: E402 - importable once the repository root is on the path
from bench.results_file import source_state  # noqa: E402 - as above


def versions(work: Path) -> dict[str, str]:
    """transformers version -> extra PYTHONPATH entry ('' for the image's own). A wheel whose huggingface-hub
    requirement the image's hub does not meet gets a hub that does, with what that hub requires, from the
    wheelhouse `.whl/hub/` (wheels for the GPU image's Python), in its own entry; a version that still cannot
    be imported is left out, and why is printed."""
    image = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    found = {image: ""}
    for wheel in sorted((ROOT / ".whl").glob("transformers-*.whl")):
        version = wheel.name.split("-")[1]
        if version in found:
            continue
        target = work / f"transformers-{version}"
        install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-compile", "--target", str(target)]
        subprocess.run([*install, "--no-deps", str(wheel)], check=True)
        hub = hub_requirement(wheel)
        if hub is not None:
            houses = ["--find-links", str(ROOT / ".whl" / "hub")]
            done = subprocess.run([*install, *houses, str(hub)], check=False, capture_output=True, text=True)
            if done.returncode != 0:
                print(f"transformers {version} left out: no {hub} in .whl/hub/:\n{done.stderr[-2000:]}")
                continue
        check = subprocess.run(
            [sys.executable, "-c", "import transformers.generation, transformers.models.whisper"],
            check=False,
            capture_output=True,
            text=True,
            env=environment(str(target)),
        )
        if check.returncode != 0:
            print(f"transformers {version} left out: it does not import here:\n{check.stderr[-2000:]}")
            continue
        found[version] = str(target)
    return found


def hub_requirement(wheel: Path) -> Requirement | None:
    """The huggingface-hub requirement of the transformers `wheel`, if the image's hub does not meet it."""
    with ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(name).decode().splitlines()
    wanted = [Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")]
    hub = next((r for r in wanted if r.name.replace("_", "-") == "huggingface-hub" and r.marker is None), None)
    if hub is None or hub.specifier.contains(metadata.version("huggingface_hub"), prereleases=True):
        return None
    return hub


# The GPU of the track running in this thread ("" for all of them).
_TRACK = threading.local()


def newest(found: dict[str, str]) -> tuple[str, str]:
    """The newest transformers version found, and its PYTHONPATH entry."""
    version = max(found, key=Version)
    return version, found[version]


def environment(extra_path: str, *, every_gpu: bool = False, **more: str) -> dict[str, str]:
    paths = [p for p in (extra_path, str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p]
    gpu: str = getattr(_TRACK, "gpu", "")
    pinned = {"CUDA_VISIBLE_DEVICES": gpu} if gpu and not every_gpu else {}
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1", **pinned, **more}


# The single-GPU test files (tests/core/test_multidevice.py runs in the multidevice stage), in groups that run
# as separate pytest processes: a process lost in one group (a lost pytest-xdist worker stops the whole run)
# leaves the others' outcomes.
GPU_TESTS = (
    ("main", ("tests/test_gpu.py", "tests/generation/test_gpu_workloads.py", "tests/serving")),
    ("kernels", ("tests/kernels", "tests/model_rewrites")),
    ("repeatable", ("tests/generation/test_repeatable.py",)),
)


def run_tests(
    found: dict[str, str],
    work: Path,
    workers: int,
    select: str = "",
    groups: tuple[str, ...] = (),
    *,
    deadline: float | None = None,
) -> dict[str, Any]:
    """pytest -m gpu for every transformers version at once, one group of files after the other (only the
    `groups` named, if any, and the tests `select` picks with -k, if given); one log, junit file and recipe
    file per version and group. At `deadline` a pytest still running is interrupted (its junit file keeps the
    tests that ended) and later groups are recorded as not run."""
    results: dict[str, Any] = {version: {"pytest_returncode": {}, "tests": {}, "recipes": []} for version in found}
    for group, names in GPU_TESTS:
        if any(groups) and group not in groups:
            continue
        if deadline is not None and time.monotonic() >= deadline:
            for result in results.values():
                result["pytest_returncode"][group] = "not run: the suite's time limit had passed"
            continue
        files = [str(ROOT / name) for name in names if (ROOT / name).exists()]
        running = {}
        for version, path in found.items():
            log = (work / f"pytest-{version}-{group}.log").open("w")
            junit = work / f"junit-{version}-{group}.xml"
            command = [
                sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-p", "no:benchmark",
                "-n", str(workers), "--dist", "loadgroup", *(["-k", select] if select else []),
                "-rA", f"--junitxml={junit}", *files,
            ]  # fmt: skip
            env = environment(path, CACHELIFE_GPU_RESULTS=str(work / f"recipes-{version}-{group}.jsonl"))
            running[version] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
            )
        for version, process in running.items():
            returncode = wait_until(process, deadline)
            result = results[version]
            result["pytest_returncode"][group] = returncode
            result["tests"].update(junit_outcomes(work / f"junit-{version}-{group}.xml"))
            result["recipes"].extend(recipe_summaries(work / f"recipes-{version}-{group}.jsonl"))
    return results


def wait_until(process: subprocess.Popen[bytes], deadline: float | None) -> int | str:
    """The pytest `process`'s exit status; past `deadline`, it is interrupted as Ctrl-C would (pytest then
    writes its junit file with the tests that ended) and, if still running 30 s later, killed."""
    try:
        return process.wait(timeout=None if deadline is None else max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
            return "interrupted at the suite's time limit"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return "killed at the suite's time limit"


def junit_outcomes(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    outcomes = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = child.tag
        outcomes[name] = status
    return outcomes


def recipe_summaries(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    summaries = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        summaries.append(
            {
                "arguments": record.get("arguments"),
                "returncode": record.get("returncode"),
                "killed_by": record.get("killed_by"),
                "ok": record.get("ok"),
                "use_cachelife": record.get("use_cachelife"),
                "device": record.get("device"),
                "torch": record.get("torch"),
                "transformers": record.get("transformers"),
                "eager_seconds": record.get("eager_seconds"),
                "calls": [
                    {
                        "seconds": call["seconds"],
                        "equal_to_eager": call["equal_to_eager"],
                        "error": None if call["error"] is None else call["error"].splitlines()[0][:300],
                        **call["health"],
                    }
                    for call in record.get("calls", [])
                ],
            }
        )
    return summaries


HEALTH_CASES = [
    f"{model}:{mode}"
    for model in ("t5-small", "bart-small", "whisper-small", "llama-small")
    for mode in ("forward", "auto")
]


def health(found: dict[str, str], work: Path, processes: int, parallel: int, cases: list[str]) -> dict[str, Any]:
    """The cachelife recipe in `processes` fresh processes per model and compile mode: skips, re-records.

    First, transformers' recipe as released runs once per model, so the compile caches the cachelife
    processes share hold entries compiled over unpinned caches, as on any machine that ran it.
    """
    version, path = newest(found)  # the newest carried transformers
    models = sorted({case.split(":")[0] for case in cases})
    seeding = []
    for model in models:
        log = work / f"health-vanilla-{model}.log"
        command = [sys.executable, "-m", "cachelife", "recipe", "--json", "--model", model, "--without-cachelife"]
        sink, env = log.open("w"), environment(path)
        seeding.append(subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT))
    vanilla = {model: process.wait() for model, process in zip(models, seeding, strict=True)}
    jobs = [(model, mode, index) for model, mode in (case.split(":") for case in cases) for index in range(processes)]
    outcomes: dict[str, list[dict[str, Any]]] = {}
    for start in range(0, len(jobs), parallel):
        batch = jobs[start : start + parallel]
        running = []
        for model, mode, index in batch:
            log = work / f"health-{model}-{mode}-{index}.log"
            command = [sys.executable, "-m", "cachelife", "recipe", "--json", "--model", model, "--compile", mode]
            running.append((model, mode, log, subprocess.Popen(
                command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=environment(path), cwd=ROOT
            )))  # fmt: skip
        for model, mode, log, process in running:
            process.wait()
            lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("RESULT ")]
            record = json.loads(lines[-1].removeprefix("RESULT ")) if lines else {}
            outcomes.setdefault(f"{model} {mode}", []).append(
                {
                    "returncode": process.returncode,
                    "ok": record.get("ok"),
                    "cudagraph_skips": [call["health"]["cudagraph_skips"] for call in record.get("calls", [])],
                    "rerecords": [call["health"]["rerecords"] for call in record.get("calls", [])],
                    "graphs": [call["health"]["graphs"] for call in record.get("calls", [])],
                }
            )
    return {
        "transformers": version,
        "vanilla_first_returncodes": vanilla,
        "processes_per_case": processes,
        "cases": outcomes,
    }


# The benchmark stages: every CUDA entry of the registry, under its name.
BENCHES = {name: entry for name, entry in BENCHMARKS.items() if entry.device == "cuda"}


def pin_track_cpus(index: int, tracks: int) -> None:
    """With several tracks, the calling thread (and the processes it starts) on track `index`'s equal share
    of the CPUs."""
    if tracks > 1:
        cpus = sorted(os.sched_getaffinity(0))
        share = len(cpus) // tracks
        os.sched_setaffinity(threading.get_native_id(), cpus[index * share : (index + 1) * share])


def run_bench(stage: str, found: dict[str, str], work: Path, out: Path, deadline: float | None) -> dict[str, Any]:
    """One benchmark, with the newest transformers; it writes its own JSON to `out`. Past `deadline`
    (time.monotonic()) it is killed, and its log is kept with the others."""
    version, path = newest(found)
    log = work / f"bench-{stage}.log"
    started = time.monotonic()
    returncode: int | str
    with log.open("w") as sink:
        try:
            returncode = subprocess.run(
                [sys.executable, *BENCHES[stage].command, "--out", str(out / stage)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=environment(path),
                cwd=ROOT,
                check=False,
                timeout=None if deadline is None else max(1.0, deadline - time.monotonic()),
            ).returncode
        except subprocess.TimeoutExpired:
            returncode = "killed at the suite's time limit"
    tail = log.read_text(errors="replace").splitlines()[-15:]
    return {"transformers": version, "returncode": returncode, "seconds": time.monotonic() - started, "tail": tail}


def multidevice(found: dict[str, str], work: Path) -> dict[str, Any]:
    """The two-GPU device_map tests (tests/core/test_multidevice.py, gpu marker) on every transformers version."""
    results: dict[str, Any] = {}
    for version, path in found.items():
        junit = work / f"junit-multidevice-{version}.xml"
        log = work / f"pytest-multidevice-{version}.log"
        command = [
            sys.executable, "-m", "pytest", "-m", "gpu", "-k", "not tensor_parallel", "-p", "no:cacheprovider",
            "-p", "no:benchmark", "-rA", "-s", f"--junitxml={junit}",
            str(ROOT / "tests" / "core" / "test_multidevice.py"),
        ]  # fmt: skip
        with log.open("w") as sink:
            env = environment(path, every_gpu=True)
            done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT, check=False)
        skips = [line for line in log.read_text(errors="replace").splitlines() if "CUDA-graph skips" in line]
        results[version] = {"pytest_returncode": done.returncode, "tests": junit_outcomes(junit), "printed": skips}
    return results


def tensor_parallel(found: dict[str, str], work: Path, out: Path) -> dict[str, Any]:
    """tests/core/tp_check.py under torchrun on two GPUs, newest transformers; writes tp-check.json to `out`."""
    version, path = newest(found)
    log = work / "tp-check.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "tests" / "core" / "tp_check.py"), "--out", str(out), "--device", "cuda"]  # fmt: skip
    with log.open("w") as sink:
        env = environment(path, every_gpu=True)
        try:
            done = subprocess.run(
                command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT, check=False, timeout=300
            )
            returncode: int | str = done.returncode
        except subprocess.TimeoutExpired:
            returncode = "timed out after 300 s"
    result_file = out / "tp-check.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    return {"transformers": version, "returncode": returncode, "result": result}


def run_stage(stage: str, found: dict[str, str], work: Path, out: Path, args: argparse.Namespace) -> Any:
    stages: dict[str, Callable[[], Any]] = {
        "tests": lambda: run_tests(
            found,
            work,
            args.workers,
            args.tests_k,
            tuple(filter(None, args.test_groups.split(","))),
            deadline=args.deadline,
        ),
        "health": lambda: health(found, work, 5, args.health_parallel, args.health_cases.split(",")),
        "multidevice": lambda: multidevice(found, work),
        "tp": lambda: tensor_parallel(found, work, out),
        **{name: functools.partial(run_bench, name, found, work, out, args.deadline) for name in BENCHES},
    }
    if stage not in stages:
        msg = f"unknown stage {stage!r}; known: {', '.join(stages)}"
        raise ValueError(msg)
    return stages[stage]()


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stages", default="tests,health")
    parser.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results" / "gpu")))
    parser.add_argument("--workers", type=int, default=4, help="pytest-xdist workers per transformers version")
    parser.add_argument("--tests-k", default="", help="the tests stage runs only the tests this -k expression picks")
    parser.add_argument("--test-groups", default="", help="the tests stage runs only these GPU_TESTS groups")
    parser.add_argument("--versions", default="", help="only these of the transformers versions found (a, b, ...)")
    parser.add_argument("--health-cases", default=",".join(HEALTH_CASES), help="model:compile-mode,...")
    parser.add_argument("--health-parallel", type=int, default=10, help="health processes at a time")
    parser.add_argument(
        "--time-limit",
        type=float,
        help="seconds: tests and benchmarks still running then are interrupted, later stages not run",
    )
    return parser.parse_args()


def main() -> int:
    args = arguments()
    args.deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tracks = [track.split(",") for track in args.stages.split("/")]
    gpus = torch.cuda.device_count()
    summary: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus": gpus,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "tracks": tracks,
        **source_state(),
        "command": " ".join(sys.orig_argv),
        "stage_seconds": {},
    }
    lock = threading.Lock()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        found = versions(work)
        if args.versions:
            found = {version: path for version, path in found.items() if version in args.versions.split(",")}
        summary["transformers_versions"] = list(found)

        def write_summary() -> None:
            (out / "gpu-summary.json").write_text(json.dumps(summary, indent=1))
            with tarfile.open(out / "gpu-logs.tar.gz", "w:gz") as archive:
                for path in sorted(work.glob("*.log")) + sorted(work.glob("*.jsonl")) + sorted(work.glob("*.xml")):
                    archive.add(path, arcname=path.name)

        def run_track(index: int, stages: list[str]) -> None:
            _TRACK.gpu = str(min(index, gpus - 1)) if gpus > 1 and len(tracks) > 1 else ""
            pin_track_cpus(index, len(tracks))
            for stage in stages:
                started = time.monotonic()
                if args.deadline is not None and started >= args.deadline:
                    with lock:
                        summary[stage.replace("-", "_")] = {"not_run": "the suite's time limit had passed"}
                        write_summary()
                    continue
                try:
                    result = run_stage(stage, found, work, out, args)
                except Exception as error:  # a broken stage is recorded; the others go on
                    result = {"error": repr(error)}
                with lock:
                    summary[stage.replace("-", "_")] = result
                    summary["stage_seconds"][stage] = round(time.monotonic() - started, 1)
                    write_summary()

        threads = [threading.Thread(target=run_track, args=(i, stages)) for i, stages in enumerate(tracks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        write_summary()
    for version, result in summary.get("tests", {}).items():
        if not isinstance(result, dict):  # {"not_run": why}: no version ran
            print(f"tests: {version}: {result}")
            continue
        counts: dict[str, int] = {}
        for status in result["tests"].values():
            counts[status] = counts.get(status, 0) + 1
        print(f"transformers {version}: pytest rc={result['pytest_returncode']} {counts}")
    print("stage seconds:", summary["stage_seconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
