"""The README's test command collects tests/unit and tests/functional together, and pytest imports
test modules by basename (the folders are not packages): two test files of one name stop the whole
collection ("import file mismatch"), which is what CI runs."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename():
    places = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        places[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: found for name, found in places.items() if len(found) > 1}
    assert not shared, f"rename one of each: {shared}"
