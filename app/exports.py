"""What the app hands out: a profile as CSV or Parquet, a comparison as one HTML page."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from cachelib.profile import Profile, load_profile, save_profile
from cachelib.profile.report import ReportRun, report_html

from .data import RunView
from .shelf import decoder_of

EXPORT_FORMATS = {"csv": "text/csv", "parquet": "application/vnd.apache.parquet"}


def export_bytes(source: Path | bytes, fmt: str, name: str = "profile") -> bytes:
    """A profile (a file, or an upload's bytes) as ``fmt`` (csv or parquet). A CSV file is sent
    as it is; Parquet is written by :func:`cachelib.profile.save_profile` from the loaded profile."""
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; use one of: {', '.join(EXPORT_FORMATS)}")
    if isinstance(source, Path):
        s = source.stat()
        return _export_file(str(source), s.st_mtime_ns, s.st_size, fmt)
    if fmt == "csv":
        return source
    return _as_parquet(load_profile(source, name=name))


@functools.lru_cache(maxsize=4)  # download callables run outside the script thread: no st.cache here
def _export_file(path: str, mtime_ns: int, size: int, fmt: str) -> bytes:
    if fmt == "csv" and path.lower().endswith(".csv"):
        return Path(path).read_bytes()
    profile = load_profile(path, name=Path(path).name)
    return _as_parquet(profile) if fmt == "parquet" else _as_csv(profile)


def _as_parquet(profile: Profile) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        return save_profile(profile, Path(tmp) / "profile.parquet").read_bytes()


def _as_csv(profile: Profile) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        return save_profile(profile, Path(tmp) / "profile.csv").read_bytes()


def report_bytes(views: dict[str, RunView], title: str | None = None) -> bytes:
    """The HTML report (:func:`cachelib.profile.report.report_html`) of the views, each with its
    own metadata and steps table, and its generated text where the model's tokenizer is here."""
    runs = [ReportRun(name, v.meta, v.steps) for name, v in views.items() if v.meta]
    return report_html(runs, title=title, decode=[decoder_of(r.meta) for r in runs]).encode("utf-8")
