"""The profiler: record what every cache does, per layer and per step, during real decodes.

``run_profile(model, strategies, prompt=... | text=..., max_tokens=...)`` -> :class:`Profile`;
``load_profile(path)`` / ``save_profile(profile, path)`` for CSV (and Parquet);
``list_profiles(folder)`` and ``read_meta(path)`` for listings;
``summarize(profile)`` for the per-strategy table. Column meanings: ``profiles/README.md``.
"""

from .evidence import collect_evidence, measured_quality  # the planner's evidence, read from profiles
from .guard import parse_memory_limit
from .probes import PROBE_HELP, Probes
from .run import StepEvent, default_profile_name, run_profile, strategy_labels
from .schema import SCHEMA_VERSION, TABLES
from .store import Profile, ProfileFile, list_profiles, load_profile, read_meta, save_profile
from .summary import summarize, verdict

__all__ = [
    "run_profile",
    "StepEvent",
    "Probes",
    "PROBE_HELP",
    "Profile",
    "load_profile",
    "save_profile",
    "ProfileFile",
    "list_profiles",
    "read_meta",
    "summarize",
    "verdict",
    "SCHEMA_VERSION",
    "TABLES",
    "parse_memory_limit",
    "default_profile_name",
    "strategy_labels",
]
