"""The profiler: record what every cache does, per layer and per step, during real decodes.

``run_profile(model, strategies, prompt=... | text=..., max_tokens=...)`` -> :class:`Profile`;
``load_profile(path)`` / ``save_profile(profile, path)`` for CSV (and Parquet);
``summarize(profile)`` for the per-strategy table. Column meanings: ``profiles/README.md``.
"""

from .guard import parse_memory_limit
from .probes import PROBE_HELP, Probes
from .run import StepEvent, default_profile_name, run_profile, strategy_labels
from .schema import SCHEMA_VERSION, TABLES
from .store import Profile, load_profile, save_profile
from .summary import summarize, verdict

__all__ = [
    "run_profile",
    "StepEvent",
    "Probes",
    "PROBE_HELP",
    "Profile",
    "load_profile",
    "save_profile",
    "summarize",
    "verdict",
    "SCHEMA_VERSION",
    "TABLES",
    "parse_memory_limit",
    "default_profile_name",
    "strategy_labels",
]
