# Quick start: `make demo` and `make test` on a fresh clone (Python 3.11 and pip are all it needs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# constraints.txt pins torch to the CPU build; without it pip pulls a multi-GB CUDA build.
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest

test-fast: $(STAMP)
	$(PY) -m pytest -m "not chaos and not s3"

bench: $(STAMP)
	$(PY) -m benchmarks recovery --out bench-out

clean:
	rm -rf $(VENV) runs bench-out .pytest_cache
