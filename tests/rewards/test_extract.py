"""Answer extractors: hand-checked texts each extractor must read, and texts it must refuse."""

from __future__ import annotations

import pytest

from factory.rewards.extract import EXTRACTORS, extract, final_line, gsm8k_final, last_boxed


@pytest.mark.parametrize("text, expected", [
    (r"so the answer is \boxed{42}.", "42"),
    (r"\boxed{1} first, then \boxed{2}", "2"),  # the last one
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # nested braces kept whole
    (r"$\boxed{ x^{2} + 1 }$", "x^{2} + 1"),
    (r"\boxed{}", ""),
])
def test_last_boxed_reads_the_last_balanced_box(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("text", ["42", r"\boxed{42", r"\boxed 42", r"\fbox{42}", ""])
def test_last_boxed_refuses_texts_without_a_closed_box(text):
    assert last_boxed(text) is None


@pytest.mark.parametrize("text, expected", [
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72"),
    ("#### 1,000", "1,000"),  # as written: the numeric verifier reads the comma
    ("####72", "72"),
    ("first #### 3\nthen #### 5\n", "5"),  # the last one
    ("#### 7 \nsome words after", "7"),  # up to the end of its line
])
def test_gsm8k_reads_what_follows_the_last_marker(text, expected):
    assert gsm8k_final(text) == expected


@pytest.mark.parametrize("text", ["72", "### 72", "the answer is 72", "#### \n", ""])
def test_gsm8k_refuses_texts_without_a_marked_answer(text):
    assert gsm8k_final(text) is None


@pytest.mark.parametrize("text, expected", [
    ("working\nmore working\n  17  \n\n", "17"),
    ("one line", "one line"),
])
def test_final_line_is_the_last_line_with_text(text, expected):
    assert final_line(text) == expected


@pytest.mark.parametrize("text", ["", "\n  \n\t\n"])
def test_final_line_refuses_blank_texts(text):
    assert final_line(text) is None


def test_extract_by_name_and_without_one():
    assert sorted(EXTRACTORS) == ["boxed", "final_line", "gsm8k"]
    assert extract("gsm8k", "2 + 3 = 5\n#### 5") == "5"
    assert extract(None, "  keep as is\n") == "  keep as is\n"  # no extractor: the verifier normalises
    assert extract("boxed", None) is None
    with pytest.raises(KeyError, match="unknown answer extractor 'gsm'"):
        extract("gsm", "#### 5")
