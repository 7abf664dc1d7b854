#!/usr/bin/env bash
# Line coverage of src/rlactors over a pytest run, every process of it measured: Ray's actor workers,
# vLLM's engine core and workers, reward workers, the drivers tests start. Not part of CI: run it
# by hand to compare a change of the suite with what it replaces.
#
#   tools/coverage.sh -m "not slow"      # arguments go to pytest; prints the report's TOTAL line last
#
# Ray ends actors hard (`ray.kill`, a job's end), which runs no exit handler: each measured process
# saves what it has every few seconds instead, from a thread a .pth file starts beside coverage's
# own (both only where COVERAGE_PROCESS_START is set, so nothing else on the machine is measured).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
$PY -m pip install --quiet --disable-pip-version-check coverage
out=$(mktemp -d /tmp/rlactors-coverage.XXXXXX)
site=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
cat > "$out/coveragerc" <<EOF
[run]
source = rlactors
parallel = true
data_file = $out/.coverage
patch = _exit

[paths]
# A job submitted with py_modules runs an uploaded copy of the package: count it as src/rlactors.
source =
    src/rlactors
    */py_modules_files/*/rlactors
EOF
flush="$site/zz_rlactors_coverage_flush.pth"
cat > "$flush" <<'EOF'
import os; exec("import threading, time\ntry:\n import coverage\n cov = getattr(coverage.process_startup, 'coverage', None)\nexcept Exception:\n cov = None\nif cov is not None and not hasattr(cov, 'save_lock'):\n cov.save_lock, unlocked_save = threading.Lock(), cov.save\n def save():\n  with cov.save_lock:\n   unlocked_save()\n cov.save = save\n def save_every_5_s():\n  while True:\n   time.sleep(5)\n   try:\n    save()\n   except Exception:\n    pass\n threading.Thread(target=save_every_5_s, name='coverage-save', daemon=True).start()", {}) if os.environ.get("COVERAGE_PROCESS_START") else None
EOF
trap 'rm -f "$flush"' EXIT
COVERAGE_PROCESS_START="$out/coveragerc" $PY -m pytest "$@"
status=$?
$PY -m coverage combine --quiet --rcfile="$out/coveragerc"
$PY -m coverage report --rcfile="$out/coveragerc" > "$out/report.txt"
echo "coverage data and report: $out"
tail -n 1 "$out/report.txt"
exit $status
