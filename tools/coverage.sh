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
# The saver: a module beside coverage's own .pth, imported by a .pth line of its own (a later name,
# so coverage has started by then). A save while another thread imported once broke that import
# (a KeyError naming the module): a round in which a thread is inside importlib is skipped.
saver="$site/zz_rlactors_coverage_saver.py"
cat > "$saver" <<'EOF'
import sys
import threading
import time

import coverage


def _importing() -> bool:
    me = threading.get_ident()
    for thread_id, frame in sys._current_frames().items():
        while thread_id != me and frame is not None:
            if frame.f_code.co_filename.startswith("<frozen importlib"):
                return True
            frame = frame.f_back
    return False


def start() -> None:
    cov = getattr(coverage.process_startup, "coverage", None)
    if cov is None or hasattr(cov, "save_lock"):
        return
    cov.save_lock, unlocked_save = threading.Lock(), cov.save

    def save():
        with cov.save_lock:
            unlocked_save()

    cov.save = save

    def save_every_5_s():
        while True:
            time.sleep(5)
            if _importing():
                continue
            try:
                save()
            except Exception:
                pass

    threading.Thread(target=save_every_5_s, name="coverage-save", daemon=True).start()
EOF
flush="$site/zz_rlactors_coverage_flush.pth"
echo 'import os; exec("import zz_rlactors_coverage_saver; zz_rlactors_coverage_saver.start()") if os.environ.get("COVERAGE_PROCESS_START") else None' > "$flush"
trap 'rm -f "$flush" "$saver"' EXIT
COVERAGE_PROCESS_START="$out/coveragerc" $PY -m pytest "$@"
status=$?
$PY -m coverage combine --quiet --rcfile="$out/coveragerc"
$PY -m coverage report --rcfile="$out/coveragerc" > "$out/report.txt"
echo "coverage data and report: $out"
tail -n 1 "$out/report.txt"
exit $status
