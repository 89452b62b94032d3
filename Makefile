# The two commands: `make demo` (the whole pipeline on the embedded target) and `make test`.
# Both set up .venv, the model and the data they need by themselves.
SHELL := /bin/bash
EYAS := .venv/bin/eyas
OUT ?= runs/demo
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(EYAS) models fetch smollm2-135m-instruct
	$(EYAS) run --recipe demo --out $(OUT)

test: setup
	$(EYAS) models fetch smollm2-135m-instruct
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

test-fast: setup
	.venv/bin/python -m pytest -x -q -m "not slow" $(PYTEST_ARGS)

clean:
	rm -rf runs .pytest_cache
