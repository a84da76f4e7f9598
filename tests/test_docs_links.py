"""Every relative link in README.md and docs/**/*.md resolves: the file or folder exists, and a `#anchor` into a
Markdown file names one of its headings (GitHub's slugs). Text moves between docs; a link left behind fails here.

docs/data/ (generated reports and raw metrics) is not checked. Links in code blocks and inline code are not
links. Pure Python, no imports of the project: it runs in milliseconds.
"""

from __future__ import annotations

import re
import unicodedata
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SKIPPED = REPO / "docs" / "data"

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets (an image inside a link)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def documents() -> list[Path]:
    docs = sorted(p for p in (REPO / "docs").rglob("*.md") if SKIPPED not in p.parents)
    return [REPO / "README.md", *docs]


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code spans blanked out."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, CODE_SPAN.sub("", line)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links as their text, code without backticks), lower case, every
    character that is not a letter, digit, mark, connector (`_`), space or hyphen dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).lower()
    kept = (c for c in text if c in " -" or unicodedata.category(c)[0] in "LMN" or unicodedata.category(c) == "Pc")
    return "".join(kept).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors a Markdown file offers: its headings' slugs (a repeated slug gets -1, -2, ...) and <a id>s."""
    seen: dict[str, int] = {}
    out = set()
    text = path.read_text(encoding="utf-8")
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        out.update(HTML_ANCHOR.findall(line))
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def targets(path: Path):
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            yield number, target
        ref = REFERENCE.match(line)
        if ref:
            yield number, ref.group(1)


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    out = []
    for number, target in targets(path):
        if EXTERNAL.match(target) or target.startswith("//"):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            out.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{where} (no heading with the anchor #{anchor})")
    return out


def test_every_relative_link_in_readme_and_docs_resolves():
    docs = documents()
    assert len(docs) > 5 and (REPO / "docs" / "RESULTS.md") in docs
    broken = [b for path in docs for b in broken_links(path)]
    assert not broken, "broken links:\n" + "\n".join(broken)


ISSUE_NUMBER = re.compile(r"\b(?:issues?|PR|pull request)\s+#?\d+|(?<![\w/(#&])#\d+(?![\w-])", re.I)


def test_docs_cite_no_issue_numbers():
    """A tracker's numbers mean nothing to a reader outside it: the docs say what was asked instead."""
    assert ISSUE_NUMBER.search("as issue 13 predicted") and ISSUE_NUMBER.search("fixed in #30.")
    assert not ISSUE_NUMBER.search("[7b](cpu-recipe.md#7b-x), (#5-the-plan), &#8594;, round 30")
    found = [
        f"{path.relative_to(REPO)}:{number}: {match.group(0)}"
        for path in documents()
        for number, line in prose_lines(path.read_text(encoding="utf-8"))
        for match in ISSUE_NUMBER.finditer(line)
    ]
    assert not found, "issue numbers in the docs:\n" + "\n".join(found)


def test_the_checker_sees_links_and_github_slugs(tmp_path):
    """The parts the check rests on, on known cases: a checker that finds nothing would pass anything."""
    assert slug("LoRA: `scripts/bench_lora.py` (rank 8)") == "lora-scriptsbench_lorapy-rank-8"
    assert slug("8a. A newcomer joins trained peers") == "8a-a-newcomer-joins-trained-peers"
    assert slug("The test suite on a GPU (2026-11-27, at 3b36d23)") == "the-test-suite-on-a-gpu-2026-11-27-at-3b36d23"
    assert slug("Survey (default model, I = 4 prompts × G = 8, ≤ 32)") == "survey-default-model-i--4-prompts--g--8--32"
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n## Same\n## Same\nSee [a](#same-1), [b](#nope), ![c](missing.png), "
        "[d](https://example.org/x), `[e](in-code.md)`.\n```\n[f](fenced.md)\n```\n[g]: other.md\n"
    )
    assert anchors(page) == {"title", "same", "same-1"}
    assert [t for _, t in targets(page)] == ["#same-1", "#nope", "missing.png", "https://example.org/x", "other.md"]
    (tmp_path / "other.md").write_text("# Other\n")
    assert broken_links(page, tmp_path) == [
        "page.md:4: #nope (no heading with the anchor #nope)",
        "page.md:4: missing.png (no such file)",
    ]
