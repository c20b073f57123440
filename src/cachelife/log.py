"""cachelife's logging: the `cachelife` logger namespace, silent by default.

Every transition logs one DEBUG line under `cachelife.core.layer_lifecycle`; late pins at the decoding
boundary log a WARNING under `cachelife.integration.guard`. The library installs no handler of its own:
configure logging as usual, or opt in with `enable_debug_logging()` or the environment variable
`CACHELIFE_LOG=debug` (any level name works), which attach one stderr handler to the `cachelife` logger, as
urllib3's `add_stderr_logger` does.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import TextIO

LOGGER_NAME = "cachelife"
ENVIRONMENT_VARIABLE = "CACHELIFE_LOG"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The handler `enable_debug_logging` attached, so a second call replaces it instead of adding another.
_installed: logging.Handler | None = None


def enable_debug_logging(level: int | str = logging.DEBUG, stream: TextIO | None = None) -> logging.Handler:
    """Send cachelife's log lines at `level` and above to `stream` (stderr by default).

    Returns the handler, so a caller can remove it again with `disable_debug_logging()`.
    """
    global _installed  # noqa: PLW0603 - one process-wide opt-in handler, replaced on every call
    disable_debug_logging()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger = logging.getLogger(LOGGER_NAME)
    logger.addHandler(handler)
    logger.setLevel(level)
    _installed = handler
    return handler


def disable_debug_logging() -> None:
    """Remove the handler `enable_debug_logging` attached and give the level back to the root logger."""
    global _installed  # noqa: PLW0603 - see enable_debug_logging
    logger = logging.getLogger(LOGGER_NAME)
    if _installed is not None:
        logger.removeHandler(_installed)
        _installed = None
    logger.setLevel(logging.NOTSET)


def configure_from_environment() -> None:
    """Honour `CACHELIFE_LOG=<level>` (debug, info, warning, ...); an unknown level only warns."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    if not value:
        return
    level = logging.getLevelName(value.upper())
    if not isinstance(level, int):
        warnings.warn(
            f"{ENVIRONMENT_VARIABLE}={value!r} is not a logging level; expected debug, info, warning or error",
            stacklevel=2,
        )
        return
    enable_debug_logging(level)
