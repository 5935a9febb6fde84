"""A small dataset in GSM8K's layout, made from reasoning-gym's arithmetic: no dataset hub is reachable
here, so `recipes/gsm8k_format.yaml` trains on this instead of GSM8K itself.

Each JSONL line is `{"question": ..., "answer": ...}`, the answer a worked line then `#### N`, as in
GSM8K (`{"question": "Calculate 47 + 97.", "answer": "47 + 97 = 144\\n#### 144"}`). The two files
are disjoint (no question in both) and made the same way every time:

    python -m factory.data.gsm8k_format recipes/data/gsm8k_format    # writes train.jsonl, test.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from factory.data.tasks import ReasoningGymSource, TaskFamilySpec

# the default recipe's family: sums of two numbers of one or two digits
ARITHMETIC = TaskFamilySpec("basic_arithmetic", {
    "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"],
    "allow_parentheses": False, "allow_negation": False})
TRAIN_ROWS, TEST_ROWS, SEED = 2000, 500, 0


def gsm8k_rows(train: int = TRAIN_ROWS, test: int = TEST_ROWS, seed: int = SEED,
               family: TaskFamilySpec = ARITHMETIC) -> dict[str, list[dict[str, str]]]:
    """{"train": rows, "test": rows} in GSM8K's layout from a basic_arithmetic `family` (fewer if it holds
    fewer distinct questions), disjoint, the same for the same arguments."""
    source = ReasoningGymSource([family], train_size=train, heldout_size=test, seed=seed)
    return {split: [{"question": t.question,
                     "answer": f"{t.metadata['rg_entry']['metadata']['expression']} = {t.answer}\n#### {t.answer}"}
                    for t in tasks]
            for split, tasks in (("train", source.train), ("test", source.heldout))}


def jsonl(rows: list[dict[str, str]]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the directory to write train.jsonl and test.jsonl into")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for split, rows in gsm8k_rows().items():
        (args.out / f"{split}.jsonl").write_text(jsonl(rows), encoding="utf-8")
        print(f"{args.out / f'{split}.jsonl'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
