"""What reading a large profile costs: ``load_profile`` on a 1-million-row profile (issue #33).

Writes a profile of ``--rows`` rows (default 1,000,000) by repeating the steps and per-layer rows
of the bundled example ``profiles/examples/smollm2-mlx-256t.csv`` (30 layers) at later steps, as
a long run with masks and slots off records them, then times ``load_profile`` (every cell checked,
every table typed) in a fresh process per run, and reports the median of ``--runs`` and the peak
resident memory each load added to the process (its peak RSS minus its RSS before the load),
both against the file size. Targets (issue #33): under 5 s and under 3x the file size. The
reference, measured in the same run: pandas' ``read_csv`` of the same file as text (no check, no
types). ``read_meta`` (what listings read) is timed the same way.

    source scripts/env.sh && python bench/bench_load_profile.py [--rows 1000000] [--runs 3]
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "profiles" / "examples" / "smollm2-mlx-256t.csv"

CHILD = r"""
import json, resource, sys, time
import psutil
from cachelib.profile import load_profile, read_meta
path, what = sys.argv[1], sys.argv[2]
before = psutil.Process().memory_info().rss
start = time.perf_counter()
if what == "read_csv":  # the reference: pandas parsing the same file as text, nothing checked or typed
    import pandas as pd
    result = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
else:
    result = (load_profile if what == "load_profile" else read_meta)(path)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
rows = sum(len(result.frame(t)) for t in ("steps", "layers", "slots", "masks")) if what == "load_profile" else 0
print(json.dumps({"seconds": seconds, "added": peak - before, "rows": rows}))
"""


def write_profile(path: Path, rows: int) -> int:
    """A complete profile of about ``rows`` rows; returns the number of table rows written."""
    with open(SEED, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader)
        seed = list(reader)
    table, step = header.index("table"), header.index("step")
    meta = [r for r in seed if r[table] == "meta"]
    body = [r for r in seed if r[table] in ("steps", "layers")]
    steps = 1 + max(int(r[step]) for r in body)
    written = 0
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        key, value = header.index("key"), header.index("value")
        for r in meta:
            r = list(r)
            if r[key] == "max_tokens":
                r[value] = str(steps * (rows // len(body) + 1))
            w.writerow(r)
        copy = 0
        while written < rows:
            for r in body:
                r = list(r)
                r[step] = str(int(r[step]) + copy * steps)
                w.writerow(r)
                written += 1
                if written >= rows:
                    break
            copy += 1
    return written


def measure(path: Path, what: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), what], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "large.csv"
        written = write_profile(path, args.rows)
        size = path.stat().st_size
        print(f"profile: {written:,} table rows, {size / 1e6:.1f} MB ({SEED.name} repeated)")
        medians = {}
        for what in ("read_csv", "read_meta", "load_profile"):
            runs = [measure(path, what) for _ in range(args.runs)]
            seconds = statistics.median(r["seconds"] for r in runs)
            added = statistics.median(r["added"] for r in runs)
            medians[what] = seconds
            rows = f", {runs[0]['rows']:,} rows typed" if what == "load_profile" else ""
            ratio = f", {seconds / medians['read_csv']:.2f}x read_csv's time" if what != "read_csv" else ""
            print(
                f"{what:<12} median of {args.runs}: {seconds:6.2f} s{ratio}, peak memory added {added / 1e6:7.1f} MB "
                f"= {added / size:.2f}x the file size{rows}"
            )
        print("targets (issue #33): load_profile under 5 s and under 3x the file size")


if __name__ == "__main__":
    main()
