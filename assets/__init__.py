"""The Dagster code location: assets, jobs, sensors, schedules and resources around `factory`.

Entry point: `assets.definitions:defs`. Start the UI with `python -m assets` (see `__main__.py`).
This package knows Dagster and holds no RL logic: every asset calls into `factory`.
"""
