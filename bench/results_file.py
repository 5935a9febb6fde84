"""Where every benchmark's numbers go: one JSON file with the machine and the time beside them."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path


def write_results(out: str | Path, payload: dict) -> Path:
    """Write `payload` plus machine facts and a UTC timestamp to `out` (parents created); prints where."""
    out = Path(out)
    payload = {**payload, "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {out}")
    return out
