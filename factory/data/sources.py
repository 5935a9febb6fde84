"""Tasks from a user's own rows: a JSONL file, a Parquet file, a `datasets` directory written by
`save_to_disk` (read with pyarrow: Arrow stream files listed in its state.json), or an Iceberg table.

A recipe's `data.sources[i]` (`factory.recipe.DataSource`) says which column (or template, or chat
messages) gives the prompt, which the answer and which the id, how replies are scored (a verifier by
name, for the whole source or per row), and where the held-out split comes from: rows of its own, or
a seeded share of the source's rows (the rows whose sha256(seed/id) is smallest: the same rows for
the same seed, and one added row moves at most one other across the split).

Every problem is one ValueError line naming the recipe field and the file and row, listing the
columns that exist when one is missing: a missing file or column, an empty split, a duplicate id, a
reference the answer extractor cannot read, a row's verifier that is not one.

`content_digest` hashes the rows as read (every column, in order) and the source's options, so
the dataset's fingerprint follows the data, not where it lies: moving a file keeps it, editing a
row changes it.
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from factory.paths import REPO_ROOT
from factory.rewards.extract import extract
from factory.rewards.verifiers import VERIFIERS, spec_problems, with_defaults
from factory.core.types import Task

_CHAT_ROLES = ("system", "user", "assistant")
_rows_cache: dict[tuple, tuple[list[dict[str, Any]], list[str]]] = {}


@dataclass(frozen=True)
class Location:
    """Where rows are read from: a kind, its path (or table and filter) and split."""

    kind: str
    path: str | None = None
    split: str | None = None
    table: str | None = None
    where: str | None = None
    catalog: tuple[tuple[str, str], ...] = ()

    def describe(self) -> str:
        if self.kind == "iceberg":
            return f"table {self.table}" + (f" where {self.where}" if self.where else "")
        return f"{self.path}" + (f" split {self.split}" if self.split else "")


class RowsError(ValueError):
    """A problem reading rows: `field` is the location field it concerns (path, split, table, where)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


def resolve_path(path: str | None) -> str | None:
    """A source's path as the recipe gives it: absolute, relative to the current directory, or else to the
    repository (as the launchpad reads recipe paths), so a shipped recipe's data is found from anywhere."""
    if path is None or Path(path).is_absolute() or Path(path).exists() or not (REPO_ROOT / path).exists():
        return path
    return str(REPO_ROOT / path)


# ---- reading rows: (rows, the label of each row for messages) ------------------------------------


def read_rows(location: Location) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows at `location` as dicts, and where each is ("train.jsonl:12", "data.parquet row 3").
    Cached per process by the files' sizes and mtimes (an Iceberg table: by its snapshot)."""
    key = (location, _stamp(location))
    if key not in _rows_cache:
        reader = {"jsonl": _read_jsonl, "parquet": _read_parquet, "hf_disk": _read_hf_disk,
                  "iceberg": _read_iceberg}[location.kind]
        _rows_cache[key] = reader(location)
    rows, labels = _rows_cache[key]
    return [dict(r) for r in rows], labels


def _stamp(location: Location) -> tuple:
    if location.kind == "iceberg":
        table = _iceberg_table(location)
        snapshot = table.current_snapshot()
        return (snapshot.snapshot_id if snapshot else None,)
    path = Path(location.path or "")
    if not path.exists():
        raise RowsError("path", f"{path}: no such {'directory' if location.kind == 'hf_disk' else 'file'}")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)


