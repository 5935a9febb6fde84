# The two commands of the README. Both set up what they need first (idempotent).
STATE ?= $(CURDIR)/.state
PY := $(STATE)/venv/bin/python

.PHONY: setup main test bench

setup:
	bash infra/setup.sh

# Build + warm-start the tiny policy, then RL it with vLLM on this CPU (recipes/default.yaml).
main: setup
	$(STATE)/venv/bin/factory run recipes/default.yaml

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) bench/async_speedup.py
