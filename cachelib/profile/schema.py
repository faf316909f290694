"""The profile's tables and their columns: the versioned schema of what a run records.

A profile is five tidy tables. On disk they share one long CSV (or Parquet) file whose first
column, ``table``, says which table a row belongs to; each table uses its own subset of the
columns and leaves the others empty. ``profiles/README.md`` documents every column; this module
is the machine-readable form of that page and the only place the column lists live.
"""

from __future__ import annotations

SCHEMA_VERSION = 1

# dtype codes: "int" (nullable integer), "float", "str", "bool" (stored as 0/1)
TABLES: dict[str, dict[str, str]] = {
    # One row per key: what was run, on what, and how it ended.
    "meta": {"key": "str", "value": "str"},
    # One row per strategy x step.
    "steps": {
        "strategy": "str",
        "step": "int",
        "phase": "str",  # prefill | decode
        "position": "int",  # absolute position of the last token fed this step
        "tokens_in": "int",  # tokens fed this step (prompt length at prefill, then 1)
        "token_id": "int",  # the token this strategy predicts next (greedy)
        "wall_seconds": "float",
        "tokens_per_second": "float",
        "cache_tokens_held": "int",  # max over layers
        "cache_bytes_used": "int",  # sum over layers
        "cache_bytes_allocated": "int",
        "device_active_bytes": "int",  # empty where the device has no allocator counters
        "device_peak_bytes": "int",
        "rss_bytes": "int",
        "kl": "float",  # KL(baseline || strategy) of the next-token distributions, nats
        "top1_agree": "bool",
        "logprob_target": "float",  # log-prob the strategy gives the baseline's (or the text's) next token
        "departed": "bool",  # free-running only: this strategy's tokens have left the baseline's
        "score_seconds": "float",  # importance caches: time spent scoring keys this step, sum over layers
    },
    # One row per strategy x step x layer: what each layer cache holds.
    "layers": {
        "strategy": "str",
        "step": "int",
        "layer": "int",
        "kind": "str",
        "offset": "int",
        "tokens_held": "int",
        "capacity": "int",
        "max_capacity": "int",
        "bytes_used": "int",
        "bytes_allocated": "int",
        "write_index": "int",
        "keep": "int",
        "evicted": "int",
        "key_bits": "int",
        "value_bits": "int",
        "group_size": "int",
        "quantized_tokens": "int",
        "key_rel_rms": "float",
        "key_max_abs": "float",
        "value_rel_rms": "float",
        "value_max_abs": "float",
    },
    # Sampled: absolute position held in each slot of a ring-buffer cache (-1: empty), and of an
    # importance cache, one row per KV head (batch row 0).
    "slots": {
        "strategy": "str",
        "step": "int",
        "layer": "int",
        "head": "int",  # importance caches only: the KV head whose slots the row lists
        "write_index": "int",
        "keep": "int",
        "positions": "str",  # space-separated, one per slot, slot order
    },
    # Sampled: the boolean attention mask the cache produced, one row per query.
    "masks": {
        "strategy": "str",
        "step": "int",
        "layer": "int",
        "query": "int",  # row index within this step's queries
        "query_position": "int",
        "mask": "str",  # "1"/"0" per key, in the key order the cache returned (slot order)
        "key_positions": "str",  # absolute position of each key in that order, space-separated
    },
}

COLUMNS: list[str] = ["table"]
for _cols in TABLES.values():
    for _c in _cols:
        if _c not in COLUMNS:
            COLUMNS.append(_c)

DTYPES: dict[str, str] = {c: t for cols in TABLES.values() for c, t in cols.items()}

# Columns added within schema v1 (importance caches, issue 14): a file written before them has
# none, and reads with them empty.
ADDED_IN_V1 = ("head", "score_seconds")

META_REQUIRED = ("schema_version", "status", "backend", "model", "strategies", "baseline")
STATUSES = ("running", "complete", "incomplete")

# What the reader accepts beyond each column's type (a column means one thing in every table).
# Integers fit int64 and floats are finite everywhere, except the values NONFINITE lists;
# LIMITS bounds numbers (inclusive; None: open).
_COUNTS = (
    "step",
    "layer",
    "query",
    "tokens_in",
    "token_id",
    "cache_tokens_held",
    "cache_bytes_used",
    "cache_bytes_allocated",
    "device_active_bytes",
    "device_peak_bytes",
    "rss_bytes",
    "offset",
    "tokens_held",
    "capacity",
    "max_capacity",
    "bytes_used",
    "bytes_allocated",
    "write_index",
    "keep",
    "evicted",
    "key_bits",
    "value_bits",
    "group_size",
    "quantized_tokens",
    "wall_seconds",
    "tokens_per_second",
    "kl",
    "key_rel_rms",
    "key_max_abs",
    "value_rel_rms",
    "value_max_abs",
    "head",
    "score_seconds",
)
LIMITS: dict[str, tuple[float | None, float | None]] = {c: (0, None) for c in _COUNTS}
LIMITS["logprob_target"] = (None, 0)
NONFINITE: dict[str, tuple[float, ...]] = {"logprob_target": (float("-inf"),)}  # a token the strategy rules out
# Text columns with a grammar: (regular expression, what it is called in an error).
PATTERNS: dict[str, tuple[str, str]] = {
    "phase": (r"prefill|decode", "a phase (prefill or decode)"),
    "mask": (r"[01]*", "a mask of 0s and 1s"),
    "positions": (r"(-?\d+( -?\d+)*)?", "space-separated token positions"),
    "key_positions": (r"(-?\d+( -?\d+)*)?", "space-separated token positions"),
}
# Cells every row of a table has.
REQUIRED: dict[str, tuple[str, ...]] = {
    "steps": ("strategy", "step", "phase", "position", "tokens_in", "token_id"),
    "layers": ("strategy", "step", "layer", "kind", "offset", "tokens_held", "bytes_used", "bytes_allocated"),
    "slots": ("strategy", "step", "layer"),
    "masks": ("strategy", "step", "layer", "query", "query_position", "mask"),
}