def _read_jsonl(location: Location) -> tuple[list[dict[str, Any]], list[str]]:
    path = Path(location.path or "")
    if not path.is_file():
        raise RowsError("path", f"{path}: not a file")
    rows, labels = [], []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise RowsError("path", f"{path}:{number}: invalid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise RowsError("path", f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
            labels.append(f"{path}:{number}")
    return rows, labels


def _table_rows(table, name: str) -> tuple[list[dict[str, Any]], list[str]]:
    rows = table.to_pylist()
    return rows, [f"{name} row {i}" for i in range(len(rows))]


def _read_parquet(location: Location) -> tuple[list[dict[str, Any]], list[str]]:
    import pyarrow.parquet as pq

    path = Path(location.path or "")
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise RowsError("path", f"{path}: not a Parquet file ({str(err).splitlines()[0]})") from None
    return _table_rows(table, str(path))


def _read_hf_disk(location: Location) -> tuple[list[dict[str, Any]], list[str]]:
    """A `Dataset.save_to_disk` directory (state.json names its Arrow stream files), or a
    `DatasetDict`'s (dataset_dict.json names its splits, one such directory each)."""
    import pyarrow as pa

    path = Path(location.path or "")
    splits_file = path / "dataset_dict.json"
    if splits_file.is_file():
        splits = json.loads(splits_file.read_text()).get("splits", [])
        if location.split is None:
            raise RowsError("split", f"{path} is a DatasetDict: give its split, one of {', '.join(splits)}")
        if location.split not in splits:
            raise RowsError("split", f"{path}: no split {location.split!r}; splits: {', '.join(splits)}")
        path = path / location.split
    elif location.split is not None:
        raise RowsError("split", f"{path} is a single Dataset (no dataset_dict.json): it has no split {location.split!r}")
    state = path / "state.json"
    if not state.is_file():
        raise RowsError("path", f"{path}: not a save_to_disk directory (no state.json)")
    tables = []
    for entry in json.loads(state.read_text()).get("_data_files", []):
        with pa.memory_map(str(path / entry["filename"])) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    if not tables:
        return [], []
    return _table_rows(pa.concat_tables(tables), str(path))


def _iceberg_table(location: Location):
    from pyiceberg.exceptions import NoSuchTableError

    from factory.lake import open_catalog

    catalog = open_catalog(dict(location.catalog), namespace=None)
    name = location.table or ""
    if "." not in name:
        raise RowsError("table", f"{name!r}: name the table as namespace.table, e.g. factory.tasks")
    try:
        return catalog.load_table(tuple(name.rsplit(".", 1)))
    except NoSuchTableError:
        known = [".".join(t) for ns in catalog.list_namespaces() for t in catalog.list_tables(ns)]
        raise RowsError("table", f"no table {name!r} in the catalog; tables: {', '.join(sorted(known)) or 'none'}") from None


def _read_iceberg(location: Location) -> tuple[list[dict[str, Any]], list[str]]:
    table = _iceberg_table(location)
    try:
        scanned = table.scan(row_filter=location.where) if location.where else table.scan()
        arrow = scanned.to_arrow()
    except Exception as err:  # pyiceberg raises parser and binding errors of several kinds for a bad filter
        raise RowsError("where", f"cannot filter {location.table} by {location.where!r} "
                        f"({str(err).splitlines()[0]})") from None
    return _table_rows(arrow, str(location.table))


# ---- rows -> tasks ---------------------------------------------------------------------------------


def _columns(row: dict[str, Any]) -> str:
    return ", ".join(sorted(row)) or "none"


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str, ensure_ascii=False)


