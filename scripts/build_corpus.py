"""Rebuild assets/corpus/*.txt from the Debian packages they come from (see assets/corpus/README.md).

Not part of the install: the corpus is committed. This records exactly how each file was made.

    apt-get update && apt-get install -y bible-kjv          # the `bible` program + bible-kjv-text
    apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb austen
    python -m venv /tmp/rdata && /tmp/rdata/bin/pip install rdata  # reads R's lazy-load data base
    /tmp/rdata/bin/python scripts/build_corpus.py austen assets/corpus
"""

from __future__ import annotations

import gzip
import re
import subprocess
import sys
import zlib
from pathlib import Path

AUSTEN = {"persuasion": "persuasion.txt", "prideprejudice": "pride-and-prejudice.txt"}
GENESIS_TITLE = "THE FIRST BOOK OF MOSES, CALLED GENESIS"


def clean(text: str) -> str:
    """Trailing spaces off, runs of blank lines cut to one, one final newline."""
    lines = [line.rstrip() for line in text.splitlines()]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")
    return text + "\n"


def austen_novels(extracted: Path) -> dict[str, str]:
    """The novels of janeaustenr's data base (R lazy-load: .rdx index, zlib chunks in .rdb)."""
    import rdata

    data = extracted / "usr/lib/R/site-library/janeaustenr/data"
    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress((data / "Rdata.rdx").read_bytes())))
    rdb = (data / "Rdata.rdb").read_bytes()
    novels = {}
    for name, (offset, length) in index["variables"].items():
        chunk = rdb[int(offset) : int(offset) + int(length)]
        lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(chunk[4:])))
        novels[str(name)] = "\n".join(str(x) for x in lines)
    return novels


def genesis() -> str:
    """Genesis from bible-kjv-text, one verse a line, "Chapter N" headings, no verse numbers."""
    out = subprocess.run(["bible", "-f", "Gen1:1-Gen50:26"], capture_output=True, text=True, check=True).stdout
    parts, chapter = [GENESIS_TITLE, ""], None
    for line in out.splitlines():
        m = re.match(r"^Ge(\d+):(\d+) (.*)$", line)
        if not m:
            continue
        if m.group(1) != chapter:
            chapter = m.group(1)
            parts += ["", f"Chapter {chapter}", ""]
        parts.append(m.group(3))
    return clean("\n".join(parts))


def main(extracted: str, dest: str) -> None:
    dest_dir = Path(dest)
    novels = austen_novels(Path(extracted))
    for name, file in AUSTEN.items():
        (dest_dir / file).write_text(clean(novels[name]), encoding="utf-8")
    (dest_dir / "genesis-kjv.txt").write_text(genesis(), encoding="utf-8")


if __name__ == "__main__":
    main(*sys.argv[1:3])
