"""A long-context evaluation's result: its rows, its summary with 95% confidence intervals, and
its file.

An evaluation file is one CSV. Its first column, ``schema``, is ``cachelib-evaluation/1`` on
every row; ``kind`` says what a row is: ``sample`` (one strategy x text x window of
:func:`cachelib.profile.evaluate`) or ``retrieval`` (one trial of the retrieval task). Every row
has every column of :data:`COLUMNS`, empty where it does not apply; a file may carry more columns
(they are kept as read). :func:`save_evaluation` writes atomically; :func:`load_evaluation`
refuses a file of another schema, naming it, and gives back exactly what was saved. Text cells a
spreadsheet would run as a formula get a leading apostrophe on disk (:mod:`cachelib.core.cells`).

This module knows the columns and the statistics; it runs nothing.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pandas as pd

from ..core.cells import escape_cell, unescape_cell
from ..core.reader import check_regular

SCHEMA = "cachelib-evaluation/1"
KINDS = ("sample", "retrieval")

# Column -> type ("str" | "int" | "float"), in file order. One name per thing, as in profiles.
COLUMNS: dict[str, str] = {
    "schema": "str",
    "kind": "str",  # sample | retrieval
    "model": "str",
    "backend": "str",
    "device": "str",
    "dtype": "str",  # activation / KV dtype of the run
    "strategy": "str",  # canonical spec text
    "reference": "str",  # the full-cache strategy KL and delta-ppl are measured against
    "context": "int",  # tokens prefilled before scoring
    "score_tokens": "int",  # tokens scored teacher-forced after the prefill
    "prefill_chunk": "int",  # tokens per prefill forward pass
    "text": "str",  # the evaluation text's name
    "window_start": "int",  # token offset of the window in the tokenized text
    "mean_kl": "float",  # mean over scored tokens of KL(reference || strategy), nats
    "top1_agreement": "float",  # fraction of scored tokens whose argmax matches the reference's
    "nll": "float",  # mean negative log-likelihood of the text's true tokens, nats
    "nll_reference": "float",
    "ppl": "float",  # exp(nll)
    "ppl_reference": "float",
    "delta_ppl": "float",  # ppl - ppl_reference
    "kept_fraction": "float",  # min(1, tokens the strategy attends / context)
    "tokens_held": "int",  # tokens the cache holds at the end (max over layers)
    "bytes_allocated": "int",  # bytes the cache holds at the end (sum over layers)
    "seconds": "float",  # wall time of this strategy's prefill + scoring
    # retrieval rows
    "task": "str",
    "depth": "float",  # where the key sits in the context, 0 (start) .. 1 (end)
    "exact_match": "float",  # 1.0 when the answer came back exactly, else 0.0
}
SAMPLE_COLUMNS = tuple(c for c in COLUMNS if c not in ("task", "depth", "exact_match"))

# The summary's grouping: one row per measurement setting (model x backend x strategy x context;
# the scoring settings are constant within an ordinary file).
SUMMARY_KEYS = ("model", "backend", "dtype", "strategy", "context", "score_tokens", "prefill_chunk")
SUMMARY_COLUMNS = (
    *SUMMARY_KEYS,
    "n",  # windows x texts
    "mean_kl",
    "mean_kl_ci95",  # half-width of the 95% CI of the mean; NaN when n = 1
    "top1_agreement",
    "top1_ci95",
    "ppl",
    "ppl_reference",
    "delta_ppl",
    "delta_ppl_ci95",
    "kept_fraction",
)

# Two-sided 95% Student-t quantiles t(0.975, df), df = 1..30; beyond, a Cornish-Fisher expansion.
_T975 = (
    12.7062,
    4.3027,
    3.1824,
    2.7764,
    2.5706,
    2.4469,
    2.3646,
    2.3060,
    2.2622,
    2.2281,
    2.2010,
    2.1788,
    2.1604,
    2.1448,
    2.1314,
    2.1199,
    2.1098,
    2.1009,
    2.0930,
    2.0860,
    2.0796,
    2.0739,
    2.0687,
    2.0639,
    2.0595,
    2.0555,
    2.0518,
    2.0484,
    2.0452,
    2.0423,
)


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (scipy-free)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = statistics.NormalDist().inv_cdf(0.975)
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def ci95(values: Sequence[float]) -> float:
    """Half-width of the 95% confidence interval of the mean of ``values`` (Student t over the
    values, e.g. one per window); NaN for fewer than two values (no spread to measure)."""
    x = [float(v) for v in values if not math.isnan(float(v))]
    if len(x) < 2:
        return math.nan
    return t_quantile_975(len(x) - 1) * statistics.stdev(x) / math.sqrt(len(x))


@dataclass
class Evaluation:
    """The rows of an evaluation. ``samples``: one row per strategy x text x window (the
    columns of :data:`SAMPLE_COLUMNS`); ``retrieval``: the retrieval task's rows, if any.
    ``status`` is ``complete`` or ``incomplete`` (stopped, interrupted or failed: ``reason``)."""

    samples: pd.DataFrame
    retrieval: pd.DataFrame = field(default_factory=lambda: typed_frame([], "retrieval"))
    status: str = "complete"
    reason: str = ""
    path: Path | None = None  # the file it was written to or read from
    notes: dict[str, str] = field(default_factory=dict)  # strategy -> why it ran outside the strategy batch

    @property
    def complete(self) -> bool:
        return self.status == "complete"

    def summary(self) -> pd.DataFrame:
        """One row per model x backend x strategy x context: the mean over windows and texts of
        each quantity, with the 95% CI half-width where it has one. ``ppl`` and ``delta_ppl``
        are means of the per-window values, so ``delta_ppl == ppl - ppl_reference``."""
        return summarize_samples(self.samples)

    def rows(self) -> pd.DataFrame:
        """Every row of every kind, in the file's layout."""
        kinds = ((self.samples, "sample"), (self.retrieval, "retrieval"))
        parts = [typed_frame(f, kind) for f, kind in kinds if len(f)]
        if not parts:
            return typed_frame([], "sample")
        return pd.concat(parts, ignore_index=True).pipe(_ordered)


