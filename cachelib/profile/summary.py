"""Per-strategy summary of a profile: the numbers a reader compares first.

One definition of what a strategy costs and saves, for the app, the CLI and the reports:

- **bytes per token** = the cache's bytes *used* / the tokens it holds, at the last step the
  memory probe recorded (what a held token costs; the allocation is reported separately).
- **memory saved** = 1 - bytes used / the *full cache's* bytes used at the same step, where the
  full cache is a cache in the run's dtype holding every token so far in every layer
  (:func:`full_cache_bytes_per_token` x tokens, the planner's exact rule). The dtype is part of
  the claim: a 4-bit cache saves more against a float32 cache than against a float16 one, so the
  summary names it (``saved_against``). Without the cache geometry (a recurrent model) the
  baseline's recorded bytes at that step stand in, and ``saved_against`` says so.
"""

from __future__ import annotations

import pandas as pd

from ..plan import Arch, kv_bytes_per_token
from .store import Profile

SUMMARY_COLUMNS = [
    "strategy",
    "steps",
    "peak_bytes_allocated",
    "peak_bytes_used",
    "memory_step",  # the last step the memory probe recorded: where the next four are read
    "tokens",  # tokens fed so far at memory_step (what a full cache would hold)
    "tokens_held",
    "bytes_used",
    "bytes_per_token",  # bytes_used / tokens_held
    "full_bytes_used",  # the full cache's bytes used at memory_step, in the run's dtype
    "memory_saved",  # 1 - bytes_used / full_bytes_used
    "saved_against",  # what full_bytes_used is: "float32 full cache" (or "baseline")
    "mean_kl",
    "max_kl",
    "top1_agreement",
    "mean_logprob_target",
    "decode_tokens_per_second",
    "first_departure_step",
]


def full_cache_bytes_per_token(meta: dict) -> int | None:
    """Bytes per token of a full cache of the profile's recorded geometry in its dtype:
    2 (K and V) x layers x KV heads x head_dim x element size, the planner's
    :func:`~cachelib.plan.kv_bytes_per_token`. None when the profile lacks the geometry or the
    dtype is one the planner does not know."""
    try:
        layers, heads, dim = (int(meta.get(k) or 0) for k in ("num_layers", "num_kv_heads", "head_dim"))
    except (TypeError, ValueError):
        return None
    if min(layers, heads, dim) < 1:
        return None
    # Query heads and hidden size are not recorded and do not enter the cache's bytes.
    arch = Arch(
        name=str(meta.get("model", "")),
        model_type=str(meta.get("architecture", "")),
        num_layers=layers,
        hidden_size=heads * dim,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=dim,
        layer_kinds=("full",) * layers,
    )
    try:
        return kv_bytes_per_token(arch, str(meta.get("dtype", "")))
    except ValueError:  # a dtype the planner does not know
        return None


def summarize(profile: Profile, steps: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per strategy, in run order (columns: :data:`SUMMARY_COLUMNS`; the module
    docstring defines bytes per token and memory saved). ``steps`` stands in for the profile's
    steps table (a live snapshot, or a table read on its own)."""
    steps = profile.frame("steps") if steps is None else steps
    per_token = full_cache_bytes_per_token(profile.meta)
    dtype = str(profile.meta.get("dtype", "") or "")
    base_used = _used_by_step(steps[steps["strategy"] == profile.baseline])
    rows = []
    for label in profile.strategies:
        s = steps[steps["strategy"] == label]
        if s.empty:
            continue
        decode = s[s["phase"] == "decode"]
        departed = s[s["departed"].fillna(False).astype(bool)]
        row = {
            "strategy": label,
            "steps": len(s),
            "peak_bytes_allocated": _int(s["cache_bytes_allocated"].max()),
            "peak_bytes_used": _int(s["cache_bytes_used"].max()),
            "mean_kl": _float(decode["kl"].mean() if len(decode) else s["kl"].mean()),
            "max_kl": _float(s["kl"].max()),
            "top1_agreement": _float((decode if len(decode) else s)["top1_agree"].astype("Float64").mean()),
            "mean_logprob_target": _float(s["logprob_target"].mean()),
            "decode_tokens_per_second": _float(decode["tokens_per_second"].median()),
            "first_departure_step": _int(departed["step"].min()) if len(departed) else None,
        }
        row.update(_memory_at_last_sample(s, per_token, dtype, base_used))
        rows.append(row)
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def _used_by_step(rows: pd.DataFrame) -> dict[int, int]:
    rows = rows[rows["cache_bytes_used"].notna()]
    return {int(k): int(v) for k, v in zip(rows["step"], rows["cache_bytes_used"])}


def _memory_at_last_sample(s: pd.DataFrame, per_token: int | None, dtype: str, base_used: dict[int, int]) -> dict:
    """Bytes used, tokens held, bytes per token and memory saved at the strategy's last step
    with a memory sample (sampled probes leave the other steps empty)."""
    sampled = s[s["cache_bytes_used"].notna()]
    if sampled.empty:
        return {}
    last = sampled.iloc[-1]
    used = int(last["cache_bytes_used"])
    held = _int(last["cache_tokens_held"])
    tokens = int(last["position"]) + 1 if pd.notna(last["position"]) else None
    out = {
        "memory_step": int(last["step"]),
        "tokens": tokens,
        "tokens_held": held,
        "bytes_used": used,
        "bytes_per_token": used / held if held else None,
    }
    if per_token is not None and tokens:
        full, against = per_token * tokens, f"{dtype} full cache".strip()
    elif int(last["step"]) in base_used:
        full, against = base_used[int(last["step"])], "baseline"
    else:
        return out
    if full:
        out.update(full_bytes_used=full, memory_saved=1.0 - used / full, saved_against=against)
    return out


def verdict(row: pd.Series, baseline: str) -> str:
    """Plain words: "saved 62% memory vs a float32 full cache at 104 tokens, for 0.013 nats mean
    KL (top-1 agreement 97%)" — what was saved, against what, where it was measured."""
    if row["strategy"] == baseline:
        return "baseline"
    saved = row.get("memory_saved")
    parts = []
    if saved is not None and pd.notna(saved):
        amount = f"saved {saved:.0%} memory" if saved >= 0 else f"used {-saved:.0%} more memory"
        against = row.get("saved_against") or "full cache"
        against = "the baseline" if against == "baseline" else f"a {against}"
        tokens = row.get("tokens")
        at = f" at {int(tokens):,} tokens" if tokens is not None and pd.notna(tokens) else ""
        parts.append(f"{amount} vs {against}{at}")
    quality = []
    if pd.notna(row.get("mean_kl")):
        quality.append(f"for {row['mean_kl']:.3g} nats mean KL")
    if pd.notna(row.get("top1_agreement")):
        quality.append(f"(top-1 agreement {row['top1_agreement']:.0%})")
    if quality:
        parts.append(" ".join(quality))
    return ", ".join(parts) or "no comparable numbers"


def _int(v):
    return None if v is None or pd.isna(v) else int(v)


def _float(v):
    return None if v is None or pd.isna(v) else float(v)
