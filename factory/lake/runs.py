"""`factory runs list | show RUN | compare A B`: runs as the lake (and MLflow) recorded them.

- list: every run with its newest attempt's origin (recipe hash, git sha), steps trained, the last
  held-out accuracy ± standard error, and the median samples/s.
- show: one run's origin (recipe, code, base policy, Dagster and MLflow runs, its MLflow status),
  its evaluations, checkpoints and throughput.
- compare: two runs' recipe differences (field by field from the recipes they recorded), held-out
  accuracy at their last evaluations with the difference and its standard error, and throughput.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any

import yaml

THROUGHPUT = "perf/samples_per_s"


def _rows(query: str, catalog, namespace: str) -> list[dict[str, Any]]:
    from factory.lake.query import sql

    return sql(query, catalog=catalog, namespace=namespace).to_pylist()


def _quote(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def run_summary(run_id: str, catalog, namespace: str) -> dict[str, Any]:
    """One run: its attempts' origins, evaluations, checkpoints and per-step throughput."""
    rid = _quote(run_id)
    attempts = _rows(f"SELECT * FROM runs WHERE run_id = {rid} ORDER BY start_step", catalog, namespace)
    steps = _rows(f"SELECT step, metrics FROM steps WHERE run_id = {rid} ORDER BY step", catalog, namespace)
    if not attempts and not steps:
        known = [r["run_id"] for r in _rows("SELECT DISTINCT run_id FROM steps ORDER BY 1", catalog, namespace)]
        raise ValueError(f"no run {run_id!r} in the lake; runs: {', '.join(known[-10:]) or 'none'}")
    evaluations = _rows(f"SELECT step, suite, n, mean, stderr, checkpoint FROM evaluations WHERE run_id = {rid} "
                        f"ORDER BY step, suite", catalog, namespace)
    checkpoints = _rows(f"SELECT step, version, path FROM checkpoints WHERE run_id = {rid} ORDER BY step",
                        catalog, namespace)
    rates = [r for r in (_metric(s["metrics"], THROUGHPUT) for s in steps) if r is not None]
    return {"run_id": run_id, "attempts": attempts, "steps": len(steps), "evaluations": evaluations,
            "checkpoints": checkpoints, "samples_per_s_median": statistics.median(rates) if rates else None,
            "recipe": yaml.safe_load(attempts[-1]["recipe_yaml"]) if attempts and attempts[-1]["recipe_yaml"] else None}


def _metric(metrics, name: str) -> float | None:
    if isinstance(metrics, dict):
        return metrics.get(name)
    for key, value in metrics or []:  # Arrow maps arrive as (key, value) pairs
        if key == name:
            return value
    return None


def last_heldout(summary: dict[str, Any]) -> dict[str, Any] | None:
    heldout = [e for e in summary["evaluations"] if e["suite"] == "heldout"]
    return heldout[-1] if heldout else None


def list_runs(catalog, namespace: str) -> list[dict[str, Any]]:
    ids = [r["run_id"] for r in _rows("SELECT run_id FROM steps UNION SELECT run_id FROM runs ORDER BY 1",
                                      catalog, namespace)]
    out = []
    for run_id in ids:
        s = run_summary(run_id, catalog, namespace)
        last = s["attempts"][-1] if s["attempts"] else {}
        ev = last_heldout(s)
        out.append({"run": run_id, "steps": s["steps"], "recipe_hash": last.get("recipe_hash"),
                    "git_sha": (last.get("git_sha") or "")[:10], "attempts": len(s["attempts"]),
                    "heldout": _acc(ev), "samples_per_s": _num(s["samples_per_s_median"])})
    return out


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def recipe_diff(a: dict | None, b: dict | None) -> list[tuple[str, Any, Any]]:
    """(field, value in a, value in b) for every field that differs (the run's name aside)."""
    fa, fb = flatten(a or {}), flatten(b or {})
    return [(k, fa.get(k, "—"), fb.get(k, "—")) for k in sorted(set(fa) | set(fb))
            if fa.get(k) != fb.get(k) and k != "name"]


def compare(a: str, b: str, catalog, namespace: str) -> dict[str, Any]:
    sa, sb = run_summary(a, catalog, namespace), run_summary(b, catalog, namespace)
    ea, eb = last_heldout(sa), last_heldout(sb)
    delta = None
    if ea and eb:
        se = math.sqrt((ea["stderr"] or 0) ** 2 + (eb["stderr"] or 0) ** 2)
        delta = {"b_minus_a": eb["mean"] - ea["mean"], "stderr": se,
                 "beyond_2se": abs(eb["mean"] - ea["mean"]) > 2 * se}
    return {"a": sa, "b": sb, "recipe_diff": recipe_diff(sa["recipe"], sb["recipe"]), "heldout_delta": delta}


