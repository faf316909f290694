"""The profiler: record what every cache does, per layer and per step, during real decodes.

``run_profile(model, strategies, prompt=... | text=..., max_tokens=...)`` -> :class:`Profile`;
``load_profile(path)`` / ``save_profile(profile, path)`` for CSV (and Parquet);
``list_profiles(folder)`` and ``read_meta(path)`` for listings;
``summarize(profile)`` for the per-strategy table. Column meanings: ``profiles/README.md``.
``evaluate(model, strategies, context=...)`` -> :class:`Evaluation`: long-context quality (KL,
top-1, perplexity against the full cache, with 95% CIs); ``save_evaluation`` / ``load_evaluation``.
``retrieval(model, strategies, contexts=..., depths=...)`` -> :class:`Evaluation` of the
needle-in-a-haystack task (exact match per strategy x context x depth x trial).
"""

from .evidence import DEFAULT_EVIDENCE, EvidenceSet, load_evidence  # the planner's evidence, an explicit set of files
from .evaluate import EvaluationInterrupted, EvaluationStep, evaluate, teacher_forced_logits
from .evaluation import Evaluation, load_evaluation, save_evaluation
from .guard import parse_memory_limit
from .probes import PROBE_HELP, Probes
from .retrieval import retrieval
from .run import StepEvent, check_distinct, default_profile_name, run_profile, strategy_labels
from .schema import SCHEMA_VERSION, TABLES
from .store import Profile, ProfileFile, list_profiles, load_profile, read_meta, save_profile
from .summary import summarize, verdict

__all__ = [
    "retrieval",
    "evaluate",
    "Evaluation",
    "EvaluationStep",
    "EvaluationInterrupted",
    "load_evaluation",
    "save_evaluation",
    "teacher_forced_logits",
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
    "check_distinct",
    "strategy_labels",
]
