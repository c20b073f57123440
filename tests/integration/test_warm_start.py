"""Warm starts: the compile-artifacts file (header, checks, refusals) and a save/load round trip between two
processes on the CPU.

The fast tests stand in for torch's `save_cache_artifacts` / `load_cache_artifacts` (they check cachelife's
file, not torch's bytes); the slow one compiles a tiny T5 in one process, saves, and loads in another process
that has an empty compile-cache directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import cachelife
from cachelife.errors import CompileArtifactsFormatError, CompileArtifactsMismatchError, NoCompileArtifactsError
from cachelife.integration.warm_start import MAGIC

SOURCE = Path(__file__).resolve().parents[2] / "src"
PAYLOAD = b"torch's serialized artifacts\n\x00\x01 with any bytes"


class FakeInfo:
    """What torch's `save_cache_artifacts` returns beside the bytes: the keys saved per kind of cache."""

    def __init__(self) -> None:
        self.artifacts: defaultdict[str, list[str]] = defaultdict(list)
        self.artifacts["inductor"] = ["key-a", "key-b"]
        self.artifacts["aot_autograd"] = ["key-c"]


@pytest.fixture
def torch_artifacts(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """torch's save returns PAYLOAD; its load records what it was given (returned: the list of loads)."""
    loaded: list[bytes] = []

    def load(payload: bytes) -> FakeInfo:
        loaded.append(payload)
        return FakeInfo()

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (PAYLOAD, FakeInfo()))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load)
    return loaded


@contextlib.contextmanager
def compile_cache_tag(tag: str) -> Iterator[None]:
    """torch's compile-cache tag set to `tag` for a while (a user's own, or TORCH_COMPILE_CACHE_KEY_TAG)."""
    before = torch.compiler.config.cache_key_tag
    torch.compiler.config.cache_key_tag = tag
    try:
        yield
    finally:
        torch.compiler.config.cache_key_tag = before


def rewrite_header(path: Path, **changes: Any) -> None:
    """Change fields of a saved file's header line (the documented format: magic line, JSON line, payload)."""
    header_line, _, payload = path.read_bytes().removeprefix(MAGIC).partition(b"\n")
    header = {**json.loads(header_line), **changes}
    path.write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + payload)


def test_the_header_names_torch_cachelife_device_and_payload(tmp_path: Path, torch_artifacts: list[bytes]) -> None:
    path = tmp_path / "warm.artifacts"
    with cachelife.pinned_compile_cache():  # saved from inside the namespace: the tag recorded is the user's
        header = cachelife.save_compile_artifacts(path)
    assert header == cachelife.read_compile_artifacts_header(path)
    assert (header.torch, header.cachelife, header.device_type) == (
        torch.__version__,
        cachelife.__version__,
        "cuda" if torch.cuda.is_available() else "cpu",
    )
    assert (header.cache_key_tag, header.payload_bytes) == ("", len(PAYLOAD))
    assert header.artifacts == {"aot_autograd": 1, "inductor": 2}
    assert path.read_bytes().startswith(MAGIC)
    assert path.read_bytes().endswith(PAYLOAD)
    assert [p.name for p in tmp_path.iterdir()] == ["warm.artifacts"]  # no partial file left behind


def test_the_tag_recorded_is_the_users_own_without_cachelifes_part(
    tmp_path: Path, torch_artifacts: list[bytes]
) -> None:
    with compile_cache_tag("deployment-7"), cachelife.pinned_compile_cache():
        assert torch.compiler.config.cache_key_tag == "deployment-7+cachelife-pinned-caches"
        header = cachelife.save_compile_artifacts(tmp_path / "warm.artifacts")
    assert header.cache_key_tag == "deployment-7"


def test_load_hands_torch_exactly_the_saved_bytes(tmp_path: Path, torch_artifacts: list[bytes]) -> None:
    path = tmp_path / "warm.artifacts"
    saved = cachelife.save_compile_artifacts(path)
    assert cachelife.load_compile_artifacts(path) == saved
    assert torch_artifacts == [PAYLOAD]


def test_another_torch_version_is_refused_naming_both(tmp_path: Path, torch_artifacts: list[bytes]) -> None:
    path = tmp_path / "warm.artifacts"
    cachelife.save_compile_artifacts(path)
    rewrite_header(path, torch="2.11.0+cu130")
    with pytest.raises(CompileArtifactsMismatchError, match=r"torch '2\.11\.0\+cu130'") as raised:
        cachelife.load_compile_artifacts(path)
    assert isinstance(raised.value, RuntimeError)
    assert repr(torch.__version__) in str(raised.value)
    assert torch_artifacts == []  # nothing reached torch's caches


def test_another_device_type_is_refused_naming_both(tmp_path: Path, torch_artifacts: list[bytes]) -> None:
    path = tmp_path / "warm.artifacts"
    header = cachelife.save_compile_artifacts(path)
    rewrite_header(path, device_type="xpu")
    with pytest.raises(CompileArtifactsMismatchError, match=r"compiled on 'xpu'") as raised:
        cachelife.load_compile_artifacts(path)
    assert repr(header.device_type) in str(raised.value)
    assert torch_artifacts == []


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda content: b"not artifacts\n" + content, "not compile artifacts"),
        (lambda content: content[:-3], "damaged or cut short"),
        (lambda content: content[:-3] + b"xyz", "damaged or cut short"),
        (lambda content: MAGIC + b"{not json\n" + PAYLOAD, "expected a JSON header"),
    ],
    ids=["foreign file", "truncated", "altered", "bad header"],
)
def test_a_damaged_file_is_refused(tmp_path: Path, torch_artifacts: list[bytes], damage: Any, match: str) -> None:
    path = tmp_path / "warm.artifacts"
    cachelife.save_compile_artifacts(path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CompileArtifactsFormatError, match=match) as raised:
        cachelife.load_compile_artifacts(path)
    assert isinstance(raised.value, ValueError)
    assert torch_artifacts == []


