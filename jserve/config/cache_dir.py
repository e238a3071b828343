"""Where jserve keeps what it builds once and reuses: converted models, XLA executables, native
kernels."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$JSERVE_CACHE_DIR, else $XDG_CACHE_HOME/jserve, else ~/.cache/jserve."""
    if env := os.environ.get("JSERVE_CACHE_DIR"):
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "jserve"
