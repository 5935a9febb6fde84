"""The tested code blocks of the docs pages (pure: text in, blocks and scripts out).

A fenced ```bash / ```sh / ```shell block is run, a ```yaml block is checked as a recipe; other fences
(```text for output samples) are not tested. HTML comments on the lines directly above a fence control it:

    <!-- test: skip: needs a GPU -->                      skipped with that reason (a GPU or a cluster
                                                          only: a skip cannot hide a broken block)
    <!-- test: overrides train.steps=2 eval.heldout=8 -->  appended to each `factory run` line of the block
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

# the pages whose blocks are tested, from the repo root
PAGES = ("README.md", "docs/getting-started.md", "docs/recipes.md", "docs/own-model-and-data.md")

RUN_LANGS = frozenset({"bash", "sh", "shell"})
CHECK_LANGS = frozenset({"yaml", "yml"})

# a skip may only name what this machine cannot give: a GPU, a cluster, a server that stays up
SKIP_REASON = re.compile(r"\b(gpus?|cuda|cluster)\b", re.IGNORECASE)

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\s]*)[^`]*$")
_MARKER = re.compile(r"^[ \t]*<!--\s*test:\s*(?P<body>.*?)\s*-->[ \t]*$")
_ANY_MARKER = re.compile(r"<!--\s*test:")
_RUN = re.compile(r"^(?:\w+=\S*\s+)*(?:factory|python3? -m factory\.cli)\s+run(?:\s|$)")
_MAKE = re.compile(r"^make\s+(?P<targets>[\w\s-]+?)\s*$")
_PLACEHOLDER = re.compile(r"<[a-z][\w -]*>")


class MarkerError(ValueError):
    """A marker the parser refuses: one line naming the page and line."""


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # the opening fence's line, 1-based
    lang: str  # "bash" (run) or "yaml" (checked)
    text: str
    skip: str | None = None
    overrides: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse(text: str, page: str) -> list[Block]:
    """The tested blocks of one page, in page order; MarkerError for a marker it cannot apply."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: list[tuple[int, str]] = []  # markers on the lines directly above the next line
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.match(line)
        if marker:
            pending.append((i + 1, marker.group("body")))
            i += 1
            continue
        if _ANY_MARKER.search(line):
            raise MarkerError(f"{page}:{i + 1}: a test marker must be alone on its line: <!-- test: ... -->")
        fence = _FENCE.match(line)
        if not fence:
            if pending:
                raise MarkerError(f"{page}:{pending[0][0]}: a test marker must sit directly above a ``` fence")
            i += 1
            continue
        indent, mark, lang = fence.group("indent"), fence.group("fence"), fence.group("info").lower()
        end = i + 1
        while end < len(lines) and not re.match(rf"^[ \t]*{re.escape(mark[0])}{{{len(mark)},}}[ \t]*$", lines[end]):
            end += 1
        body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end])
        skip, overrides = _apply(pending, page, lang)
        pending = []
        if lang in RUN_LANGS or lang in CHECK_LANGS:
            blocks.append(Block(page, i + 1, "bash" if lang in RUN_LANGS else "yaml", body + "\n", skip, overrides))
        i = end + 1
    if pending:
        raise MarkerError(f"{page}:{pending[0][0]}: a test marker must sit directly above a ``` fence")
    return blocks


def _apply(markers: list[tuple[int, str]], page: str, lang: str) -> tuple[str | None, tuple[str, ...]]:
    skip: str | None = None
    overrides: tuple[str, ...] = ()
    tested = lang in RUN_LANGS or lang in CHECK_LANGS
    for number, body in markers:
        where = f"{page}:{number}"
        if not tested:
            raise MarkerError(f"{where}: a test marker above a ```{lang or ''} fence, which is not tested "
                              f"(only {', '.join(sorted(RUN_LANGS | CHECK_LANGS))} blocks are)")
        if body.startswith("skip:"):
            skip = body[len("skip:"):].strip()
            if not SKIP_REASON.search(skip):
                raise MarkerError(f"{where}: skip reason {skip!r} is not accepted: a block is skipped only where it "
                                  "needs a GPU or a cluster; fix the block instead")
        elif body.startswith("overrides"):
            if lang not in RUN_LANGS:
                raise MarkerError(f"{where}: overrides apply to the `factory run` lines of a shell block, "
                                  f"not to a ```{lang} block")
            try:
                overrides = tuple(shlex.split(body[len("overrides"):]))
            except ValueError as err:
                raise MarkerError(f"{where}: overrides: {err}") from None
            if not overrides or not all("=" in o for o in overrides):
                raise MarkerError(f"{where}: overrides must be dotted key=value pairs, got {body!r}")
        else:
            raise MarkerError(f"{where}: unknown test marker {body!r} (skip: REASON, or overrides key=value ...)")
    return skip, overrides


