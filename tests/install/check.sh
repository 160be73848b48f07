#!/usr/bin/env bash
# The package as a user installs it (`make install-check`, which `make test` runs first): the wheel
# built from this checkout, installed with no extras into a new virtual environment (torch by
# constraints.txt, nothing else), then the commands the README gives, run from a folder that holds
# the example job but not the checkout. An import the package does not declare fails it twice:
# statically (declared_imports.py) and where a command reaches it. Starts a local Ray for a few
# steps: by hand beside other Ray work, run it under `flock /tmp/elastic-ray.lock`.
#   PYTHON=python3.11 tests/install/check.sh     # the interpreter the environment is made from
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
PYTHON=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/elastic-install-check.XXXXXX")
trap 'rm -rf "$work"' EXIT

step() { echo "install-check: $*"; }
# Run a step quietly; on failure show what it printed, and fail.
quiet() {
  local log="$work/step.log"
  if ! "$@" >"$log" 2>&1; then
    tail -n 60 "$log"
    step "FAILED: $*"
    exit 1
  fi
}

step "building the wheel"
quiet "$PYTHON" -m pip wheel --no-deps . -w "$work/dist"
wheel=$(ls "$work"/dist/elastic_trainer-*.whl)

step "installing $(basename "$wheel") with no extras into a new virtual environment"
quiet "$PYTHON" -m venv "$work/venv"
# As the install steps say (docs/getting-started.md): a pip that prints the license (25.1 and on).
quiet "$work/venv/bin/python" -m pip install -U pip
quiet "$work/venv/bin/python" -m pip install -c constraints.txt "$wheel"

# Nothing of the checkout or of the project's .venv: the user's folder has their job and code only.
mkdir -p "$work/user"
cp -r examples "$work/user/examples"
cd "$work/user"
export PATH="$work/venv/bin:/usr/bin:/bin"
unset PYTHONPATH RAY_ADDRESS VIRTUAL_ENV

step "checking the package's imports against its declared dependencies"
python "$root/tests/install/declared_imports.py"

step "the license in the wheel and in pip show"
python -m pip show elastic-trainer 2>/dev/null | tee "$work/show.txt"
grep -q "^License-Expression: Apache-2.0" "$work/show.txt" \
  || { step "FAILED: pip show names no license"; exit 1; }
python -m zipfile -l "$wheel" | grep -q "dist-info/licenses/LICENSE" \
  || { step "FAILED: no LICENSE in the wheel"; exit 1; }

step "elastic --version"
elastic --version

step "elastic train examples/job.yaml --dry-run"
quiet elastic train examples/job.yaml --dry-run

run=install-check
step "a short local run (a local Ray, 2 workers, 4 steps)"
quiet elastic train examples/job.yaml --no-progress --set run.name=$run --set run.num_steps=4 \
  --set scaling.num_workers=2 --set checkpoint.every_steps=2 \
  --set "checkpoint.storage_uri=file://$work/runs"
test -e "$work/runs/$run/checkpoints/step_000000004/COMMITTED" \
  || { step "FAILED: no committed step 4"; exit 1; }

step "elastic status"
elastic status "$work/runs/$run" | tee "$work/status.txt"
grep -q "step 4 of 4" "$work/status.txt" \
  || { step "FAILED: the status does not show step 4 of 4"; exit 1; }

step "elastic timeline --trace"
elastic timeline "$work/runs/$run" --trace "$work/trace.json"
python -c "import json, sys; assert json.load(open(sys.argv[1]))['traceEvents'], 'empty trace'" \
  "$work/trace.json"

step "elastic timeline as a PNG needs the plot extra: refused, naming it"
set +e
elastic timeline "$work/runs/$run" --out "$work/timeline.png" 2>"$work/png.err"
rc=$?
set -e
cat "$work/png.err"
if [ "$rc" != 2 ] || ! grep -q "elastic-trainer\[plot\]" "$work/png.err" \
   || grep -q Traceback "$work/png.err"; then
  step "FAILED: expected exit 2 and one line naming elastic-trainer[plot], got exit $rc"
  exit 1
fi

step "passed"