def _acc(ev: dict | None) -> str:
    return f"{ev['mean']:.3f} ± {ev['stderr']:.3f} (n={ev['n']}, step {ev['step']})" if ev else "—"


def _num(x: float | None) -> str:
    return f"{x:.1f}" if x is not None else "—"


def _print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("no runs in the lake")
        return
    names = list(rows[0])
    widths = [max(len(n), *(len(str(r[n])) for r in rows)) for n in names]
    print("  ".join(n.ljust(w) for n, w in zip(names, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(r[n]).ljust(w) for n, w in zip(names, widths)))


def _mlflow_status(run_id: str | None) -> str:
    if not run_id:
        return "—"
    try:
        from factory.recording.tracking import RunTracker

        run = RunTracker().client.get_run(run_id)
        return f"{run_id} ({run.info.status})"
    except Exception as err:  # a tracking store that is gone must not hide the lake's answer
        return f"{run_id} (not reachable: {type(err).__name__})"


def cmd_list(args) -> int:
    _print_table(list_runs(args.open(), args.namespace))
    return 0


def cmd_show(args) -> int:
    s = run_summary(args.run_id, args.open(), args.namespace)
    print(f"run {s['run_id']}: {s['steps']} steps, median {_num(s['samples_per_s_median'])} samples/s")
    for a in s["attempts"]:
        origin = json.loads(a["origin"]) if a["origin"] else {}
        print(f"  attempt from step {a['start_step']}: recipe {a['recipe_hash']}, git {a['git_sha']}"
              f"{' (dirty)' if a['git_dirty'] == 'true' else ''}, base policy {a['base_policy_fingerprint']}, "
              f"dagster {a['dagster_run_id'] or '—'}, mlflow {_mlflow_status(a['mlflow_run_id'])}"
              f"{', parent ' + a['parent'] if a['parent'] else ''}")
        if origin.get("base_policy"):
            print(f"    base policy {origin['base_policy']}")
    for e in s["evaluations"]:
        where = e["checkpoint"] or ("(base policy)" if e["step"] == 0 else "")
        print(f"  eval step {e['step']:>5} {e['suite']:8} {_acc(e)}  {where}")
    for c in s["checkpoints"]:
        print(f"  checkpoint step {c['step']:>5} version {c['version']:>5}  {c['path']}")
    return 0


def cmd_compare(args) -> int:
    c = compare(args.a, args.b, args.open(), args.namespace)
    print(f"{'':24} {'A: ' + args.a:40} {'B: ' + args.b}")
    for label, key in (("held-out (last)", None), ("median samples/s", "samples_per_s_median"), ("steps", "steps")):
        va = _acc(last_heldout(c["a"])) if key is None else _num(c["a"][key]) if key != "steps" else c["a"][key]
        vb = _acc(last_heldout(c["b"])) if key is None else _num(c["b"][key]) if key != "steps" else c["b"][key]
        print(f"{label:24} {str(va):40} {vb}")
    d = c["heldout_delta"]
    if d:
        print(f"B − A held-out: {d['b_minus_a']:+.3f} ± {d['stderr']:.3f} "
              f"({'beyond' if d['beyond_2se'] else 'within'} 2·SE)")
    if c["a"]["recipe"] is None or c["b"]["recipe"] is None:
        print("recipes: not recorded for a run from before lineage (no `runs` row)")
        return 0
    print("recipe differences:" if c["recipe_diff"] else "recipes: identical")
    for field, va, vb in c["recipe_diff"]:
        print(f"  {field:40} {str(va):30} → {vb}")
    return 0


def add_runs_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add `runs list|show|compare` to a `factory` CLI's subparsers (each sets `fn`)."""
    from factory.lake.cli import _USER_ERRORS, _open, catalog_arguments
    from factory.support.commands import fail
    from factory.recording.outage import first_line

    def guarded(fn):
        def call(args) -> int:
            args.open = lambda: _open(args)
            try:
                return fn(args)
            except _USER_ERRORS as err:
                return fail(first_line(err, with_type=False))
        return call

    runs = subparsers.add_parser("runs", help="runs as the lake recorded them: list, show, compare")
    common = catalog_arguments()
    sub = runs.add_subparsers(dest="runs_command", required=True)
    sub.add_parser("list", parents=[common], help="every run: origin, steps, last held-out accuracy, samples/s") \
        .set_defaults(fn=guarded(cmd_list))
    show = sub.add_parser("show", parents=[common], help="one run: origin, evaluations, checkpoints")
    show.add_argument("run_id")
    show.set_defaults(fn=guarded(cmd_show))
    cmp = sub.add_parser("compare", parents=[common], help="two runs: recipe diff, held-out accuracy, throughput")
    cmp.add_argument("a")
    cmp.add_argument("b")
    cmp.set_defaults(fn=guarded(cmd_compare))