def page_blocks(root: Path, pages: tuple[str, ...] = PAGES) -> list[Block]:
    """Every tested block of the pages that exist under `root`."""
    out: list[Block] = []
    for page in pages:
        path = root / page
        if path.is_file():
            out += parse(path.read_text(encoding="utf-8"), page)
    return out


# ---- a shell block as the script that runs it ---------------------------------------------------------

def logical_lines(text: str) -> list[tuple[int, str]]:
    """(offset of its first line in the block, the command with its `\\` continuations joined)."""
    out: list[tuple[int, str]] = []
    start, parts = 0, list[str]()
    for n, line in enumerate(text.splitlines()):
        if not parts:
            start = n
        if line.rstrip().endswith("\\") and not line.lstrip().startswith("#"):
            parts.append(line.rstrip()[:-1])
            continue
        parts.append(line)
        out.append((start, "\n".join(parts) if len(parts) == 1 else " ".join(p.strip() for p in parts)))
        parts = []
    if parts:
        out.append((start, " ".join(p.strip() for p in parts)))
    return out


def split_comment(line: str) -> tuple[str, str]:
    """(the command, its trailing `# comment` or ""), outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip(), line[i:]
    return line.rstrip(), ""


@dataclass(frozen=True)
class Server:
    """A command that starts a server which stays up: run in the background until `port` answers HTTP."""
    prefix: str  # the command's first words
    port_flag: str  # the flag that sets its port (replaced, or added, with a free port)
    what: str


@dataclass
class Script:
    text: str
    runs: list[str] = field(default_factory=list)  # each `factory run` command, with the block's overrides
    make_targets: list[str] = field(default_factory=list)  # `make` targets named, not run
    servers: list[str] = field(default_factory=list)  # server commands, with the port they get
    placeholders: list[str] = field(default_factory=list)  # `<run>`-style words a reader must fill in


def server_of(command: str, servers: tuple[Server, ...]) -> Server | None:
    words = command.split()
    return next((s for s in servers if words[:len(s.prefix.split())] == s.prefix.split()), None)


def with_port(command: str, server: Server, port: int) -> str:
    flag = re.escape(server.port_flag)
    new, n = re.subn(rf"(\s{flag})(=|\s+)\d+\b", rf"\g<1>\g<2>{port}", command)
    return new if n else f"{command} {server.port_flag} {port}"


def script(block: Block, servers: tuple[Server, ...], not_run_make: Mapping[str, str],
           free_port: Callable[[], int], state: str | None = None) -> Script:
    """The bash script that runs `block`: its `factory run` lines with the block's overrides, each server
    line started in the background until it answers (`docs_server`, defined by the caller's prelude),
    the `make` targets in `not_run_make` named instead of run, and `.state` read as `state`."""
    out = Script("")
    lines = []
    for _, line in logical_lines(block.text):
        command, comment = split_comment(line)
        bare = command.strip()
        if not bare:
            lines.append(line)
            continue
        out.placeholders += _PLACEHOLDER.findall(re.sub(r"'[^']*'|\"[^\"]*\"", "", bare))  # quoted: literal text
        if state is not None:
            bare = re.sub(r"(?:(?<![\w./-])|(?<=:///))\.state(?=[/\s'\"]|$)", state, bare)  # also sqlite:///.state
        make = _MAKE.match(bare)
        server = server_of(bare, servers)
        if make and all(t in not_run_make for t in make.group("targets").split()):
            out.make_targets += make.group("targets").split()
            lines.append(f": {shlex.quote(bare)}  # not run here: {not_run_make[make.group('targets').split()[0]]}")
        elif _RUN.match(bare):
            run = " ".join([bare, *map(shlex.quote, block.overrides)])
            out.runs.append(run)
            lines.append(f"{run}  {comment}".rstrip())
        elif server is not None:
            started = with_port(bare, server, port := free_port())
            out.servers.append(started)
            lines.append(f"docs_server {port} {shlex.quote(started)}  {comment}".rstrip())
        else:
            lines.append(f"{bare}  {comment}".rstrip())
    out.text = "\n".join(lines) + "\n"
    return out
