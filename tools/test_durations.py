"""Write tests/durations.json from the JUnit XML of a whole-suite run (`make test-durations`).

    python tools/test_durations.py run.xml > tests/durations.json   # from the repository root

It holds each test's seconds, rounded, for tests of a second or more (the rest count as
`DEFAULT_S` in tests/conftest.py). The suite orders its files by it, longest first, so the two
workers end together (README, "Tests"). Entries of renamed or removed tests are harmless; refresh
the file when a test file's time changes by tens of seconds.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

MIN_RECORDED_S = 1.0


def node_id(classname: str, name: str) -> str:
    """The pytest node id of a JUnit test case: its classname is the module's dotted path, then
    any classes (`tests.buffer.test_buffer_properties.TestBufferProperties`)."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if Path(path).is_file():
            return "::".join([path, *parts[end:], name])
    return f"{'/'.join(parts)}.py::{name}"


def seconds_by_test(junit_path: str) -> dict[str, float]:
    """{pytest node id: seconds} of every test the JUnit file reports (setup and teardown included)."""
    return {node_id(case.get("classname", ""), case.get("name", "")): float(case.get("time", 0.0))
            for case in ElementTree.parse(junit_path).getroot().iter("testcase")}


def main(junit_path: str) -> None:
    recorded = {test: round(s, 1) for test, s in sorted(seconds_by_test(junit_path).items()) if s >= MIN_RECORDED_S}
    json.dump(recorded, sys.stdout, indent=0)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
