"""mkdocs hook: a page's links to repository files outside docs/ (`../factory/run.py`) become the file's
path as code, since the site holds only docs/; a link to a repository file that does not exist is a
warning, which fails the strict build. Links between pages are left to mkdocs' own validation."""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.repo_links")
LINK = re.compile(r"(?<!!)\[(?P<text>[^\]]+)\]\((?P<target>[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")
FENCE = re.compile(r"^(```|~~~)")


def _rewrite(line: str, page_dir: Path, docs: Path, root: Path, where: str) -> str:
    def one(match: re.Match) -> str:
        target = match["target"]
        if "://" in target or target.startswith(("/", "mailto:")):
            return match[0]
        path = (page_dir / target).resolve()
        if path == docs or docs in path.parents:
            return match[0]
        if root not in path.parents:
            return match[0]
        rel = path.relative_to(root).as_posix()
        if not path.exists():
            log.warning("%s: the link to %s names no file of the repository", where, target)
        text = match["text"]
        return text if text.startswith("`") else f"{text} (`{rel}`)"

    return LINK.sub(one, line)


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    page_dir = (docs / page.file.src_path).parent
    out, fenced = [], False
    for line in markdown.split("\n"):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        out.append(line if fenced else _rewrite(line, page_dir, docs, root, page.file.src_path))
    return "\n".join(out)
