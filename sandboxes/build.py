#!/usr/bin/env python3
"""Build sandbox images without the project's venv (CI runs this before installing it):
`python3 sandboxes/build.py [NAME ...] [--force] [--no-docker]` = `factory sandbox build …`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from factory.sandbox.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["sandbox", "build", *sys.argv[1:]]))
