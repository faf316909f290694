"""The planner's evidence: an explicit set of files, read into measured points.

Evidence is never "whatever lies in profiles/". :func:`load_evidence` reads the paths it is given
(files or folders; by default the committed evidence in ``assets/evidence/``) and turns them into
:class:`~cachelib.plan.quality.Evidence` points:

- long-context evaluations (``cachelib evaluate``, ``schema`` = ``cachelib-evaluation/1``): one
  point per model x backend x strategy x context, the mean over its windows and texts with a 95%
  confidence interval, and the retrieval task's accuracy where it was run;
- complete profiles (decode runs): one point per run and strategy, at the context the run
  reached, without a confidence interval.

The same measurement counts once: files with identical content, profiles with the same run id,
and evaluation samples with the same identity (model, backend, strategy, context, text, window,
scoring) are read once. A file that is neither, or is malformed, is skipped with a warning that
names it; it never fails the plan.
"""

from __future__ import annotations

import hashlib
import math
import os
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from ..core.home import cache_dir
from ..core.reader import read_bytes
from ..plan.quality import Evidence, kept_fraction
from ..spec import parse_spec

if TYPE_CHECKING:
    import pandas as pd

# pandas, numpy and the file readers are imported where the files are read: a set read back from
# its on-disk cache (the CLI's plan, every run after the first) never imports pandas.

DEFAULT_EVIDENCE = Path(__file__).resolve().parents[2] / "assets" / "evidence"
MAX_EVIDENCE_BYTES = 2_000_000_000  # an evidence file is read whole: a cap far above any real profile (1M rows: 115 MB)

# what makes two evaluation samples the same measurement
SAMPLE_IDENTITY = ("model", "backend", "strategy", "context", "score_tokens", "prefill_chunk", "text", "window_start")
# a trial is its prompt (the key drawn for it, so two seeds are two trials) and how the question
# reached the cache (files written before ``question`` existed lack it: one mode among themselves)
RETRIEVAL_IDENTITY = ("model", "backend", "strategy", "context", "depth", "trial", "task", "answer", "question")


@dataclass(frozen=True)
class EvidenceSet:
    """The points read from some paths, the files they come from, and what was skipped."""

    points: tuple[Evidence, ...]
    files: tuple[str, ...]  # files that gave at least one point
    warnings: tuple[str, ...] = field(default=())  # skipped files, each naming the file and why
    # the retrieval task's rows (one per trial) as a pickled DataFrame, so unpickling the set needs no pandas
    retrieval_pickle: bytes | None = None

    @property
    def models(self) -> list[str]:
        return sorted({p.model for p in self.points})

    @property
    def retrieval(self) -> pd.DataFrame | None:
        """The retrieval task's rows (one per trial), where measured."""
        return None if self.retrieval_pickle is None else pickle.loads(self.retrieval_pickle)


def _files(source: str | os.PathLike) -> list[Path]:
    root = Path(source).expanduser()
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ValueError(f"no evidence at {str(root)!r}: give an evaluation or profile CSV, or a folder of them")
    return sorted(p for p in root.rglob("*.csv") if p.name != "index.csv" and not p.name.startswith("."))


def _schema(path: Path) -> str | None:
    try:
        with path.open("r", encoding="utf-8", errors="replace") as f:
            header = f.readline()
            first = f.readline()
    except OSError:
        return None
    if header.split(",", 1)[0].strip() == "schema":
        return first.split(",", 1)[0].strip()
    return None


EVIDENCE_READER = 2  # bump when what load_evidence makes of the same files changes: old cached sets are unused


def _cache_file(sources: list) -> Path | None:
    """Where the set read from ``sources`` is kept between runs, named by every file's path, size
    and mtime (a changed, added or removed file names another); None when a source is missing."""
    parts = [str(EVIDENCE_READER)]
    for source in sources:
        try:
            found = _files(source)
        except ValueError:
            return None  # the reader names the problem
        parts.append(str(Path(source).expanduser().resolve()))
        for path in found:
            try:
                st = path.stat()
            except OSError:
                return None
            parts.append(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}")
    return cache_dir() / "evidence" / (hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32] + ".pickle")


def load_evidence(sources: Iterable[str | os.PathLike] | None = None, *, cache: bool = True) -> EvidenceSet:
    """The evidence in ``sources`` (files or folders; default: the committed evidence). A source that
    does not exist, or holds no evidence at all, is a ValueError naming it. With ``cache`` the set
    is kept on disk (:func:`cachelib.core.home.cache_dir`: ``$CACHELIB_HOME``, else
    ``~/.cache/cachelib``) under the files' paths, sizes and mtimes, so reading the same unchanged
    files again costs milliseconds."""
    sources = [DEFAULT_EVIDENCE] if sources is None else list(sources)
    kept = _cache_file(sources) if cache else None
    if kept is not None and kept.is_file():
        try:
            with kept.open("rb") as f:
                found = pickle.load(f)
            if isinstance(found, EvidenceSet):
                return found
        except Exception:  # a torn or foreign file: read the evidence again  # noqa: BLE001
            pass
    found = _load_evidence(sources)
    if kept is not None:
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            tmp = kept.with_name(f".{kept.name}.{os.getpid()}")
            with tmp.open("wb") as f:
                pickle.dump(found, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, kept)
        except OSError:
            pass  # a read-only home: no cache, the same answer
    return found


