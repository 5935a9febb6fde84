"""`python -m assets [dagster dev options]`: the Dagster UI and daemon on the embedded instance.
`python -m assets materialize [RECIPE] [OVERRIDES…]`: one recipe through the asset graph, in this
process (`make main`; see `assets.main`).

Sets DAGSTER_HOME to `<state>/dagster` (unless already set), links the repo's dagster.yaml into
it, and replaces this process with `dagster dev -m assets.definitions` run from the repo root.
"""

import os
import shutil
import signal
import sys
from pathlib import Path

from factory.paths import REPO_ROOT, state_dir


def prepare_home() -> Path:
    """DAGSTER_HOME holding (a link to) the repo's dagster.yaml; returns it."""
    home = Path(os.environ.get("DAGSTER_HOME") or state_dir() / "dagster")
    home.mkdir(parents=True, exist_ok=True)
    config, source = home / "dagster.yaml", REPO_ROOT / "dagster.yaml"
    if config.is_symlink() or not config.exists():
        config.unlink(missing_ok=True)
        config.symlink_to(source)
    elif config.resolve() != source.resolve():
        print(f"note: using {config} (not a link to {source}); remove it to use the repo's", file=sys.stderr)
    return home


def main(argv: list[str]) -> None:
    home = prepare_home()
    os.environ["DAGSTER_HOME"] = str(home)
    dagster = shutil.which("dagster", path=str(Path(sys.executable).parent)) or shutil.which("dagster")
    if dagster is None:
        sys.exit("error: the dagster command is not installed in this environment (pip install dagster-webserver)")
    print(f"DAGSTER_HOME={home}", file=sys.stderr)
    # a parent that ignored SIGINT/SIGTERM (nohup, a background script) would leave dagster dev unstoppable
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(REPO_ROOT)
    # loopback unless told otherwise: the UI launches runs, so it must not face the network by default
    host = [] if any(a in ("-h", "--host") or a.startswith("--host=") for a in argv) else ["-h", "127.0.0.1"]
    os.execv(dagster, [dagster, "dev", "-m", "assets.definitions", "-d", str(REPO_ROOT), *host, *argv])


if __name__ == "__main__":
    if sys.argv[1:2] == ["materialize"]:
        from assets.main import main as materialize_main

        sys.exit(materialize_main(sys.argv[2:]))
    main(sys.argv[1:])
