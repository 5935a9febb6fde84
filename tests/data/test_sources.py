"""File sources: each kind loads (JSONL, Parquet, a `datasets` save_to_disk directory, an Iceberg
table), prompts from a field, a template or chat messages, held-out splits of their own or seeded,
verifiers per source or per row, a content fingerprint that follows the rows, and one-line errors for
bad sources.

tests/data/fixtures/hf_disk/ was written by `datasets` 5.2.0 itself (not a dependency here: the
loader reads the Arrow files with pyarrow):

    rows = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\\n#### {a + b}",
             "uid": f"q{a}{b}"} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    Dataset.from_list(rows).save_to_disk("hf_disk/dataset")
    DatasetDict({"train": Dataset.from_list(rows[:3]), "test": Dataset.from_list(rows[3:])}).save_to_disk(
        "hf_disk/dataset_dict")
    Dataset.from_list(rows).shuffle(seed=0).select([0, 1]).save_to_disk("hf_disk/selected")  # q56, q12
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from factory.data.sources import FileTaskSource
from factory.data.tasks import ReasoningGymSource, dataset_fingerprint
from factory.envs.single_turn import SingleTurnEnvironment
from factory.recipe import DataSource, EnvironmentSection, recipe_from_dict
from factory.rewards import score_answer

FIXTURES = Path(__file__).parent / "fixtures" / "hf_disk"
ROWS = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}", "uid": f"q{a}{b}"}
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
GSM8K = {"prompt": {"field": "question"}, "answer": {"field": "answer", "extract": "gsm8k"},
         "verifier": {"name": "numeric", "extract": "gsm8k"}}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def source(index: int = 0, **spec: Any) -> FileTaskSource:
    return FileTaskSource(DataSource.model_validate({"name": "mine", **GSM8K, **spec}), index)


def error_of(src: FileTaskSource) -> str:
    with pytest.raises(ValueError) as caught:
        _ = src.train
    message = str(caught.value)
    assert "\n" not in message
    return message


# ---- each kind loads --------------------------------------------------------------------------------


def test_jsonl_with_a_heldout_file_of_its_own(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:3])
    test = write_jsonl(tmp_path / "test.jsonl", ROWS[3:])
    src = source(kind="jsonl", path=str(train), heldout={"path": str(test)})
    assert [t.task_id for t in src.train] == ["mine/train/0", "mine/train/1", "mine/train/2"]
    assert [t.task_id for t in src.heldout] == ["mine/heldout/0"]
    first = src.train[0]
    assert (first.family, first.question, first.answer) == ("mine", "What is 1 + 2?", "1 + 2 = 3\n#### 3")
    assert first.metadata["reference"] == "3"
    assert first.metadata["verifier"] == {"name": "numeric", "extract": "gsm8k", "config": {}}


def test_parquet_with_a_seeded_split_and_ids(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    src = source(kind="parquet", path=str(path), id="uid", heldout={"size": 1, "seed": 3})
    assert len(src.train) == 3 and len(src.heldout) == 1
    assert {t.task_id for t in src.train + src.heldout} == {f"mine/{r['uid']}" for r in ROWS}
    assert {t.answer for t in src.heldout + src.train} == {r["answer"] for r in ROWS}


def test_hf_disk_dataset_dataset_dict_and_a_selection():
    single = source(kind="hf_disk", path=str(FIXTURES / "dataset"), id="uid", heldout={"fraction": 0.25})
    assert len(single.train) == 3 and len(single.heldout) == 1
    splits = source(kind="hf_disk", path=str(FIXTURES / "dataset_dict"), split="train", id="uid",
                    heldout={"split": "test"})
    assert [t.task_id for t in splits.train] == ["mine/q12", "mine/q34", "mine/q56"]
    assert [t.task_id for t in splits.heldout] == ["mine/q78"]
    # save_to_disk after shuffle + select writes the selected rows only, in their new order
    selected = source(kind="hf_disk", path=str(FIXTURES / "selected"), id="uid", heldout={"size": 1})
    assert sorted(t.task_id for t in selected.train + selected.heldout) == ["mine/q12", "mine/q56"]


@pytest.fixture
def lake(tmp_path) -> dict[str, str]:
    from factory.lake import open_catalog

    props = {"type": "sql", "uri": f"sqlite:///{tmp_path}/catalog.db", "warehouse": (tmp_path / "wh").as_uri()}
    catalog = open_catalog(props, namespace=None)
    catalog.create_namespace("mine")
    rows = [{**r, "split": "test" if r["uid"] == "q78" else "train"} for r in ROWS]
    arrow = pa.Table.from_pylist(rows)
    table = catalog.create_table(("mine", "questions"), schema=arrow.schema)
    table.append(arrow)
    return props


def test_iceberg_table_with_filters_for_each_split(lake):
    src = source(kind="iceberg", table="mine.questions", catalog=lake, where="split = 'train'", id="uid",
                 heldout={"where": "split = 'test'"})
    assert [t.task_id for t in src.train] == ["mine/q12", "mine/q34", "mine/q56"]  # by id: scans have no order
    assert [t.task_id for t in src.heldout] == ["mine/q78"]
    assert src.heldout[0].metadata["reference"] == "15"


def test_iceberg_names_the_tables_there_are(lake):
    src = source(kind="iceberg", table="mine.nope", catalog=lake, id="uid", heldout={"size": 1})
    assert error_of(src) == "data.sources[0].table: no table 'mine.nope' in the catalog; tables: mine.questions"
    src = source(kind="iceberg", table="mine.questions", catalog=lake, where="no_such_column = 1", id="uid",
                 heldout={"size": 1})
    assert error_of(src).startswith("data.sources[0].where: cannot filter mine.questions by 'no_such_column = 1' (")


# ---- prompts ---------------------------------------------------------------------------------------


def test_template_and_chat_messages_prompts(tmp_path):
    rows = [{"q": "2 + 2", "a": "4", "lang": "en"}, {"q": "3 + 3", "a": "6", "lang": "fr"}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    src = source(kind="jsonl", path=str(path), prompt={"template": "[{lang}] Compute {q}."},
                 answer={"field": "a"}, verifier=None, heldout={"size": 1})
    assert sorted(t.question for t in src.train + src.heldout) == ["[en] Compute 2 + 2.", "[fr] Compute 3 + 3."]
    assert src.train[0].metadata["verifier"]["name"] == "exact"  # the default

    chats = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}], "a": 4},
             {"messages": [{"role": "user", "content": "3 + 3?"}], "a": 6}]
    path = write_jsonl(tmp_path / "c.jsonl", chats)
    train = write_jsonl(tmp_path / "c_train.jsonl", [{"messages": [{"role": "user", "content": "1 + 1?"}], "a": 2}])
    src = source(kind="jsonl", path=str(train), prompt={"messages_field": "messages"}, answer={"field": "a"},
                 verifier={"name": "numeric"}, heldout={"path": str(path)}, id=None)
    env = SingleTurnEnvironment(EnvironmentSection(system_prompt="You add."))
    task = next(t for t in src.heldout if t.answer == "4")
    assert env.prompt_messages(task) == [{"role": "system", "content": "You add."},
                                         {"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "2 + 2?"}]
    assert task.question == "system: Be brief.\nuser: 2 + 2?"


def test_every_training_row_whose_prompt_is_held_out_is_left_out(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    test = write_jsonl(tmp_path / "test.jsonl", ROWS[1:2])
    src = source(kind="jsonl", path=str(train), heldout={"path": str(test)})
    assert len(src.train) == 3 and src.dropped == 1
    assert "What is 3 + 4?" not in {t.question for t in src.train}


# ---- seeded split ----------------------------------------------------------------------------------


def test_seeded_split_is_exact_stable_and_moves_one_row_when_one_is_added(tmp_path):
    rows = [{"q": f"q{i}", "a": str(i), "id": f"r{i}"} for i in range(200)]
    spec = {"kind": "jsonl", "prompt": {"field": "q"}, "answer": {"field": "a"}, "verifier": {"name": "exact"},
            "id": "id", "heldout": {"size": 50, "seed": 1}}
    a = source(path=str(write_jsonl(tmp_path / "a.jsonl", rows)), **spec)
    b = source(path=str(write_jsonl(tmp_path / "b.jsonl", rows)), **spec)
    held = {t.task_id for t in a.heldout}
    assert len(held) == 50 and len(a.train) == 150 and held == {t.task_id for t in b.heldout}
    assert not held & {t.task_id for t in a.train}
    other_seed = source(path=str(tmp_path / "a.jsonl"), **{**spec, "heldout": {"size": 50, "seed": 2}})
    assert {t.task_id for t in other_seed.heldout} != held
    grown = source(path=str(write_jsonl(tmp_path / "c.jsonl", rows + [{"q": "new", "a": "0", "id": "new"}])), **spec)
    assert len(held - {t.task_id for t in grown.heldout}) <= 1


# ---- verifiers per row, and code tests from the source -------------------------------------------


def test_a_verifier_per_row(tmp_path):
    rows = [{"q": "Capital of France?", "a": "Paris", "v": "exact"},
            {"q": "Half of 1?", "a": r"\frac{1}{2}", "v": "math_verify"},
            {"q": "Colour?", "a": "colou?r", "v": {"name": "regex", "config": {"ignore_case": True}}},
            {"q": "Pi?", "a": "3.14159", "v": {"name": "numeric", "extract": "boxed", "config": {"abs_tol": 0.01}}}]
    path = write_jsonl(tmp_path / "v.jsonl", rows)
    train = write_jsonl(tmp_path / "v_train.jsonl", [{"q": "Capital of Italy?", "a": "Rome", "v": "exact"}])
    src = source(kind="jsonl", path=str(train), prompt={"field": "q"}, answer={"field": "a"}, verifier=None,
                 verifier_field="v", heldout={"path": str(path)})
    by_q = {t.question: t for t in src.heldout}
    score = lambda reply, q: asyncio.run(score_answer(reply, by_q[q]))[0]  # noqa: E731
    assert (score(" paris ", "Capital of France?"), score("Lyon", "Capital of France?")) == (1.0, 0.0)
    assert (score("0.5", "Half of 1?"), score("0.25", "Half of 1?")) == (1.0, 0.0)
    assert (score("COLOR", "Colour?"), score("colr", "Colour?")) == (1.0, 0.0)
    assert (score(r"\boxed{3.14}", "Pi?"), score("3.14", "Pi?")) == (1.0, 0.0)  # no box: no answer


CODE_ROW = {"task": "add", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n", "fn": "add",
            "tests": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n",
            "solution": "    return a + b\n"}


# ---- the fingerprint -------------------------------------------------------------------------------


def test_the_fingerprint_follows_the_rows_not_the_file(tmp_path):
    (tmp_path / "a").mkdir()
    train = write_jsonl(tmp_path / "a" / "train.jsonl", ROWS)

    def data(path: Path, **extra: Any):
        spec = {"name": "mine", "kind": "jsonl", "path": str(path), **GSM8K, "heldout": {"size": 1}, **extra}
        return recipe_from_dict({"data": {"sources": [spec]}}).data

    first = dataset_fingerprint(data(train))
    assert dataset_fingerprint(data(train)) == first
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert dataset_fingerprint(data(tmp_path / "b" / "train.jsonl")) == first  # moved: the same data
    changed = [dict(r) for r in ROWS]
    changed[2]["question"] = "What is 5 + 6 ?"
    write_jsonl(train, changed)
    assert dataset_fingerprint(data(train)) != first  # one row changed
    write_jsonl(train, ROWS)
    assert dataset_fingerprint(data(train)) == first
    assert dataset_fingerprint(data(train, heldout={"size": 1, "seed": 1})) != first  # another split


def test_a_runs_origin_names_its_dataset(tmp_path):
    from factory.recording import lineage

    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    spec = {"name": "mine", "kind": "jsonl", "path": str(train), **GSM8K, "heldout": {"size": 1}}
    recipe = recipe_from_dict({"data": {"sources": [spec]}})
    origin = lineage.origin(recipe, None)
    assert origin["dataset"] == dataset_fingerprint(recipe.data)
    assert lineage.mlflow_tags(origin)["factory.dataset"] == origin["dataset"]


def test_families_keep_their_fingerprint_and_mix_with_sources(tmp_path):
    import hashlib

    families_only = recipe_from_dict({}).data
    old = hashlib.sha256(json.dumps(families_only.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]
    assert "sources" not in families_only.model_dump() and dataset_fingerprint(families_only) == old
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    data = recipe_from_dict({"data": {
        "families": [{"name": "basic_arithmetic"}], "train_size": 20, "heldout_size": 10,
        "sources": [{"name": "mine", "kind": "jsonl", "path": str(train), **GSM8K, "heldout": {"size": 1}}]}}).data
    mixed = ReasoningGymSource.from_recipe(data)
    assert [t.family for t in mixed.train].count("mine") == 3 and len(mixed.train) == 23
    assert [t.family for t in mixed.heldout].count("mine") == 1 and len(mixed.heldout) == 11
    assert recipe_from_dict({"data": {"sources": data.model_dump()["sources"]}}).data.families == []


# ---- bad sources: one line each, naming the field, the file and the columns there are -------------


def test_a_missing_file_or_directory(tmp_path):
    assert error_of(source(kind="jsonl", path=str(tmp_path / "no.jsonl"), heldout={"size": 1})) == \
        f"data.sources[0].path: {tmp_path / 'no.jsonl'}: no such file"
    assert error_of(source(2, kind="hf_disk", path=str(tmp_path / "nodir"), heldout={"size": 1})) == \
        f"data.sources[2].path: {tmp_path / 'nodir'}: no such directory"
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    assert error_of(source(kind="jsonl", path=str(train), heldout={"path": str(tmp_path / "test.jsonl")})) == \
        f"data.sources[0].heldout.path: {tmp_path / 'test.jsonl'}: no such file"


def test_a_missing_column_lists_the_columns_there_are(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    assert error_of(source(kind="jsonl", path=str(train), prompt={"field": "questoin"}, heldout={"size": 1})) == \
        f"data.sources[0].prompt.field: no column 'questoin' in {train}:1; columns: answer, question, uid"
    assert error_of(source(kind="jsonl", path=str(train), prompt={"template": "Q: {query}"}, heldout={"size": 1})) == \
        f"data.sources[0].prompt.template: no column 'query' in {train}:1; columns: answer, question, uid"
    parquet = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    assert error_of(source(kind="parquet", path=str(parquet), id="id", heldout={"size": 1})) == \
        f"data.sources[0].id: no column 'id' in {parquet} row 0; columns: answer, question, uid"
    code = write_jsonl(tmp_path / "code.jsonl", [CODE_ROW])
    assert error_of(source(kind="jsonl", path=str(code), prompt={"field": "prompt"}, answer={"field": "solution"},
                           verifier={"name": "code"}, heldout={"size": 1})) == \
        f"data.sources[0].verifier.config: no column 'test' in {code}:1; columns: fn, prompt, solution, task, tests"


def test_empty_splits(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    train = write_jsonl(tmp_path / "train.jsonl", ROWS)
    assert error_of(source(kind="jsonl", path=str(empty), heldout={"size": 1})) == \
        f"data.sources[0].path: {empty} holds no rows (an empty split)"
    assert error_of(source(kind="jsonl", path=str(train), heldout={"path": str(empty)})) == \
        f"data.sources[0].heldout.path: {empty} holds no rows (an empty split)"
    assert error_of(source(kind="jsonl", path=str(train), heldout={"size": 4})) == \
        "data.sources[0].heldout.size: holding out 4 of 4 rows leaves no training rows"
    assert error_of(source(kind="jsonl", path=str(train), heldout={"fraction": 0.1})) == \
        "data.sources[0].heldout.fraction: 0.1 of 4 rows holds out none"
    assert error_of(source(kind="jsonl", path=str(train), heldout={"path": str(train)})) == \
        "data.sources[0]: every training row's prompt is also held out (an empty split)"
    assert error_of(source(kind="hf_disk", path=str(FIXTURES / "dataset_dict"), heldout={"size": 1})) == \
        f"data.sources[0].split: {FIXTURES / 'dataset_dict'} is a DatasetDict: give its split, one of train, test"
    assert error_of(source(kind="hf_disk", path=str(FIXTURES / "dataset_dict"), split="train",
                           heldout={"split": "validation"})) == \
        f"data.sources[0].heldout.split: {FIXTURES / 'dataset_dict'}: no split 'validation'; splits: train, test"


def test_duplicate_ids(tmp_path):
    rows = [{**r, "uid": "same" if r["uid"] in ("q34", "q78") else r["uid"]} for r in ROWS]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    assert error_of(source(kind="jsonl", path=str(path), id="uid", heldout={"size": 1})) == \
        f"data.sources[0].id: duplicate id 'same' at {path}:4 (first at {path}:2)"
    train = write_jsonl(tmp_path / "train.jsonl", ROWS[:2])
    test = write_jsonl(tmp_path / "test.jsonl", [{**ROWS[3], "uid": "q12"}])
    assert error_of(source(kind="jsonl", path=str(train), id="uid", heldout={"path": str(test)})) == \
        f"data.sources[0].id: duplicate id 'q12' at {test}:1 (first at {train}:1)"


def test_bad_rows(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    assert error_of(source(kind="jsonl", path=str(path), heldout={"size": 1})) == \
        f"data.sources[0].path: {path}:2: invalid JSON (Expecting property name enclosed in double quotes)"
    path = write_jsonl(tmp_path / "no_marker.jsonl", [ROWS[0], {"question": "q", "answer": "just 5"}])
    assert error_of(source(kind="jsonl", path=str(path), heldout={"size": 1})) == \
        f"data.sources[0].answer.extract: {path}:2: gsm8k finds no answer in 'just 5'"
    path = write_jsonl(tmp_path / "not_a_number.jsonl", [{"question": "q", "answer": "#### five"}, ROWS[0]])
    assert error_of(source(kind="jsonl", path=str(path), heldout={"size": 1})) == \
        f"data.sources[0].verifier: {path}:1: reference 'five' is not a number"
    path = write_jsonl(tmp_path / "empty_answer.jsonl", [{"question": "q", "answer": ""}, ROWS[0]])
    assert error_of(source(kind="jsonl", path=str(path), heldout={"size": 1})) == \
        f"data.sources[0].answer.field: {path}:1: expected non-empty text or a number, got ''"
    path = write_jsonl(tmp_path / "per_row.jsonl", [{"q": "a", "a": "1", "v": "nope"}, {"q": "b", "a": "2", "v": "exact"}])
    assert error_of(source(kind="jsonl", path=str(path), prompt={"field": "q"}, answer={"field": "a"}, verifier=None,
                           verifier_field="v", heldout={"size": 1})) == (
        f"data.sources[0].verifier_field: {path}:1: name: unknown verifier 'nope'; choose one of "
        "['code', 'exact', 'math_verify', 'numeric', 'reasoning_gym', 'regex']")
    chats = write_jsonl(tmp_path / "chat.jsonl", [{"m": [{"role": "assistant", "content": "hi"}], "a": "1"}] * 2)
    assert error_of(source(kind="jsonl", path=str(chats), prompt={"messages_field": "m"}, answer={"field": "a"},
                           verifier=None, heldout={"size": 1})) == (
        f"data.sources[0].prompt.messages_field: {chats}:1: the last message is the assistant's; the prompt "
        "ends with the user's")
    parquet = tmp_path / "not.parquet"
    parquet.write_text("plain text")
    assert error_of(source(kind="parquet", path=str(parquet), heldout={"size": 1})).startswith(
        f"data.sources[0].path: {parquet}: not a Parquet file (")