def summarize_samples(samples: pd.DataFrame) -> pd.DataFrame:
    """:meth:`Evaluation.summary` of a samples table."""
    out = []
    if len(samples):
        for keys, g in samples.groupby(list(SUMMARY_KEYS), sort=False, dropna=False):
            out.append(
                {
                    **dict(zip(SUMMARY_KEYS, keys)),
                    "n": len(g),
                    "mean_kl": g["mean_kl"].mean(),
                    "mean_kl_ci95": ci95(g["mean_kl"]),
                    "top1_agreement": g["top1_agreement"].mean(),
                    "top1_ci95": ci95(g["top1_agreement"]),
                    "ppl": g["ppl"].mean(),
                    "ppl_reference": g["ppl_reference"].mean(),
                    "delta_ppl": g["delta_ppl"].mean(),
                    "delta_ppl_ci95": ci95(g["delta_ppl"]),
                    "kept_fraction": g["kept_fraction"].mean(),
                }
            )
    frame = pd.DataFrame(out, columns=list(SUMMARY_COLUMNS))
    return frame.astype({"context": "Int64", "score_tokens": "Int64", "prefill_chunk": "Int64", "n": "int64"})


def typed_frame(rows: Iterable[dict] | pd.DataFrame, kind: str) -> pd.DataFrame:
    """``rows`` as a table of ``kind`` with the schema's types (extra columns kept as given)."""
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    frame = frame.reset_index(drop=True).copy()
    frame["schema"] = SCHEMA
    frame["kind"] = kind
    wanted = SAMPLE_COLUMNS if kind == "sample" else tuple(COLUMNS)
    for col in wanted:
        if col not in frame:
            frame[col] = None
    for col, kind_ in COLUMNS.items():
        if col in frame:
            frame[col] = _typed(frame[col], kind_)
    return _ordered(frame)


def _typed(s: pd.Series, kind: str) -> pd.Series:
    if kind == "int":
        return pd.to_numeric(s, errors="raise").astype("Int64")
    if kind == "float":
        return pd.to_numeric(s, errors="raise").astype("float64")
    return s.astype("string")


def _ordered(frame: pd.DataFrame) -> pd.DataFrame:
    known = [c for c in COLUMNS if c in frame]
    return frame[known + [c for c in frame if c not in COLUMNS]]


# --- the file ----------------------------------------------------------------------------------


