"""Answer extractors: the final answer inside a longer text, by name.

A source names one for its reference answers (`answer.extract`: GSM8K's reference solutions end in
`#### 72`) and one for the model's replies (`verifier.extract`). Each returns the answer's text,
stripped, or None when the text holds none (a reply without the format earns no reward; a
reference without it is a data error).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from factory.core import registries
from factory.core.registry import Registry

Extractor = Callable[[str], str | None]

EXTRACTORS: Registry[Extractor] = registries.EXTRACTORS

_GSM8K = re.compile(r"####[ \t]*([^\n]*)")


@EXTRACTORS.decorator("boxed")
def last_boxed(text: str) -> str | None:
    r"""The contents of the last `\boxed{...}` (braces inside it balanced: `\boxed{\frac{1}{2}}` gives
    `\frac{1}{2}`); None if there is none or it is never closed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i].strip()
            depth -= 1
    return None


@EXTRACTORS.decorator("gsm8k")
def gsm8k_final(text: str) -> str | None:
    """What follows the last `####` on its line, stripped (GSM8K's `#### 72`); None if no `####` or
    nothing after it."""
    found = _GSM8K.findall(text)
    return (found[-1].strip() or None) if found else None


@EXTRACTORS.decorator("final_line")
def final_line(text: str) -> str | None:
    """The last line that is not blank, stripped; None for a blank text."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


def extract(name: str | None, text: str | None) -> str | None:
    """`text` through the extractor `name`; with no name, the whole text as it is (each verifier
    normalises what it compares; a code reply's indentation matters)."""
    if text is None or name is None:
        return text
    return EXTRACTORS[name](text)
