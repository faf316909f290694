"""Where cachelib keeps what it derives on this machine (its cache directory)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$CACHELIB_HOME``, else ``$XDG_CACHE_HOME/cachelib``, else ``~/.cache/cachelib``: converted
    tokenizers, the bundled model's weights as loaded (:mod:`cachelib.models.weights_cache`), the
    preset model folders, the planner's evidence as read and this CPU's speed probe live there."""
    root = os.environ.get("CACHELIB_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "cachelib"
    )
    return Path(root)
