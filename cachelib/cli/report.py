"""``python -m cachelib report PROFILE.csv [MORE.csv ...] --out report.html``: a comparison of
profiles as one self-contained HTML file (:func:`cachelib.profile.report.report_html`; plotly.js
is inlined, so it opens with no network). ``--text`` adds each strategy's generated text, decoded
with the tokenizer of the model the profile names (the bundled GGUF, or a model folder) when that
is on this machine. A file that is not a profile, or an ``--out`` that is not ``.html``, exits
with code 2 and one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..profile import load_profile
from ..profile.outputs import AtomicFile, check_out_path
from ..profile.report import decoder_for, report_html


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("profiles", nargs="+", type=Path, metavar="PROFILE", help="profile files (.csv or .parquet)")
    p.add_argument("--out", type=Path, required=True, metavar="FILE.html", help="the report to write")
    p.add_argument("--title", default=None, help="the page title (default: the profiles' names)")
    p.add_argument(
        "--text",
        action="store_true",
        help="add each strategy's generated text (needs the profile's tokenizer on this machine)",
    )


def run(args: argparse.Namespace) -> int:
    # checked before any profile is read: the name, no folder or file of another kind there, a folder
    # that takes a file (the hidden temporary file is made now, and removed on any error)
    check_out_path(args.out, what="report", suffixes=(".html", ".htm"), replaces=("html",))
    with AtomicFile(args.out, "report") as out:
        page, count = _page(args)
        out.commit(page)
    print(f"report: {args.out} ({count} profile{'s' if count > 1 else ''}, {len(page) / 2**20:.1f} MiB)")
    return 0


def _page(args: argparse.Namespace) -> tuple[str, int]:
    profiles = [load_profile(path, name=str(path)) for path in args.profiles]
    names = [path.stem for path in args.profiles]
    decode = None
    if args.text:
        decode = [decoder_for(p.meta) for p in profiles]
        for profile, d in zip(profiles, decode):
            if d is None:
                print(
                    f"note: no tokenizer for {profile.meta.get('model', '?')} here; its text is left out",
                    file=sys.stderr,
                )
    return report_html(profiles, names, title=args.title, decode=decode), len(profiles)
