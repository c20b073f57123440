"""cachelife's version, in the lowest layer so that every module can record it."""

from __future__ import annotations

__version__ = "0.2.0"
