"""Every relative link in the README and the docs resolves: the file exists and, for a
``#anchor``, a heading of the target file has that GitHub slug. The README stays a front door
(at most 150 lines). Pure text: no cachelib import, runs in well under a second."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150

FENCE = re.compile(r"^ {0,3}(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1)[^\n]|\n(?![ \t]*\n))+?\1")  # not across a blank line
# [text](target "title") and ![alt](target); the text may hold one level of brackets (a badge).
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]\n]+\]:[ \t]*<?(\S+?)>?(?:[ \t]+.*)?$", re.M)
HTML_TARGET = re.compile(r"""<(?:a|img)\b[^>]*?\b(?:href|src)=["']([^"']+)["']""", re.I)
HTML_ANCHOR = re.compile(r"""<a\b[^>]*?\b(?:name|id)=["']([^"']+)["']""", re.I)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_files() -> list[Path]:
    """The pages whose links must resolve."""
    files = [ROOT / "README.md", ROOT / "bench" / "README.md", ROOT / "profiles" / "README.md"]
    files += sorted((ROOT / "docs").glob("*.md"))
    files += sorted((ROOT / "assets").rglob("README.md"))
    return [f for f in files if f.is_file()]


def prose(text: str, blank_code: bool = True) -> str:
    """The page with fenced code blocks blanked, and inline code spans (which may wrap within a
    paragraph) unless ``blank_code`` is false; line numbers are kept."""
    out, fenced = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m:
            fenced = None if fenced == m.group(1) else (fenced or m.group(1))
        out.append(line if fenced is None and not m else "")
    text = "\n".join(out)
    if blank_code:
        text = INLINE_CODE.sub(lambda c: re.sub(r"[^\n]", " ", c.group(0)), text)
    return text


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markup dropped (code spans kept literally), lower
    case, punctuation but `-` and `_` removed, each space a `-`."""
    parts = re.split(r"(`+[^`]*`+)", heading)
    text = ""
    for i, part in enumerate(parts):
        if i % 2:  # a code span: its text as written
            text += part.strip("`")
            continue
        part = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", part)  # a link's text stays
        part = re.sub(r"<[^>]+>", "", part)  # inline HTML
        part = re.sub(r"(?<!\w)[*_]+|[*_]+(?!\w)", "", part)  # emphasis markers, not snake_case
        text += part
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page offers: its headings' slugs (repeats get -1, -2, ...) and HTML ids."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in prose(path.read_text(encoding="utf-8"), blank_code=False).splitlines():
        found.update(HTML_ANCHOR.findall(line))
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in a page's prose (a link's text may wrap)."""
    text = prose(path.read_text(encoding="utf-8"))
    found = [(m.start(), m.group(1)) for m in INLINE_LINK.finditer(text)]
    found += [(m.start(), m.group(1)) for m in HTML_TARGET.finditer(text)]
    found += [(m.start(), m.group(1)) for m in REFERENCE_DEF.finditer(text)]
    return sorted((text.count("\n", 0, at) + 1, target) for at, target in found)


def is_relative(target: str) -> bool:
    return not re.match(r"^([a-z][a-z0-9+.-]*:|//)", target, re.I)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """What does not resolve in one page, one line each: `file:line: target (why)`."""
    problems, root = [], root.resolve()
    for n, target in links(path):
        if not is_relative(target):
            continue
        file_part, _, anchor = target.partition("#")
        where = f"{path.relative_to(root)}:{n}: {target}"
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if file_part.startswith("/"):
            dest = (root / unquote(file_part).lstrip("/")).resolve()
        if not dest.exists():
            problems.append(f"{where} (no such file)")
            continue
        if root not in dest.parents and dest != root:
            problems.append(f"{where} (outside the repository)")
            continue
        if anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest):
            problems.append(f"{where} (no heading with that anchor in {dest.relative_to(root)})")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == []


def test_the_pages_have_links_to_check():
    # The checker must see links at all: the README links into docs/ and to an anchor.
    targets = [t for _, t in links(ROOT / "README.md")]
    assert any(t.startswith("docs/") for t in targets), targets
    assert any("#" in t and is_relative(t) for t in targets), targets


def test_a_broken_link_and_a_broken_anchor_are_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Speed: `tok/s` (CPU)\n\n## Speed: `tok/s` (CPU)\n")
    page = tmp_path / "README.md"
    page.write_text(
        "See [a](docs/a.md#speed-toks-cpu), [again](docs/a.md#speed-toks-cpu-1), [top](#front).\n"
        "# Front\n"
        "[gone](docs/missing.md) and [bad anchor](docs/a.md#speed) and `[code](docs/nope.md)`\n"
        "a code span `that wraps\n[a line](docs/nope.md)` is code\n"
        "```\n[fenced](docs/nope.md)\n```\n"
        "![img](docs/a.png) [web](https://example.com/x.md)\n"
    )
    problems = broken_links(page, tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "docs/a.md#speed (no heading with that anchor in docs/a.md)",
        "docs/missing.md (no such file)",
        "docs/a.png (no such file)",
    ], problems


def test_slugs_follow_github():
    assert slug("A 5-minute tour") == "a-5-minute-tour"
    assert slug("Ada-KV: per-head budgets (`snapkv:adaptive=1`)") == "ada-kv-per-head-budgets-snapkvadaptive1"
    assert slug("llama.cpp, checked against llama.cpp") == "llamacpp-checked-against-llamacpp"
    assert slug("The answer, in the runtime's own flags") == "the-answer-in-the-runtimes-own-flags"
    assert slug("vLLM's KV pool") == "vllms-kv-pool"
    assert slug("The `max_kv_size` knob, *in short*") == "the-max_kv_size-knob-in-short"
    assert slug("A strategy batch: k strategies for one forward pass") == (
        "a-strategy-batch-k-strategies-for-one-forward-pass"
    )


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
