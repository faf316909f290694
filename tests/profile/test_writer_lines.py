"""The profile writer builds its CSV lines a column at a time (issue #34): what it writes is what
``csv.writer`` writes for the cells ``_cell`` makes, row by row, byte for byte, whatever the
values (text a spreadsheet would run, text csv must quote, NaN, flags, NumPy and pandas scalars,
keys outside the table); and the RSS column reads what psutil reads."""

from __future__ import annotations

import csv
import io
import os

import numpy as np
import pandas as pd
import pytest

from cachelib.profile import Probes, load_profile, run_profile
from cachelib.profile.recording import process_rss
from cachelib.profile.schema import COLUMNS
from cachelib.profile.writer import ProfileWriter, _cell

TEXTS = ["", " ", "a,b", 'q"uote', "line\nbreak", "cr\rx", "-1 -1 3", "=1+2", "+3", "-0.5", "'apos", "@x", "\tTab"]
TEXTS += [
    "{}",
    "{0}",
    "%s",
    "100%",
    "ünï",
    "-inf",
    "nan",
    " lead",
    "trail ",
    "x;y",
    "standard",
    "rotating:max_size=8,keep=2",
]
VALUES = [
    (0.5, True, None, 3),
    (float("nan"), None, 3, None),
    (float("inf"), False, np.int64(5), -7),
    (-0.0, pd.NA, None, 2**70),
    (np.float64(1.25), np.bool_(True), 7, 0),
    (1e-300, 1, 7.0, True),
]


def _csv_writer_text(table, rows):
    """What the writer wrote before its lines were built a column at a time."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    for row in rows:
        writer.writerow([table if c == "table" else _cell(row.get(c)) for c in COLUMNS])
    return out.getvalue()


def _written(tmp_path, table, rows) -> str:
    writer = ProfileWriter(tmp_path / "p.csv")
    writer.write(table, rows)
    writer.flush()
    text = writer.partial.read_bytes().decode("utf-8")
    writer.discard()
    return text.split("\r\n", 1)[1]  # after the header


def _rows():
    rows = [
        {"strategy": text, "step": i, "phase": text, "kl": kl, "top1_agree": flag, "rss_bytes": rss, "layer": n}
        for i, text in enumerate(TEXTS)
        for kl, flag, rss, n in VALUES
    ]
    rows += [{"strategy": t, "step": 1, "layer": 2, "positions": t} for t in TEXTS]  # text columns alone
    rows += [{"strategy": "a", "step": 1, "kind": "K", "offset": i} for i in range(5)]  # constant columns
    rows += [{"strategy": "a", "table": "other", "unknown": 5, "step": 1}, {}, {}, {"mask": "0101"}]
    return rows


@pytest.mark.parametrize("table", ["steps", "layers", "meta", "odd,table", "{t}%s"])
def test_lines_are_what_csv_writes_row_by_row(table, tmp_path):
    rows = _rows()
    assert _written(tmp_path, table, rows) == _csv_writer_text(table, rows)
    for row in rows:  # each row alone: its runs are as short as they come
        assert _written(tmp_path, table, [row]) == _csv_writer_text(table, [row])


@pytest.mark.parametrize("backend", ["mlx", "torch"])
def test_a_streamed_profile_is_the_rows_csv_writes(backend, load_model, tmp_path):
    loaded = load_model("tiny-llama", backend)
    strategies = ["standard", "quantized:bits=4,group_size=32", "rotating:max_size=12,keep=2", "tova:budget=10"]
    profile = run_profile(
        loaded, strategies, prompt="Hello there", max_tokens=5, probes=Probes(masks=2), out=tmp_path / "p.csv"
    )
    text = profile.path.read_bytes().decode("utf-8")
    body = text.split("\r\n", 1)[1]
    tables = "".join(_csv_writer_text(t, profile.rows(t)) for t in ("steps", "layers", "slots", "masks"))
    lines = [line for line in body.split("\r\n") if line and not line.startswith("meta,")]
    assert sorted(lines) == sorted(tables.split("\r\n")[:-1])
    assert load_profile(profile.path) == profile


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux reads /proc; psutil elsewhere")
def test_process_rss_is_psutils():
    psutil = pytest.importorskip("psutil")
    process = psutil.Process()
    for _ in range(3):  # two reads in a row agree but for a page or two touched between them
        assert abs(process_rss() - process.memory_info().rss) <= 4 * os.sysconf("SC_PAGE_SIZE")
