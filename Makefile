# The two commands of the README. Both set up what they need first (idempotent).
STATE ?= $(CURDIR)/.state
PY := $(STATE)/venv/bin/python

.PHONY: setup main test bench

setup:
	bash infra/setup.sh

# The default recipe's asset graph through Dagster, in this process, on the embedded instance:
# tasks -> base policy (tiny Llama + SFT warm start) -> RL run on vLLM -> evaluation; then it prints
# how to open the Dagster and MLflow UIs and a SQL query. (`factory run RECIPE`: the same run without Dagster.)
main: setup
	$(PY) -m assets materialize recipes/default.yaml

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) bench/async_speedup.py
