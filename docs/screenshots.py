"""Screenshots of the Dagster UI for the README, by headless Chromium.

    python docs/screenshots.py        # needs chromium: apt-get install -y chromium

Starts `dagster dev` (`python -m assets`) on a throwaway state dir (nothing is trained), opens
  - the asset graph (task datasets → base policy → RL runs → evaluations, sandbox images), and
  - the launchpad of `sweep_job` with a sweep typed in (recipe, overrides, grid), where the
    editor checks the config against the job's typed schema, shown beside it,
and saves docs/dagster-asset-graph.png and docs/dagster-sweep-launchpad.png.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.dagster_client import DagsterDev  # noqa: E402

DOCS = Path(__file__).resolve().parent
SWEEP_CONFIG = """ops:
  plan_sweep:
    config:
      recipe: recipes/default.yaml
      overrides:
        - train.steps=200
      grid:
        - algorithm.loss=ppo_clip,cispo
        - async.max_staleness=0,2
"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    sys.exit("error: no Chromium found; install it with: apt-get install -y chromium")


def screenshot(browser: str, url: str, out: Path, profile: Path, size=(1600, 900), wait_ms: int = 60000) -> None:
    """Load `url` headless, let its scripts and GraphQL calls run for `wait_ms` of virtual time, save a PNG."""
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", "--hide-scrollbars", f"--window-size={size[0]},{size[1]}",
            f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url]
    result = subprocess.run(args, capture_output=True, text=True, timeout=180)
    if result.returncode != 0 or not out.is_file():
        sys.exit(f"error: chromium failed on {url}: {result.stderr.strip().splitlines()[-1:]}")
    print(f"wrote {out} ({out.stat().st_size // 1024} KiB)")


def main() -> None:
    browser = chromium()
    with tempfile.TemporaryDirectory(prefix="factory-screenshots-") as tmp:
        dev = DagsterDev(Path(tmp) / "state")
        try:
            dev.start()
            dev.stop_sensor("rl_run_launcher")  # nothing is launched from this throwaway instance
            dev.query("mutation { setNuxSeen }")  # no "join the community" dialog over the page
            base = dev.url.removesuffix("/graphql")
            repo = f"{dev.repository}@{dev.location}"
            time.sleep(2)
            screenshot(browser, f"{base}/assets/rl_run?view=lineage&lineageScope=neighbors&lineageDepth=3",
                       DOCS / "dagster-asset-graph.png", Path(tmp) / "profile-1")
            launchpad = (f"{base}/locations/{quote(repo, safe='@')}/jobs/sweep_job/playground/setup"
                         f"?config={quote(SWEEP_CONFIG)}")
            screenshot(browser, launchpad, DOCS / "dagster-sweep-launchpad.png", Path(tmp) / "profile-2")
        finally:
            dev.stop()


if __name__ == "__main__":
    main()
