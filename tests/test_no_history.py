"""The product describes what the code does, not how it came to be: no numbered session, round of
work or issue is named in the shipped trees, no date of work in the docs, and no comment block in the
code longer than six lines (a comment is one line of why; a docstring holds the what)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# trees whose every text file is scanned for numbered history
HISTORY_TREES = ["README.md", "CHANGELOG.md", "docs", "factory", "assets", "infra", "tests", "bench", "Makefile", ".ci"]
HISTORY_PATTERNS = [
    re.compile(r"\bsessions? #?\d+", re.IGNORECASE),
    re.compile(r"\bissues? #?\d+", re.IGNORECASE),
    re.compile(r"\bpull requests? #?\d+", re.IGNORECASE),
    re.compile(r"\bround #?\d+ of (?:work|development)", re.IGNORECASE),
    re.compile(r"\brounds? of (?:work|development) #?\d+", re.IGNORECASE),
    re.compile(r"\b(?:work|development) round #?\d+", re.IGNORECASE),
]
# a date in prose is a date of work; measurement timestamps live in bench/results/*.json
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
DATE_TREES = ["README.md", "CHANGELOG.md", "docs"]
GENERATED_DOCS = {"docs/benchmarks.md"}  # generated from bench/results, which time-stamp each figure

# trees whose comments must stay short
COMMENT_TREES = ["factory", "assets", "infra", "Makefile", ".ci/run"]
MAX_COMMENT_BLOCK = 6

SELF = Path(__file__).resolve()
BINARY_SUFFIXES = {".png", ".jpg", ".jpeg", ".gif", ".ico", ".pdf", ".parquet", ".pyc", ".whl", ".gz", ".zip"}



SESSION, ISSUE = "sess" + "ion", "Iss" + "ue"  # the planted words, split so this file names none

def _files(root: Path, entries: list[str]):
    for entry in entries:
        path = root / entry
        if path.is_file():
            yield path
        elif path.is_dir():
            for p in sorted(path.rglob("*")):
                if p.is_file() and "__pycache__" not in p.parts and p.suffix not in BINARY_SUFFIXES:
                    yield p


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def history_violations(root: Path) -> list[str]:
    """`file:line: text` for each numbered session/round/issue, and each date in the prose trees."""
    found = []
    for path in _files(root, HISTORY_TREES):
        if path.resolve() == SELF:
            continue
        text = _text(path)
        if text is None:
            continue
        rel = path.relative_to(root).as_posix()
        dates = (rel.startswith("docs/") or rel in DATE_TREES) and rel not in GENERATED_DOCS \
            and not rel.startswith("docs/reference/")
        for n, line in enumerate(text.splitlines(), 1):
            hits = [m.group(0) for pat in HISTORY_PATTERNS for m in pat.finditer(line)]
            if dates:
                hits += [m.group(0) for m in DATE.finditer(line)]
            if hits:
                found.append(f"{rel}:{n}: {', '.join(hits)}")
    return found


def _comment_lines_py(text: str) -> set[int]:
    """Lines holding only a comment, by the tokenizer (a '#' inside a string does not count)."""
    lines: set[int] = set()
    code: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                lines.add(tok.start[0])
            elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                  tokenize.ENDMARKER, tokenize.ENCODING):
                code.update(range(tok.start[0], tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError):
        return set()
    return lines - code


def _comment_lines_shell(text: str) -> set[int]:
    return {n for n, line in enumerate(text.splitlines(), 1)
            if line.strip().startswith("#") and not (n == 1 and line.startswith("#!"))}


def comment_block_violations(root: Path) -> list[str]:
    """`file:line: N comment lines` for each run of consecutive comment lines longer than the limit."""
    found = []
    for path in _files(root, COMMENT_TREES):
        if path.suffix not in (".py", ".sh") and path.name not in ("Makefile", "run"):
            continue
        text = _text(path)
        if text is None:
            continue
        lines = _comment_lines_py(text) if path.suffix == ".py" else _comment_lines_shell(text)
        run_start, run = 0, 0
        for n in range(1, len(text.splitlines()) + 2):
            if n in lines:
                run_start, run = (n, 1) if run == 0 else (run_start, run + 1)
                continue
            if run > MAX_COMMENT_BLOCK:
                found.append(f"{path.relative_to(root).as_posix()}:{run_start}: {run} comment lines")
            run = 0
    return found


def test_no_numbered_history_in_the_product():
    found = history_violations(REPO)
    assert not found, "development history named (say what the code does, not when):\n" + "\n".join(found)


def test_no_long_comment_blocks():
    found = comment_block_violations(REPO)
    assert not found, (f"comment blocks longer than {MAX_COMMENT_BLOCK} lines (one line of why; the what "
                       "belongs in a docstring):\n" + "\n".join(found))


def test_the_checks_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(
        "A round-robin scheduler; HTTP issues; id 12.\n"
        f"Measured in {SESSION} 22 (2026-11-28).\nFixed in {ISSUE} #7.\n")
    (tmp_path / "factory").mkdir()
    (tmp_path / "factory" / "mod.py").write_text(
        "# one line of why\nx = 1\n" + "".join(f"# history {i}\n" for i in range(7))
        + 'y = """\n' + "".join(f"# not a comment {i}\n" for i in range(9)) + '"""\n')
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "s.sh").write_text("#!/bin/sh\n" + "# ok\n" * 6 + "true\n")
    (tmp_path / "Makefile").write_text("# a\n" * 7 + "all:\n\ttrue\n")

    assert history_violations(tmp_path) == [f"docs/page.md:2: {SESSION} 22, 2026-11-28", f"docs/page.md:3: {ISSUE} #7"]
    assert comment_block_violations(tmp_path) == ["factory/mod.py:3: 7 comment lines", "Makefile:1: 7 comment lines"]
