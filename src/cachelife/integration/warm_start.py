"""Warm starts: carrying torch's compile caches to another process or machine, so that a deployment compiles once.

`save_compile_artifacts(path)` after warm-up writes every compiled graph this process made or loaded from a
cache (torch's `torch.compiler.save_cache_artifacts()`: inductor's FX-graph entries, AOTAutograd entries,
autotuning results, dynamo's profile of dynamic shapes); `load_compile_artifacts(path)` in another process,
before its first compiled call, writes them into that process's compile caches
(`torch.compiler.load_cache_artifacts`), where the first call finds them instead of compiling. Dynamo still
traces the model in the new process, and CUDA graphs are still recorded; inductor's code generation and
compilation are what the artifacts save.

The file is cachelife's: a first line naming the format, one line of JSON (the header: format version, torch
and cachelife versions, device type and name, the compile-cache tag, the payload's size and SHA-256), then
torch's bytes. torch only reuses graphs compiled by the same torch build (its cache keys hash torch itself),
so loading artifacts saved by another torch version, or for another device type, raises
`CompileArtifactsMismatchError` instead of loading entries that would never be found.

Graphs compiled inside `pinned_compile_cache()` (every `generate` of an enabled model, `cachelife.generate`)
are keyed under cachelife's tag; the loading process finds them when it decodes through cachelife too. The
header records the tag outside cachelife's part (`TORCH_COMPILE_CACHE_KEY_TAG`, say); loading under another
one logs a WARNING, since no saved graph would match.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from attrs import asdict, frozen

from cachelife.errors import CompileArtifactsFormatError, CompileArtifactsMismatchError, NoCompileArtifactsError
from cachelife.integration.compile_cache import base_tag
from cachelife.version import __version__

logger = logging.getLogger(__name__)

MAGIC = b"cachelife-compile-artifacts\n"
FORMAT_VERSION = 1


@frozen(kw_only=True)
class CompileArtifactsHeader:
    """What a compile-artifacts file says about itself; `artifacts` counts the entries per kind of cache."""

    format_version: int
    torch: str
    cachelife: str
    device_type: str
    device_name: str
    cache_key_tag: str
    payload_bytes: int
    payload_sha256: str
    artifacts: dict[str, int]


def save_compile_artifacts(path: str | os.PathLike[str]) -> CompileArtifactsHeader:
    """Write this process's compile artifacts to `path` (replacing it whole); call it after warm-up."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        msg = (
            "expected compiled graphs to save, but this process has compiled (or loaded from a compile cache) "
            "nothing yet: warm up first (one generate or decode call of each shape you will serve), then save"
        )
        raise NoCompileArtifactsError(msg)
    payload, info = saved
    header = CompileArtifactsHeader(
        format_version=FORMAT_VERSION,
        torch=torch.__version__,
        cachelife=__version__,
        device_type=_device_type(),
        device_name=_device_name(),
        cache_key_tag=base_tag(),
        payload_bytes=len(payload),
        payload_sha256=hashlib.sha256(payload).hexdigest(),
        artifacts=_counts(info),
    )
    _write_atomically(Path(path), MAGIC + json.dumps(asdict(header)).encode() + b"\n" + payload)
    logger.debug("saved compile artifacts to %s: %s", path, header.artifacts)
    return header


def load_compile_artifacts(path: str | os.PathLike[str]) -> CompileArtifactsHeader:
    """Put the compile artifacts saved at `path` into this process's compile caches; call it before the first
    compiled call. Raises `CompileArtifactsMismatchError` for another torch version or device type."""
    header, payload = _read(Path(path))
    _check_matches(header, path)
    if torch.compiler.load_cache_artifacts(payload) is None:
        msg = f"expected torch {header.torch} to read the compile artifacts in {str(path)!r}, but it could not"
        raise CompileArtifactsFormatError(msg)
    logger.debug("loaded compile artifacts from %s: %s", path, header.artifacts)
    return header


