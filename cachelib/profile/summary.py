"""Per-strategy summary of a profile: the numbers a reader compares first."""

from __future__ import annotations

import pandas as pd

from .store import Profile

SUMMARY_COLUMNS = [
    "strategy",
    "steps",
    "peak_bytes_allocated",
    "peak_bytes_used",
    "bytes_per_token",
    "mean_kl",
    "max_kl",
    "top1_agreement",
    "mean_logprob_target",
    "decode_tokens_per_second",
    "memory_saved",
    "first_departure_step",
]


def summarize(profile: Profile) -> pd.DataFrame:
    """One row per strategy, in run order. ``memory_saved`` is relative to the baseline's peak."""
    steps = profile.frame("steps")
    rows = []
    for label in profile.strategies:
        s = steps[steps["strategy"] == label]
        if s.empty:
            continue
        decode = s[s["phase"] == "decode"]
        last = s.iloc[-1]
        held = last["position"] + 1 if pd.notna(last["position"]) else None
        peak = s["cache_bytes_allocated"].max()
        departed = s[s["departed"].fillna(False).astype(bool)]
        rows.append(
            {
                "strategy": label,
                "steps": len(s),
                "peak_bytes_allocated": _int(peak),
                "peak_bytes_used": _int(s["cache_bytes_used"].max()),
                "bytes_per_token": float(peak) / held if held and pd.notna(peak) else None,
                "mean_kl": _float(decode["kl"].mean() if len(decode) else s["kl"].mean()),
                "max_kl": _float(s["kl"].max()),
                "top1_agreement": _float((decode if len(decode) else s)["top1_agree"].astype("Float64").mean()),
                "mean_logprob_target": _float(s["logprob_target"].mean()),
                "decode_tokens_per_second": _float(decode["tokens_per_second"].median()),
                "first_departure_step": _int(departed["step"].min()) if len(departed) else None,
            }
        )
    out = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    if len(out) and pd.notna(out.loc[0, "peak_bytes_allocated"]) and out.loc[0, "peak_bytes_allocated"]:
        base = float(out.loc[0, "peak_bytes_allocated"])
        out["memory_saved"] = 1.0 - out["peak_bytes_allocated"].astype(float) / base
    return out


def verdict(row: pd.Series, baseline: str) -> str:
    """Plain words: "saved 62% memory for 0.013 nats mean KL (top-1 agreement 97%)"."""
    if row["strategy"] == baseline:
        return "baseline"
    saved = row.get("memory_saved")
    parts = []
    if saved is not None and pd.notna(saved):
        parts.append(f"saved {saved:.0%} memory" if saved >= 0 else f"used {-saved:.0%} more memory")
    if pd.notna(row.get("mean_kl")):
        parts.append(f"for {row['mean_kl']:.3g} nats mean KL")
    if pd.notna(row.get("top1_agreement")):
        parts.append(f"(top-1 agreement {row['top1_agreement']:.0%})")
    return " ".join(parts) or "no comparable numbers"


def _int(v):
    return None if v is None or pd.isna(v) else int(v)


def _float(v):
    return None if v is None or pd.isna(v) else float(v)
