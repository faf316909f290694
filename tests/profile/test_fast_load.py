"""The fast CSV reader (:mod:`cachelib.profile.fast_load`) against the exact one (:mod:`.checks`):
what it accepts, it reads into the same tables and dtypes; whatever it cannot vouch for goes to
the exact reader, so every error message stays the exact reader's."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pandas as pd
import pytest

from cachelib.profile import store
from cachelib.profile.fast_load import load_fast

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "profiles" / "examples").glob("*.csv"))


def exact(source):
    """``load_profile`` through the exact reader only (what it was before the fast reader)."""
    saved = store.load_fast
    store.load_fast = lambda source, label: None
    try:
        return store.load_profile(source)
    finally:
        store.load_fast = saved


def same(a, b) -> None:
    assert a.meta == b.meta
    for table in store.TABLE_NAMES:
        x, y = a.frame(table), b.frame(table)
        assert list(x.dtypes.map(repr)) == list(y.dtypes.map(repr)), table
        pd.testing.assert_frame_equal(x, y, check_exact=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_examples_read_fast_into_the_exact_readers_tables(path):
    fast = load_fast(path, str(path))
    assert fast is not None, "the fast reader gave up on a file cachelib wrote"
    same(fast, exact(path))
    same(store.load_profile(path.read_bytes()), exact(path))


def _rewrite(src: Path, dst: Path, change) -> Path:
    import csv
    import io

    rows = list(csv.reader(io.StringIO(src.read_text(encoding="utf-8"), newline="")))
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n").writerows(change(rows))
    dst.write_text(out.getvalue(), encoding="utf-8")
    return dst


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """The first example cut to its metadata and 20 rows of each table (fast to read twice)."""

    def cut(rows):
        seen: dict[str, int] = {}
        out = [rows[0]]
        for r in rows[1:]:
            seen[r[0]] = seen.get(r[0], 0) + 1
            if r[0] == "meta" or seen[r[0]] <= 20:
                out.append(r)
        return out

    return _rewrite(EXAMPLES[0], tmp_path_factory.mktemp("small") / "small.csv", cut)


def _with_cell(src: Path, dst: Path, table: str, column: str, value: str, nth: int = 0) -> Path:
    """``src`` with one cell of the ``nth`` row of ``table`` replaced by ``value`` (raw CSV text)."""
    import csv
    import io

    rows = list(csv.reader(io.StringIO(src.read_text(encoding="utf-8"), newline="")))
    col = rows[0].index(column)
    hits = [r for r in rows[1:] if r[0] == table]
    hits[nth][col] = value
    out = io.StringIO()
    csv.writer(out, lineterminator="\r\n").writerows(rows)
    dst.write_text(out.getvalue(), encoding="utf-8")
    return dst


BAD = [
    ("steps", "step", "1.5"),  # not an integer
    ("steps", "step", "-1"),  # out of range
    ("steps", "token_id", "99999999999999999999"),  # past int64
    ("steps", "kl", "nan"),
    ("steps", "kl", "inf"),
    ("steps", "kl", "-0.5"),
    ("steps", "kl", "abc"),
    ("steps", "logprob_target", "0.5"),
    ("steps", "top1_agree", "yes"),
    ("steps", "phase", "decoding"),
    ("steps", "phase", ""),  # a required cell
    ("layers", "kind", "a\x00b"),
    ("slots", "positions", "1 2 x"),
    ("masks", "mask", "0102"),
    ("steps", "table", "stepz"),  # an unknown table
]


@pytest.mark.parametrize("table, column, value", BAD, ids=[f"{t}.{c}={v!r}" for t, c, v in BAD])
def test_a_bad_cell_is_worded_by_the_exact_reader(table, column, value, small, tmp_path):
    src = small
    if column == "table":
        bad = tmp_path / "bad.csv"
        bad.write_text(src.read_text(encoding="utf-8").replace("\nsteps,", "\nstepz,", 1), encoding="utf-8")
    else:
        bad = _with_cell(src, tmp_path / "bad.csv", table, column, value)
    assert load_fast(bad, str(bad)) is None
    with pytest.raises(ValueError) as fast:
        store.load_profile(bad)
    with pytest.raises(ValueError) as slow:
        exact(bad)
    assert str(fast.value) == str(slow.value)
    assert str(bad) in str(fast.value)


@pytest.mark.parametrize("table, column, value", [("steps", "logprob_target", "-inf"), ("layers", "layer", " 3")])
def test_what_only_the_exact_reader_accepts_still_loads_the_same(table, column, value, small, tmp_path):
    """-inf is a valid logprob_target (the fast reader leaves every non-finite number to the exact
    one); both read " 3" as 3."""
    odd = _with_cell(small, tmp_path / "odd.csv", table, column, value)
    assert (load_fast(odd, str(odd)) is None) == (value == "-inf")
    same(store.load_profile(odd), exact(odd))


def test_escaped_text_quoted_newlines_blank_lines_and_exact_floats_round_trip(tmp_path):
    profile = exact(EXAMPLES[0])
    rng = random.Random(7)
    floats = [rng.uniform(0, 1) * 10 ** rng.randint(-30, 30) for _ in range(64)]
    profile.meta["prompt"] = '=cmd|" /C calc"!A0\nsecond line, with a comma'
    steps = profile.frame("steps").copy()
    steps.loc[: len(floats) - 1, "kl"] = floats
    steps["strategy"] = steps["strategy"].where(steps["strategy"] != "standard", "@standard")
    profile._frames["steps"] = steps
    profile.meta["strategies"] = profile.meta["strategies"].replace('"standard"', '"@standard"')
    profile.meta["baseline"] = "@standard" if profile.meta["baseline"] == "standard" else profile.meta["baseline"]
    path = store.save_profile(profile, tmp_path / "round.csv")
    text = path.read_text(encoding="utf-8")
    assert "'@standard" in text and "'=cmd" in text  # written escaped
    path.write_text(text.replace("\r\nsteps,", "\r\n\r\nsteps,", 3), encoding="utf-8")  # blank lines
    fast = load_fast(path, str(path))
    assert fast is not None
    same(fast, exact(path))
    assert fast.meta["prompt"] == profile.meta["prompt"]
    kl = fast.frame("steps")["kl"].iloc[: len(floats)].tolist()
    assert all(math.isclose(a, b, rel_tol=0) for a, b in zip(kl, floats))


def test_a_file_of_another_column_set_goes_to_the_exact_reader(small, tmp_path):
    src = small
    extra = _rewrite(src, tmp_path / "extra.csv", lambda rows: [rows[0] + ["note"]] + [r + [""] for r in rows[1:]])
    assert load_fast(extra, str(extra)) is None
    same(store.load_profile(extra), exact(extra))

    def drop_kl(rows):
        col = rows[0].index("kl")
        return [r[:col] + r[col + 1 :] for r in rows]

    missing = _rewrite(src, tmp_path / "missing.csv", drop_kl)
    assert load_fast(missing, str(missing)) is None
    with pytest.raises(ValueError, match="missing column") as fast:
        store.load_profile(missing)
    with pytest.raises(ValueError) as slow:
        exact(missing)
    assert str(fast.value) == str(slow.value)


@pytest.mark.slow  # 10-30 s on the busy 2-core machine: 120 files read by both readers
def test_mutated_profiles_read_fast_only_as_the_exact_reader_reads_them(tmp_path):
    """Seeded mutations of a small profile (the loader fuzz test's): each one the fast reader
    accepts, the exact reader accepts into the same tables; the fast reader never raises."""
    import sys

    sys.path.insert(0, str(ROOT / "tests"))
    from test_fuzz_loaders import _mutant, _small_profile

    rng = random.Random(33)
    data, accepted = _small_profile(), 0
    for i in range(120):
        path = tmp_path / f"m{i}.csv"
        path.write_bytes(_mutant(rng, data))
        fast = load_fast(path, str(path))
        if fast is None:
            continue
        accepted += 1
        same(fast, exact(path))
    assert accepted >= 10  # the mutations leave enough files valid to compare