class FileTaskSource:
    """Train and held-out tasks from one `DataSource` (`spec`), the recipe's `data.sources[index]`.
    Reading and checking happen on first use of `train`, `heldout` or `content_digest`."""

    def __init__(self, spec, index: int):
        self.spec = spec
        self.field = f"data.sources[{index}]"
        self.dropped = 0  # training rows left out because their prompt is held out

    # where rows come from

    def _location(self, path: str | None = None, split: str | None = None, table: str | None = None,
                  where: str | None = None) -> Location:
        """The source's location, with the parts given here (the held-out split's own) replacing its own."""
        s = self.spec
        return Location(s.kind, resolve_path(path or s.path), split or s.split, table or s.table, where or s.where,
                        tuple(sorted((k, str(v)) for k, v in s.catalog.items())))

    def _read(self, location: Location, prefix: str = "") -> tuple[list[dict[str, Any]], list[str]]:
        """Rows and their labels; `prefix` "heldout." for the held-out split's own rows."""
        try:
            rows, labels = read_rows(location)
        except RowsError as err:
            raise ValueError(f"{self.field}.{prefix}{err.field}: {err}") from None
        if not rows:
            field = "table" if location.kind == "iceberg" else "path"
            raise ValueError(f"{self.field}.{prefix}{field}: {location.describe()} holds no rows (an empty split)")
        return rows, labels

    @cached_property
    def _splits(self) -> tuple[list[Task], list[Task], str]:
        h = self.spec.heldout
        rows, labels = self._read(self._location())
        digest = hashlib.sha256(_canonical(self._options()).encode())
        if h.size is None and h.fraction is None:
            held_rows, held_labels = self._read(self._location(path=h.path, split=h.split, table=h.table, where=h.where),
                                                "heldout.")
            train, heldout = self._tasks(rows, labels, "train"), self._tasks(held_rows, held_labels, "heldout")
            self._check_unique(train + heldout, labels + held_labels)
            parts = [rows, held_rows]
        else:
            tasks = self._tasks(rows, labels, None)
            self._check_unique(tasks, labels)
            train, heldout = self._seeded_split(tasks)
            parts = [rows]
        for part in parts:
            digest.update(b"\x00split\x00")
            for row in part:
                digest.update(_canonical(row).encode() + b"\n")
        if self.spec.kind == "iceberg":  # a table's scan order is not stable: order by id
            train.sort(key=lambda t: t.task_id)
            heldout.sort(key=lambda t: t.task_id)
        held_prompts = {t.question for t in heldout}
        kept = [t for t in train if t.question not in held_prompts]
        self.dropped = len(train) - len(kept)
        if not kept:
            raise ValueError(f"{self.field}: every training row's prompt is also held out (an empty split)")
        return kept, heldout, digest.hexdigest()[:16]

    def _seeded_split(self, tasks: list[Task]) -> tuple[list[Task], list[Task]]:
        """(train, heldout): the `size` (or `fraction`) tasks whose sha256(seed/id) is smallest are held out,
        both splits in row order."""
        h = self.spec.heldout
        field = f"{self.field}.heldout.{'size' if h.size is not None else 'fraction'}"
        n = h.size if h.size is not None else round(h.fraction * len(tasks))
        if n >= len(tasks):
            raise ValueError(f"{field}: holding out {n} of {len(tasks)} rows leaves no training rows")
        if n == 0:
            raise ValueError(f"{field}: {h.fraction} of {len(tasks)} rows holds out none")
        rank = sorted(range(len(tasks)), key=lambda i: hashlib.sha256(f"{h.seed}/{tasks[i].task_id}".encode()).digest())
        held = set(rank[:n])
        return ([t for i, t in enumerate(tasks) if i not in held], [t for i, t in enumerate(tasks) if i in held])

    def _options(self) -> dict[str, Any]:
        """The source's options without where its rows lie (moving a file keeps the fingerprint)."""
        options = self.spec.model_dump(mode="json", exclude={"path", "table", "catalog"})
        options["heldout"] = {k: v for k, v in options["heldout"].items() if k not in ("path", "table")}
        return options

    @property
    def train(self) -> list[Task]:
        return self._splits[0]

    @property
    def heldout(self) -> list[Task]:
        return self._splits[1]

    @property
    def content_digest(self) -> str:
        """16 hex digits over the source's options and every row it read (all columns, in order)."""
        return self._splits[2]

    def describe(self) -> str:
        s = self.spec
        held = (s.heldout.path or s.heldout.split or s.heldout.table or s.heldout.where
                or (f"seeded {s.heldout.size or s.heldout.fraction}, seed {s.heldout.seed}"))
        verifier = (f"verifier {s.verifier.name}" + (f" (extract {s.verifier.extract})" if s.verifier.extract else "")
                    if s.verifier else f"verifier per row ({s.verifier_field})" if s.verifier_field else "verifier exact")
        note = f"; {self.dropped} training rows left out: their prompt is held out" if self.dropped else ""
        return (f"{s.name} ({s.kind} {self._location().describe()}): {len(self.train)} train, "
                f"{len(self.heldout)} heldout ({held}), {verifier}{note}")

    # one row -> one task

    def _tasks(self, rows: list[dict[str, Any]], labels: list[str], split: str | None) -> list[Task]:
        self._check_columns(rows, labels)
        verifiers: dict[str, dict[str, Any]] = {}  # a row's verifier value (as JSON) -> its spec, checked once
        return [self._task(row, label, i, split, verifiers) for i, (row, label) in enumerate(zip(rows, labels))]

    def _needed(self) -> dict[str, str]:
        """Recipe field -> the column it names, for every column every row must have."""
        s = self.spec
        needed = {"answer.field": s.answer.field}
        if s.prompt.field is not None:
            needed["prompt.field"] = s.prompt.field
        if s.prompt.messages_field is not None:
            needed["prompt.messages_field"] = s.prompt.messages_field
        for name in _template_fields(s.prompt.template):
            needed[f"prompt.template {{{name}}}"] = name
        if s.id is not None:
            needed["id"] = s.id
        if s.verifier_field is not None:
            needed["verifier_field"] = s.verifier_field
        if s.verifier is not None:
            config = with_defaults(s.verifier.name, s.verifier.config)
            for key, column in VERIFIERS[s.verifier.name].reads(config).items():
                if column is not None:
                    needed[f"verifier.config ({key})"] = column
        return needed

    def _check_columns(self, rows: list[dict[str, Any]], labels: list[str]) -> None:
        needed = self._needed()
        for row, label in zip(rows, labels):
            for field, column in needed.items():
                if column not in row:
                    field_path = field.split(" ")[0]
                    raise ValueError(f"{self.field}.{field_path}: no column {column!r} in {label}; "
                                     f"columns: {_columns(row)}")

    def _task(self, row: dict[str, Any], label: str, i: int, split: str | None,
              verifiers: dict[str, dict[str, Any]]) -> Task:
        s = self.spec
        if s.id is not None:
            value = row[s.id]
            if not isinstance(value, str | int) or isinstance(value, bool) or str(value).strip() == "":
                raise ValueError(f"{self.field}.id: {label}: id {value!r} is not a non-empty text or integer")
            task_id = f"{s.name}/{value}"
        else:
            task_id = f"{s.name}/{split}/{i}" if split else f"{s.name}/{i}"
        metadata: dict[str, Any] = {}
        if s.prompt.messages_field is not None:
            messages = self._messages(row[s.prompt.messages_field], label)
            metadata["messages"] = messages
            question = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        elif s.prompt.template is not None:
            try:
                question = s.prompt.template.format_map(row)
            except (KeyError, IndexError, AttributeError, ValueError) as err:
                raise ValueError(f"{self.field}.prompt.template: {label}: cannot fill it ({err!r})") from None
        else:
            question = self._text(row[s.prompt.field], "prompt.field", label)
        answer = self._text(row[s.answer.field], "answer.field", label)
        reference = extract(s.answer.extract, answer)
        if reference is None:
            raise ValueError(f"{self.field}.answer.extract: {label}: {s.answer.extract} finds no answer in {answer!r}")
        spec = self._verifier(row, label, verifiers)
        config = with_defaults(spec["name"], spec["config"])
        verifier = VERIFIERS[spec["name"]]
        fields = {}
        for key, column in verifier.reads(config).items():
            if column is None:
                continue
            if column not in row:
                raise ValueError(f"{self.field}.verifier.config: {label}: no column {column!r} for {spec['name']}'s "
                                 f"{key}; columns: {_columns(row)}")
            fields[key] = row[column]
        problem = verifier.check(reference.strip(), fields, config)
        if problem:
            raise ValueError(f"{self.field}.{'verifier_field' if s.verifier_field else 'verifier'}: {label}: {problem}")
        metadata.update(fields)
        metadata.update(reference=reference.strip(), verifier=spec)
        return Task(task_id=task_id, family=s.name, question=question, answer=answer, metadata=metadata)

    def _text(self, value: Any, field: str, label: str) -> str:
        if isinstance(value, bool) or not isinstance(value, str | int | float) or str(value).strip() == "":
            raise ValueError(f"{self.field}.{field}: {label}: expected non-empty text or a number, got {value!r}")
        return str(value)

    def _messages(self, value: Any, label: str) -> list[dict[str, str]]:
        where = f"{self.field}.prompt.messages_field: {label}"
        if isinstance(value, str):  # a JSON string column (Parquet, CSV exports)
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"{where}: expected a list of {{role, content}} messages, got text") from None
        if not isinstance(value, list) or not value:
            raise ValueError(f"{where}: expected a non-empty list of {{role, content}} messages, got {value!r}")
        messages = []
        for m in value:
            if not isinstance(m, dict) or m.get("role") not in _CHAT_ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: a message must be {{role: {'|'.join(_CHAT_ROLES)}, content: text}}, "
                                 f"got {m!r}")
            messages.append({"role": m["role"], "content": m["content"]})
        if messages[-1]["role"] != "user":
            raise ValueError(f"{where}: the last message is the {messages[-1]['role']}'s; the prompt ends with the user's")
        return messages

    def _verifier(self, row: dict[str, Any], label: str, seen: dict[str, dict[str, Any]]) -> dict[str, Any]:
        s = self.spec
        if s.verifier is not None:
            return {"name": s.verifier.name, "extract": s.verifier.extract, "config": dict(s.verifier.config)}
        if s.verifier_field is None:
            return {"name": "exact", "extract": None, "config": {}}
        value = row[s.verifier_field]
        key = _canonical(value)
        if key not in seen:
            spec = {"name": value, "extract": None, "config": {}} if isinstance(value, str) else value
            if not isinstance(spec, dict) or set(spec) - {"name", "extract", "config"}:
                raise ValueError(f"{self.field}.verifier_field: {label}: expected a verifier name or "
                                 f"{{name, extract, config}}, got {value!r}")
            spec = {"name": spec.get("name"), "extract": spec.get("extract"), "config": spec.get("config") or {}}
            problems = spec_problems(spec["name"], spec["extract"], spec["config"])
            if problems:
                raise ValueError(f"{self.field}.verifier_field: {label}: {problems[0]}")
            seen[key] = spec
        return seen[key]

    def _check_unique(self, tasks: list[Task], labels: list[str]) -> None:
        first: dict[str, int] = {}
        for i, t in enumerate(tasks):
            if t.task_id in first:
                raise ValueError(f"{self.field}.id: duplicate id {t.task_id.split('/', 1)[1]!r} at {labels[i]} "
                                 f"(first at {labels[first[t.task_id]]})")
            first[t.task_id] = i


def _template_fields(template: str | None) -> Iterable[str]:
    """The row columns a str.format template reads (`{question}`, `{meta[level]}` -> question, meta)."""
    if template is None:
        return []
    names = []
    for _, name, _, _ in string.Formatter().parse(template):
        if name:
            base = name.split(".")[0].split("[")[0]
            if base and not base.isdigit():
                names.append(base)
    return dict.fromkeys(names)