def test_another_format_version_is_refused(tmp_path: Path, torch_artifacts: list[bytes]) -> None:
    path = tmp_path / "warm.artifacts"
    cachelife.save_compile_artifacts(path)
    rewrite_header(path, format_version=99)
    with pytest.raises(CompileArtifactsFormatError, match=r"expected compile-artifacts format 1 .* got 99"):
        cachelife.read_compile_artifacts_header(path)


def test_saving_before_anything_compiled_raises_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    with pytest.raises(NoCompileArtifactsError, match="warm up first"):
        cachelife.save_compile_artifacts(tmp_path / "warm.artifacts")
    assert list(tmp_path.iterdir()) == []


def test_loading_under_another_compile_cache_tag_warns_naming_both(
    tmp_path: Path, torch_artifacts: list[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "warm.artifacts"
    cachelife.save_compile_artifacts(path)
    with compile_cache_tag("deployment-7"), caplog.at_level(logging.WARNING, logger="cachelife"):
        cachelife.load_compile_artifacts(path)
    assert [record.levelname for record in caplog.records] == ["WARNING"]
    assert "tag '', this process has 'deployment-7'" in caplog.records[0].getMessage()
    assert torch_artifacts == [PAYLOAD]  # loaded all the same: the tag may still be set before compiling


# One process of the round trip: `save` compiles and saves, `load` loads and then compiles. Both decode on an
# enabled model, so every graph is compiled (or looked up) in cachelife's namespace: with `generate` and a
# compiled forward, or with `cachelife.generate` and its compiled steps.
CHILD = """
import json, sys, time
import torch
from torch._dynamo.utils import counters
import cachelife
from cachelife.tools import zoo

role, path, caller = sys.argv[1], sys.argv[2], sys.argv[3]
if role == "load":
    cachelife.load_compile_artifacts(path)
built = zoo.build("t5")
model = built.model
cachelife.enable(model)
settings = dict(do_sample=False, max_new_tokens=8, min_new_tokens=8)
started = time.perf_counter()
if caller == "generate":
    cachelife.compile_forward(model, fullgraph=True)
    tokens = zoo.generate_tokens(model, built.inputs(2, 9, 1), cache_implementation="static", **settings)
else:
    tokens = cachelife.generate(model, fallback=False, **built.inputs(2, 9, 1), **settings)
seconds = time.perf_counter() - started
if role == "save":
    cachelife.save_compile_artifacts(path)
hits = {name: dict(counters[name]) for name in ("inductor", "aot_autograd")}
print("RESULT " + json.dumps({"tokens": tokens.tolist(), "seconds": seconds, "counters": hits}))
"""


def run_child(role: str, artifacts: Path, cache_dir: Path, caller: str = "generate") -> dict[str, Any]:
    env = {
        **os.environ,
        "PYTHONPATH": f"{SOURCE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "TRITON_CACHE_DIR": str(cache_dir / "triton"),
    }
    command = [sys.executable, "-c", CHILD, role, str(artifacts), caller]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1].removeprefix("RESULT "))
    return result


def cache_counts(result: dict[str, Any]) -> dict[str, int]:
    inductor, aot = result["counters"]["inductor"], result["counters"]["aot_autograd"]
    return {
        "hits": inductor.get("fxgraph_cache_hit", 0) + aot.get("autograd_cache_hit", 0),
        "misses": inductor.get("fxgraph_cache_miss", 0) + aot.get("autograd_cache_miss", 0),
    }


@pytest.mark.exhaustive
@pytest.mark.slow
def test_artifacts_saved_in_one_process_warm_another_with_an_empty_cache(tmp_path: Path) -> None:
    artifacts = tmp_path / "t5.artifacts"
    saving = run_child("save", artifacts, tmp_path / "cache-a")
    loading = run_child("load", artifacts, tmp_path / "cache-b")
    assert loading["tokens"] == saving["tokens"]
    assert cache_counts(saving)["hits"] == 0
    assert cache_counts(saving)["misses"] > 0
    assert cache_counts(loading) == {"hits": cache_counts(loading)["hits"], "misses": 0}
    assert cache_counts(loading)["hits"] > 0
    # How much faster the warm first call is, is a benchmark's question, not a test's verdict.


@pytest.mark.exhaustive
@pytest.mark.slow
def test_cachelife_generates_steps_are_served_by_artifacts_saved_in_another_process(tmp_path: Path) -> None:
    """`cachelife.generate`'s compiled step is found in every cache the artifacts carry, AOTAutograd's too
    (its attention restriction's calls are marked cacheable): nothing is compiled again after the load."""
    artifacts = tmp_path / "t5-steps.artifacts"
    saving = run_child("save", artifacts, tmp_path / "cache-a", caller="cachelife")
    loading = run_child("load", artifacts, tmp_path / "cache-b", caller="cachelife")
    assert loading["tokens"] == saving["tokens"]
    assert saving["counters"]["aot_autograd"].get("autograd_cache_saved", 0) > 0
    assert loading["counters"]["aot_autograd"].get("autograd_cache_hit", 0) > 0
    assert cache_counts(loading)["misses"] == 0