def _load_evidence(sources: list) -> EvidenceSet:
    import pandas as pd

    from .evaluation_file import SCHEMA as EVALUATION_SCHEMA
    from .evaluation_file import load_evaluation
    from .store import load_profile

    seen_hashes: set[str] = set()
    seen_runs: set[str] = set()
    samples: list[pd.DataFrame] = []
    retrieval: list[pd.DataFrame] = []
    profile_points: list[Evidence] = []
    used: list[str] = []
    warnings: list[str] = []
    for source in sources:
        if Path(source) == DEFAULT_EVIDENCE and not any(DEFAULT_EVIDENCE.glob("*.csv")):
            warnings.append(f"{DEFAULT_EVIDENCE}: the committed evidence is missing; nothing judges quality")
            continue
        found = _files(source)
        before = len(used) + len(warnings)
        for path in found:
            try:  # bounded, and never a device, a pipe or a socket (a /dev/zero symlink named x.csv)
                digest = hashlib.sha256(read_bytes(path, "evidence file", MAX_EVIDENCE_BYTES)).hexdigest()
            except OSError as e:
                warnings.append(f"{path}: skipped, cannot be read ({e.strerror or e})")
                continue
            except ValueError as e:
                warnings.append(f"{path}: skipped, {e}")
                continue
            if digest in seen_hashes:
                continue  # the same file content again (a copy): counted once
            seen_hashes.add(digest)
            try:
                if _schema(path) == EVALUATION_SCHEMA:
                    evaluation = load_evaluation(path)
                    _check_usable(evaluation)
                    if not evaluation.complete:  # each sample row is a whole measurement: they count
                        warnings.append(
                            f"{path}: an incomplete evaluation ({evaluation.reason or 'no reason'}); "
                            f"its {len(evaluation.samples)} finished sample(s) count"
                        )
                    samples.append(evaluation.samples.assign(file=path.name))
                    retrieval.append(evaluation.retrieval.assign(file=path.name))
                    used.append(str(path))
                    continue
                profile = load_profile(path)
            except ValueError as e:
                warnings.append(f"{path}: skipped, {e}")
                continue
            except (TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:  # a reader's gap: one file
                warnings.append(f"{path}: skipped, it could not be read ({type(e).__name__}: {str(e)[:200]})")
                continue
            if not profile.complete:
                warnings.append(f"{path}: skipped, an incomplete profile ({profile.meta.get('reason') or 'no reason'})")
                continue
            run = str(profile.meta.get("run_id") or digest)
            if run in seen_runs:
                continue  # a "Save as" copy of a run already read
            seen_runs.add(run)
            try:
                points = _profile_points(profile, path.name)
            except ValueError as e:  # a strategy label no spec reads: this file is skipped, not the plan
                warnings.append(f"{path}: skipped, {e}")
                continue
            if points:
                profile_points += points
                used.append(str(path))
        if len(used) + len(warnings) == before and not found:
            raise ValueError(f"no evidence in {str(source)!r}: it holds no CSV file")
    points = _evaluation_points(samples, retrieval) + profile_points
    trials = [f for f in retrieval if len(f)]
    found = pd.concat(trials, ignore_index=True).drop_duplicates(subset=list(RETRIEVAL_IDENTITY)) if trials else None
    if not points and found is None and any(Path(s) != DEFAULT_EVIDENCE for s in sources):
        names = ", ".join(map(str, sources))
        raise ValueError(
            f"no evidence in {names}: no evaluation file or complete profile with a measured strategy"
            + (f" ({'; '.join(warnings)})" if warnings else "")
        )
    kept = None if found is None else pickle.dumps(found, protocol=pickle.HIGHEST_PROTOCOL)
    return EvidenceSet(tuple(points), tuple(used), tuple(warnings), kept)


def _check_usable(evaluation) -> None:
    """A ``ValueError`` naming the first thing in an evaluation the planner could not use: a
    strategy no spec reads, or a mean KL or top-1 agreement that is not a finite number in range
    (checked per file, so one bad file is skipped with its name and never fails the plan)."""
    import numpy as np
    import pandas as pd

    for frame in (evaluation.samples, evaluation.retrieval):
        if "strategy" in frame:
            for label in sorted(set(frame["strategy"].astype(str))):
                parse_spec(label.split("#")[0])
    samples = evaluation.samples
    for column, low, high in (("mean_kl", 0.0, math.inf), ("top1_agreement", 0.0, 1.0)):
        if column not in samples or not len(samples):
            continue
        values = pd.to_numeric(samples[column], errors="coerce").to_numpy(dtype="float64")
        bad = ~np.isfinite(values) | (values < low) | (values > high)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"sample row {i + 1}: {column} {values[i]:g} is not a finite number in [{low:g}, {high:g}]"
            )