def incomplete_path(path: str | os.PathLike) -> Path:
    """Where an unfinished run's rows go: ``NAME.csv`` -> ``NAME.incomplete.csv``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.incomplete{path.suffix}")


def save_evaluation(evaluation: Evaluation, path: str | os.PathLike) -> Path:
    """Write ``evaluation`` as one CSV, atomically (a temporary file in the same folder, then a
    rename): the file is either the old one or the whole new one."""
    path = Path(path)
    if path.suffix.lower() != ".csv":
        raise ValueError(f"evaluations are written as CSV; got {str(path)!r} (use a .csv name)")
    from .outputs import write_whole

    path.parent.mkdir(parents=True, exist_ok=True)
    rows = evaluation.rows()
    # repr of a float reads back as the same float: the round trip is exact
    text = rows.astype(object).where(rows.notna(), None).map(_cell).to_csv(index=False, lineterminator="\n")
    write_whole(path, text, "evaluation")  # errors name the path; no hidden file outlives one
    evaluation.path = path
    return path


def _read_kind(raw: pd.DataFrame, kind: str) -> pd.DataFrame:
    """The rows of one kind, typed; columns beyond the schema that are empty for this kind are
    dropped, and the others read as integers, numbers or text, whichever every value is."""
    raw = raw.reset_index(drop=True)
    unused = ("task", "depth", "exact_match") if kind == "sample" else ()
    for col in [c for c in raw if c not in COLUMNS or c in unused]:
        if raw[col].isna().all():
            raw = raw.drop(columns=col)
        elif col not in COLUMNS:
            raw[col] = _inferred(raw[col])
    return typed_frame(raw, kind)


_EMPTY: dict[str, pd.DataFrame] = {}


def _empty(kind: str) -> pd.DataFrame:
    """The typed table of ``kind`` with no rows (built once; a copy each time)."""
    if kind not in _EMPTY:
        _EMPTY[kind] = typed_frame([], kind)
    return _EMPTY[kind].copy()


def _inferred(s: pd.Series) -> pd.Series:
    for kind in ("int", "float"):
        try:
            return _typed(s, kind)
        except (ValueError, TypeError):
            continue
    return s.astype("string")


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, (float, np.floating)):
        return "" if math.isnan(value) else repr(float(value))
    return escape_cell(value) if isinstance(value, str) else str(value)


def load_evaluation(path: str | os.PathLike) -> Evaluation:
    """Read an evaluation file. A file of another schema or version is a ValueError naming it."""
    path = Path(path)
    label = str(path)
    try:
        check_regular(path, "evaluation")  # a named pipe would hang the reader, a device never end
        raw = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
    except FileNotFoundError:
        raise ValueError(f"{label}: no such evaluation file") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, OSError, ValueError) as e:
        raise ValueError(f"{label}: not a cachelib evaluation (cannot read it as a table: {e})") from None
    for col in raw.columns:  # unescape_cell, column by column on the few cells it changes (a cell-wise map is slow)
        escaped = raw[col].str.startswith("'", na=False)
        if escaped.any():
            raw.loc[escaped, col] = raw.loc[escaped, col].map(unescape_cell)
    if "schema" not in raw.columns:
        raise ValueError(f"{label}: not a cachelib evaluation (no 'schema' column; expected {SCHEMA})")
    found = sorted(set(raw["schema"].dropna()))
    if found != [SCHEMA]:
        what = ", ".join(found) or "empty"
        raise ValueError(f"{label}: evaluation schema {what} is not supported; this cachelib reads {SCHEMA}")
    kinds = raw["kind"] if "kind" in raw else pd.Series(dtype=str)
    unknown = sorted(set(kinds.dropna()) - set(KINDS))
    if unknown or kinds.isna().any():
        bad = ", ".join(unknown) or "empty"
        raise ValueError(f"{label}: unknown row kind(s) {bad}; known: {', '.join(KINDS)}")
    missing = [c for c in SAMPLE_COLUMNS if c not in raw]
    if missing:
        raise ValueError(f"{label}: evaluation is missing column(s) {', '.join(missing)} of {SCHEMA}")
    try:
        samples, retrieval = (
            _read_kind(raw[kinds == k], k) if (kinds == k).any() else _empty(k) for k in ("sample", "retrieval")
        )  # most files hold one kind only
    except (ValueError, TypeError) as e:
        raise ValueError(f"{label}: a value of the wrong type ({e})") from None
    status = "incomplete" if path.name.endswith(".incomplete.csv") else "complete"
    reason = "the run ended before it finished (an .incomplete.csv file)" if status == "incomplete" else ""
    return Evaluation(samples, retrieval, status=status, reason=reason, path=path)