def read_compile_artifacts_header(path: str | os.PathLike[str]) -> CompileArtifactsHeader:
    """The header of the compile-artifacts file at `path`, checked against its payload; loads nothing."""
    return _read(Path(path))[0]


def _counts(info: object) -> dict[str, int]:
    """Entries per kind of cache, from torch's `CacheInfo` (informational: empty where a torch lacks the field)."""
    artifacts: Any = getattr(info, "artifacts", {})
    return {str(kind): len(keys) for kind, keys in sorted(artifacts.items())}


def _device_type() -> str:
    """The accelerator's type (cuda, xpu, mps, ...), or cpu where this process has none."""
    accelerator = torch.accelerator.current_accelerator()
    return "cpu" if accelerator is None else accelerator.type


def _device_name() -> str:
    return torch.cuda.get_device_name() if _device_type() == "cuda" else "cpu"


def _write_atomically(path: Path, content: bytes) -> None:
    """Write to a neighbour, then rename: a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_bytes(content)
    partial.replace(path)


def _read(path: Path) -> tuple[CompileArtifactsHeader, bytes]:
    content = path.read_bytes()
    if not content.startswith(MAGIC):
        msg = f"expected {str(path)!r} to start with {MAGIC!r}, got {content[: len(MAGIC)]!r}: not compile artifacts"
        raise CompileArtifactsFormatError(msg)
    header_line, _, payload = content[len(MAGIC) :].partition(b"\n")
    header = _parse_header(header_line, path)
    if len(payload) != header.payload_bytes or hashlib.sha256(payload).hexdigest() != header.payload_sha256:
        msg = (
            f"expected {header.payload_bytes} bytes of artifacts with SHA-256 {header.payload_sha256} in "
            f"{str(path)!r}, got {len(payload)} bytes that differ: the file is damaged or cut short; save it again"
        )
        raise CompileArtifactsFormatError(msg)
    return header, payload


def _parse_header(line: bytes, path: Path) -> CompileArtifactsHeader:
    try:
        fields: Any = json.loads(line)
        header = CompileArtifactsHeader(**fields)
    except (ValueError, TypeError) as error:
        msg = f"expected a JSON header with the fields of CompileArtifactsHeader in {str(path)!r}, got {line[:200]!r}"
        raise CompileArtifactsFormatError(msg) from error
    if header.format_version != FORMAT_VERSION:
        msg = (
            f"expected compile-artifacts format {FORMAT_VERSION} in {str(path)!r}, got {header.format_version!r}: "
            f"it was written by cachelife {header.cachelife}; save it again with this one"
        )
        raise CompileArtifactsFormatError(msg)
    return header


def _check_matches(header: CompileArtifactsHeader, path: str | os.PathLike[str]) -> None:
    """Refuse artifacts this process could never use; warn where they might go unused."""
    if header.torch != torch.__version__:
        msg = (
            f"expected compile artifacts saved by torch {torch.__version__!r} (this process's), but {str(path)!r} "
            f"was saved by torch {header.torch!r}; torch only reuses graphs compiled by the same build: warm up "
            "and save them again with this torch"
        )
        raise CompileArtifactsMismatchError(msg)
    if header.device_type != _device_type():
        msg = (
            f"expected compile artifacts saved for device type {_device_type()!r} (this process's), but "
            f"{str(path)!r} holds graphs compiled on {header.device_type!r}; save them on a machine of this kind"
        )
        raise CompileArtifactsMismatchError(msg)
    if header.device_name != _device_name():
        logger.warning(
            "compile artifacts in %s were saved on %r, this process runs on %r: graphs tuned for another device "
            "model are not found, and compile again",
            path,
            header.device_name,
            _device_name(),
        )
    if header.cache_key_tag != base_tag():
        logger.warning(
            "compile artifacts in %s were saved under the compile-cache tag %r, this process has %r: no saved "
            "graph will be found; set torch.compiler.config.cache_key_tag (TORCH_COMPILE_CACHE_KEY_TAG) as the "
            "saving process did",
            path,
            header.cache_key_tag,
            base_tag(),
        )