def _mean(series: pd.Series) -> float | None:
    import pandas as pd

    values = pd.to_numeric(series, errors="coerce").dropna()
    return float(values.mean()) if len(values) else None


def _evaluation_points(samples: list[pd.DataFrame], retrieval: list[pd.DataFrame]) -> list[Evidence]:
    import numpy as np
    import pandas as pd

    from .evaluation_file import ci95

    def half_width(values) -> float | None:  # Evidence says "one sample" with None, the table with NaN
        half = ci95(values)
        return None if math.isnan(half) else half

    frames = [f for f in samples if len(f)]
    if not frames:
        return []
    table = pd.concat(frames, ignore_index=True).drop_duplicates(subset=[c for c in SAMPLE_IDENTITY if c in frames[0]])
    found = pd.concat([f for f in retrieval if len(f)], ignore_index=True) if any(len(f) for f in retrieval) else None
    accuracy: dict[tuple, float | None] = {}
    if found is not None:
        found = found.drop_duplicates(subset=[c for c in RETRIEVAL_IDENTITY if c in found])
        hits = pd.to_numeric(found["exact_match"], errors="coerce")
        keys = pd.MultiIndex.from_tuples(
            list(zip(found["model"], found["backend"], found["strategy"], found["context"].astype("int64")))
        )
        for key, values in pd.Series(hits.to_numpy(), index=keys).groupby(level=[0, 1, 2, 3]):
            values = values.dropna()
            accuracy[key] = float(values.mean()) if len(values) else None
    # one pass over numpy columns per group (boolean indexing per group cost ~1 s for the committed set)
    kl = table["mean_kl"].to_numpy(dtype="float64")
    top1 = table["top1_agreement"].to_numpy(dtype="float64")
    scored_col = (
        pd.to_numeric(table["score_tokens"], errors="coerce").to_numpy(dtype="float64")
        if "score_tokens" in table
        else None
    )
    delta_col = (
        pd.to_numeric(table["delta_ppl"], errors="coerce").to_numpy(dtype="float64") if "delta_ppl" in table else None
    )
    file_col = table["file"].to_numpy()
    out = []
    groups = table.groupby(["model", "backend", "strategy", "context"], sort=True).indices
    for (model, backend, strategy, context), rows in sorted(groups.items()):
        spec = parse_spec(str(strategy).split("#")[0])
        if spec.lossless:
            continue  # the reference itself: exact by construction
        context = int(context)
        # the scored tokens come after the prefill: the cache holds context + score_tokens at the end
        scored = 0
        if scored_col is not None:
            seen = scored_col[rows][~np.isnan(scored_col[rows])]
            scored = int(seen.max()) if len(seen) else 0
        delta = None if delta_col is None else delta_col[rows]
        valid = None if delta is None else delta[~np.isnan(delta)]
        out.append(
            Evidence(
                spec=str(spec),
                model=str(model),
                backend=str(backend),
                context=context,
                kept_fraction=kept_fraction(spec, context + scored),
                samples=len(rows),
                mean_kl=float(kl[rows].mean()),
                top1_agreement=float(top1[rows].mean()),
                mean_kl_ci95=half_width(kl[rows].tolist()),
                top1_ci95=half_width(top1[rows].tolist()),
                delta_ppl=None if valid is None or not len(valid) else float(valid.mean()),
                delta_ppl_ci95=None if delta is None else half_width(delta.tolist()),
                retrieval=accuracy.get((model, backend, strategy, context)),
                kind="evaluation",
                files=tuple(sorted(set(file_col[rows]))),
            )
        )
    return out


def _profile_points(profile, name: str) -> list[Evidence]:
    steps = profile.frame("steps")
    decode = steps[steps["phase"] == "decode"]
    model, backend = str(profile.meta.get("model")), str(profile.meta.get("backend"))
    out = []
    for label in profile.strategies[1:]:
        rows = decode[decode["strategy"] == label]
        if rows["kl"].notna().sum() == 0:
            continue
        spec = parse_spec(label.split("#")[0])
        if spec.lossless:
            continue
        reached = int(steps.loc[steps["strategy"] == label, "position"].max()) + 1
        out.append(
            Evidence(
                spec=str(spec),
                model=model,
                backend=backend,
                context=reached,
                kept_fraction=kept_fraction(spec, reached),
                samples=1,
                mean_kl=float(rows["kl"].mean()),
                top1_agreement=float(rows["top1_agree"].astype("Float64").mean()),
                kind="profile",
                files=(name,),
            )
        )
    return out
