"""Where an artifact came from: the recipe, the code, the base policy, the data and the runs around it.

`origin(recipe, policy)` gathers what every run records once — in the lake's `runs` table, as MLflow
tags, as Dagster metadata — and `checkpoint_manifest(...)` what each checkpoint adds: its step and
version and the Iceberg snapshot ids of the lake tables that hold every sample it was trained on.
Each checkpoint directory holds its manifest (`manifest.json`); the lake's `checkpoints` and
`evaluations` rows carry it as JSON, so an evaluation leads back to its checkpoint, the checkpoint
to its recipe, code and data.

The orchestrator that launches a run says who launched it with `set_context` (the Dagster run id,
the sweep or parent run), before `factory.run.run`; a run started by hand has none.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

from factory.paths import REPO_ROOT

_context: dict[str, str] = {}
_policy_digests: dict[tuple, str] = {}


def set_context(**values: str | None) -> None:
    """Record who launched the run in this process (dagster_run_id, sweep_run_id, parent_run_id…)."""
    _context.clear()
    _context.update({k: str(v) for k, v in values.items() if v})


def context() -> dict[str, str]:
    return dict(_context)


def git_state(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """{"git_sha": HEAD or "unknown", "git_dirty": whether tracked files differ from HEAD}."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {"git_sha": "unknown", "git_dirty": None}
    return {"git_sha": sha or "unknown", "git_dirty": bool(dirty) if sha else None}


def policy_fingerprint(path: Path) -> str:
    """sha256 (16 hex) over the relative names and contents of every file of a model directory:
    equal weights, config and tokenizer give equal fingerprints wherever the directory lives.
    Cached per process by the files' sizes and mtimes."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file())
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files)
    if stamp not in _policy_digests:
        digest = hashlib.sha256()
        for p in files:
            digest.update(str(p.relative_to(path)).encode() + b"\0")
            with open(p, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
        _policy_digests[stamp] = digest.hexdigest()[:16]
    return _policy_digests[stamp]


def origin(recipe, policy: Path | None) -> dict[str, Any]:
    """The run-level lineage: recipe (resolved YAML and hash), data (the fingerprint its tasks carry in the
    lake: `tasks.dataset`), code, base policy, launcher context."""
    from factory.data.tasks import dataset_fingerprint

    return {
        "recipe_hash": recipe.fingerprint(),
        "recipe_yaml": recipe.to_yaml(),
        "dataset": dataset_fingerprint(recipe.data),
        **git_state(),
        "base_policy": str(policy) if policy else None,
        "base_policy_fingerprint": policy_fingerprint(policy) if policy and Path(policy).is_dir() else None,
        **context(),
    }


def checkpoint_manifest(run_id: str, step: int, version: int, run_origin: dict[str, Any],
                        snapshots: dict[str, int | None], mlflow_run_id: str | None) -> dict[str, Any]:
    """What one checkpoint was made from (the recipe YAML stays in the run's row: its hash is here)."""
    return {"run_id": run_id, "step": step, "version": version,
            **{k: v for k, v in run_origin.items() if k != "recipe_yaml"},
            "lake_snapshots": snapshots, "mlflow_run_id": mlflow_run_id}


def write_manifest(checkpoint: Path, manifest: dict[str, Any]) -> Path:
    path = Path(checkpoint) / "manifest.json"
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return path


def read_manifest(checkpoint: Path) -> dict[str, Any]:
    path = Path(checkpoint) / "manifest.json"
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint}: no manifest.json (a checkpoint written before lineage was recorded)")
    return json.loads(path.read_text())


def mlflow_tags(run_origin: dict[str, Any]) -> dict[str, str]:
    """The origin as MLflow tags (`factory.<name>`; the recipe itself is an artifact)."""
    return {f"factory.{k}": str(v) for k, v in run_origin.items() if k != "recipe_yaml" and v is not None}
