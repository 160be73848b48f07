# Quick start: `make demo` and `make test` on a fresh clone (Python 3.11 and pip are all it needs).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

PROM := .tools/prometheus/usr/bin/prometheus

.PHONY: demo test test-fast chaos install-check bench clean tools

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	# constraints.txt pins versions, not torch's build: torch comes from pip's indexes (PyPI: the CUDA
	# build). For the CPU build, install it into .venv first (docs/getting-started.md#install).
	$(PY) -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# Prometheus and promtool for the metrics tests: Debian's package, unpacked into .tools (nothing
# installed system-wide, no service). Where apt is missing the tests that need them are skipped.
tools: $(PROM)

$(PROM):
	mkdir -p .tools/dl
	cd .tools/dl && { apt-get download prometheus >dl.log 2>&1 || { apt-get update -qq >>dl.log 2>&1 && apt-get download prometheus >>dl.log 2>&1; }; } \
	  && dpkg-deb -x prometheus_*.deb ../prometheus \
	  || echo "make: could not unpack Debian's prometheus package (see .tools/dl/dl.log): the real-Prometheus test will be skipped"
	rm -f .tools/dl/*.deb

# The suite in parts (docs/development.md#the-parts). `ray` and `procs` are set on each test from
# what it reaches (tests/support/suite_parts.py); `smoke` and `slow` by hand. test-fast is a part
# of test, and chaos is every test that test leaves out (tests/test_suite_parts.py checks both).
FAST_MARKS := not ray and not procs and not s3 and not chaos
TEST_MARKS := (not ray and not chaos and not slow) or smoke
PYTEST_ARGS ?=

test: install-check $(STAMP) $(PROM)
	$(PY) -m pytest -m "$(TEST_MARKS)" $(PYTEST_ARGS)

chaos: $(STAMP) $(PROM)
	$(PY) -m pytest -m "not ($(TEST_MARKS))" $(PYTEST_ARGS)

# The wheel installed with no extras into a new virtual environment, then the README's commands (a
# short local run among them): an import the package does not declare fails here, as it would for
# a user. About 2-3 minutes; it starts a local Ray (by hand beside other Ray work: under flock).
install-check:
	PYTHON=$(PYTHON) tests/install/check.sh

# ELASTIC_FAST_ONLY: a test that starts Ray or a process group anyway fails naming its marker.
test-fast: $(STAMP)
	ELASTIC_FAST_ONLY=1 $(PY) -m pytest -m "$(FAST_MARKS)" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m benchmarks recovery --out bench-out

clean:
	rm -rf $(VENV) runs bench-out .pytest_cache .tools
