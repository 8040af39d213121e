# Set-up: a virtualenv in the checkout, installed with the pinned constraints.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint typecheck doctest opinfo bench bench-gpu clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/aotc dump examples/mlp.py --out aotc_dump/mlp -- --steps 3
	@echo "graphs written under aotc_dump/mlp; open aotc_dump/mlp/index.html"

test: $(STAMP)
	$(BIN)/python -m pytest

# Lint, format and type checks (CI runs them before the tests).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(MAKE) typecheck

# mypy (pinned in constraints.txt) over aotc/, passes/ and runtime/ as the one package `aotc`;
# levels in pyproject.toml [tool.mypy], the import mapping in .ci/typecheck.py.
typecheck: $(STAMP)
	$(BIN)/python .ci/typecheck.py

# The worked examples (>>>) in docstrings of aotc/, passes/ and runtime/ (also part of `make test`).
doctest: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider tests/test_doctests.py

opinfo: $(STAMP)
	$(BIN)/python -m pytest -m opinfo tests/opinfo -p no:cacheprovider

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

# On a GPU machine with torch + triton preinstalled: PYTHONPATH=. python bench/gpu.py
bench-gpu:
	PYTHONPATH=. $(PY) bench/gpu.py

clean:
	rm -rf $(VENV) aotc_dump *.egg-info
