"""`factory lake …`: SQL over the lake, maintenance, sample checks. Wired into `factory.cli` by
`add_lake_commands(subparsers)`; each command sets `fn`."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

import pyiceberg.exceptions
from sqlalchemy.exc import SQLAlchemyError

from factory.lake.query import LakeQueryError
from factory.recording.outage import first_line
from factory.support.commands import command_parser, dispatch, fail

# Errors a user can cause (bad SQL, unreachable or malformed catalog): one line, no traceback.
_USER_ERRORS = (LakeQueryError, ValueError, OSError, SQLAlchemyError, pyiceberg.exceptions.NoSuchTableError,
                pyiceberg.exceptions.NoSuchNamespaceError, pyiceberg.exceptions.RESTError)


def _catalog_props(pairs: list[str]) -> dict[str, str] | None:
    props = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--catalog expects KEY=VALUE, got {pair!r}")
        props[key] = value
    return props or None


def _open(args) -> Any:
    from factory.lake.catalog import open_catalog

    return open_catalog(_catalog_props(args.catalog), namespace=args.namespace)


def cmd_sql(args) -> int:
    from factory.lake.query import format_table, sql

    try:
        result = sql(args.query, catalog=_open(args), namespace=args.namespace)
    except _USER_ERRORS as err:
        return fail(first_line(err, with_type=False))
    if args.format == "json":
        for row in result.to_pylist():
            print(json.dumps(row, default=str))
    else:
        print(format_table(result, max_rows=args.max_rows))
    return 0


def cmd_tables(args) -> int:
    from factory.lake.query import table_summaries

    try:
        result = table_summaries(catalog=_open(args), namespace=args.namespace)
    except _USER_ERRORS as err:
        return fail(first_line(err, with_type=False))
    for row in result.to_pylist():  # a table per paragraph: name and rows, then its columns, wrapped
        print(f"{row['table']}: {row['rows']} rows")
        print(textwrap.fill(row["columns"], width=100, initial_indent="  ", subsequent_indent="  "))
    return 0


def cmd_maintain(args) -> int:
    from factory.lake.maintenance import maintain

    try:
        report = maintain(_open(args), args.namespace, keep_last=args.keep_snapshots,
                          orphan_older_than_s=args.orphan_age_s)
    except _USER_ERRORS as err:
        return fail(first_line(err, with_type=False))
    for table, counts in report.items():
        print(f"{table:12s} files {counts['files_before']:>5d} → {counts['files_after']:<5d} "
              f"rows rewritten {counts['rows_rewritten']:>7d}  snapshots expired "
              f"{counts['snapshots_expired']:>4d}/{counts['snapshots_before']:<4d} "
              f"orphan files removed {counts['orphans_removed']}")
    return 0


def cmd_check(args) -> int:
    from factory.lake.checks import run_checks

    try:
        results = run_checks(args.run_id, args.max_staleness, catalog=_open(args), namespace=args.namespace)
    except _USER_ERRORS as err:
        return fail(first_line(err, with_type=False))
    for result in results.values():
        print(f"{'ok ' if result.passed else 'FAIL'} {result.name:26s} {result.count}")
        for example in result.examples:
            print(f"     {json.dumps(example, default=str)}")
    return 0 if all(r.passed for r in results.values()) else 1


def catalog_arguments() -> argparse.ArgumentParser:
    """The --catalog/--namespace options every command that reads the lake shares (a parent parser)."""
    from factory.lake.schemas import NAMESPACE

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--catalog", action="append", default=[], metavar="KEY=VALUE",
                        help="PyIceberg catalog property (default: the profile's catalog)")
    common.add_argument("--namespace", default=NAMESPACE)
    return common


def add_lake_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `lake sql|tables|maintain|check` to a `factory` CLI's subparsers (each sets `fn`)."""
    lake = subparsers.add_parser("lake", help="the Iceberg trajectory lake: SQL, maintenance, checks")
    common = catalog_arguments()
    sub = lake.add_subparsers(dest="lake_command", required=True)

    q = sub.add_parser("sql", parents=[common], help='run DuckDB SQL over the lake tables, e.g. "SELECT * FROM steps"')
    q.add_argument("query")
    q.add_argument("--format", choices=["table", "json"], default="table")
    q.add_argument("--max-rows", type=int, default=50)
    q.set_defaults(fn=cmd_sql)

    t = sub.add_parser("tables", parents=[common], help="the lake's tables: rows and columns of each")
    t.set_defaults(fn=cmd_tables)

    m = sub.add_parser("maintain", parents=[common], help="compact small files, expire snapshots, delete orphans")
    m.add_argument("--keep-snapshots", type=int, default=5)
    m.add_argument("--orphan-age-s", type=float, default=3600.0,
                   help="only delete unreferenced files older than this (younger ones may be in flight)")
    m.set_defaults(fn=cmd_maintain)

    c = sub.add_parser("check", parents=[common], help="duplicate ids, staleness and version-order checks of a run")
    c.add_argument("run_id")
    c.add_argument("--max-staleness", type=int, required=True, help="η of the run")
    c.set_defaults(fn=cmd_check)


def main(argv: list[str] | None = None) -> int:
    """`python -m factory.lake.cli …`: the lake commands alone."""
    return dispatch(command_parser(add_lake_commands)[0], argv)


if __name__ == "__main__":
    sys.exit(main())
