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

import importlib
import sys
import types

# Every name below is imported from its module on first use (PEP 562), so that a light reader (the
# planner's cached evidence) does not pay for pandas, the models and the run loop: name -> module.
_LAZY = {
    "DEFAULT_EVIDENCE": "evidence",
    "EvidenceSet": "evidence",
    "load_evidence": "evidence",
    "EvaluationInterrupted": "evaluate",
    "EvaluationStep": "evaluate",
    "evaluate": "evaluate",
    "teacher_forced_logits": "evaluate",
    "Evaluation": "evaluation_file",
    "load_evaluation": "evaluation_file",
    "save_evaluation": "evaluation_file",
    "parse_memory_limit": "guard",
    "PROBE_HELP": "probes",
    "Probes": "probes",
    "retrieval": "retrieval",
    "StepEvent": "run",
    "check_distinct": "run",
    "default_profile_name": "run",
    "run_profile": "run",
    "strategy_labels": "run",
    "SCHEMA_VERSION": "schema",
    "TABLES": "schema",
    "Profile": "store",
    "ProfileFile": "store",
    "list_profiles": "store",
    "load_profile": "store",
    "read_meta": "store",
    "save_profile": "store",
    "summarize": "summary",
    "verdict": "summary",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """``evaluate`` and ``retrieval`` name the functions, as they did when this package imported them
    eagerly: importing their modules must not replace the functions with the modules."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and name in ("evaluate", "retrieval"):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = [
    "DEFAULT_EVIDENCE",
    "EvidenceSet",
    "load_evidence",
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
