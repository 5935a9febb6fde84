# The two commands of the README. Both set up what they need first (idempotent).
STATE ?= $(CURDIR)/.state
PY := $(STATE)/venv/bin/python

.PHONY: setup sglang-venv test-policies main test unit lint bench docs docs-serve cluster-demo production-up production-down

setup:
	bash infra/setup.sh

# The default recipe's asset graph through Dagster, in this process, on the embedded instance:
# tasks -> base policy (tiny Llama + SFT warm start) -> RL run on vLLM -> evaluation; then it prints
# how to open the Dagster and MLflow UIs and a SQL query. (`factory run RECIPE`: the same run without Dagster.)
main: setup
	$(PY) -m assets materialize recipes/default.yaml

# SGLang's CPU test set-up: a venv of its own (another torch pin than vLLM's); built once, then reused
sglang-venv:
	bash infra/sglang-venv.sh

# The whole suite in one pytest session, the production profile's end-to-end test included.
# The suite's policies are built once in the background at autogroup nice 19 (a plain `nice` yields only
# within its own session); a test that needs one first waits for it (tests/policies.py).
test: setup sglang-venv
	@log="$(STATE)/test-policies.log"; \
	echo "make test: the suite's policies are built in the background, where missing (log: $$log)"; \
	setsid -w sh -c 'echo 19 >/proc/self/autogroup 2>/dev/null; exec nice -n 19 "$$@"' sh $(PY) -m tests.policies \
	  >"$$log" 2>&1 & policies=$$!; \
	$(PY) -m pytest -q --durations=30 tests; status=$$?; \
	wait $$policies || { cat "$$log"; echo "make test: building the suite's policies failed (above)" >&2; status=1; }; \
	exit $$status

test-policies: setup
	$(PY) -m tests.policies

# The fast part of the suite (no servers: pure logic, recipes, the lake on SQLite, Dagster in-process,
# sandboxes); what to run while editing
unit: setup
	$(PY) -m pytest -q -m "not integration" tests

# Lint: ruff, then mypy on the library and the code location (both configured in pyproject.toml).
# mypy's cache lives in the user's cache dir, keyed by content, so a fresh clone reuses it.
MYPY_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/factory/mypy
lint: setup
	$(PY) -m ruff check factory assets infra bench tests
	$(PY) -m mypy --cache-dir "$(MYPY_CACHE)" factory assets

bench: setup
	$(PY) bench/async_speedup.py

# The documentation site: its tools in a venv of their own (infra/docs-venv.sh), the generated pages
# (docs/gen.py, in the main venv: it reads the recipe model), then a --strict build into the state dir
DOCS_VENV := $(STATE)/docs-venv
docs: setup
	DOCS_VENV="$(DOCS_VENV)" bash infra/docs-venv.sh
	$(PY) docs/gen.py
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs build --strict --site-dir "$(STATE)/site"

docs-serve: docs
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/mkdocs serve

# A short run on a two-node Ray cluster built on this machine (network namespaces + veth; root):
# trainer on node 1, rollout engine and env worker on node 2, which cannot see node 1's files.
CLUSTER_HOME := $(STATE)/cluster-home
cluster-demo: setup
	$(PY) -c "from factory.training.base_policy import ensure_base_policy; from factory.recipe import load_recipe; \
	import shutil, os; p = ensure_base_policy(load_recipe('recipes/default.yaml')); \
	d = '$(CLUSTER_HOME)/models/policy'; shutil.rmtree(d, ignore_errors=True); shutil.copytree(p, d)"
	FACTORY_HOME=$(CLUSTER_HOME) bash infra/cluster/netns.sh up
	FACTORY_HOME=$(CLUSTER_HOME) bash infra/cluster/netns.sh run $(PY) -m factory.cli run recipes/two_node.yaml \
	  model.path=$(CLUSTER_HOME)/models/policy train.steps=20 eval.heldout=200 \
	  ; status=$$?; FACTORY_HOME=$(CLUSTER_HOME) bash infra/cluster/netns.sh down; exit $$status

# The production profile's services on this machine (Postgres, s3rver, MLflow server, Ray head,
# Dagster webserver + daemon + code server) under one supervisor; docs/production.md.
production-up: setup
	$(PY) -m infra.stack up

production-down:
	$(PY) -m infra.stack down
