"""tests/parallel.py, the suite's own runner: its arguments to pytest and the order the files go out in."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from . import parallel

HERE = Path(__file__).parent


def test_the_long_files_named_first_exist():
    """A file renamed or removed would silently drop out of the order."""
    assert len(set(parallel.FIRST)) == len(parallel.FIRST)
    assert [name for name in parallel.FIRST if not (HERE / name).is_file()] == []


def test_order_puts_the_named_files_first_and_keeps_each_files_tests_in_order():
    names = ["test_a.py", parallel.FIRST[1], "test_b.py", parallel.FIRST[0], parallel.FIRST[1], "test_a.py"]
    items = [SimpleNamespace(path=HERE / name, index=i) for i, name in enumerate(names)]
    parallel.order(items)  # type: ignore[arg-type]
    assert [(item.path.name, item.index) for item in items] == [
        (parallel.FIRST[0], 3),
        (parallel.FIRST[1], 1),
        (parallel.FIRST[1], 4),
        ("test_a.py", 0),
        ("test_b.py", 2),
        ("test_a.py", 5),
    ]


def test_arguments_add_the_workers_unless_the_caller_chose():
    assert parallel.arguments(["-q"], 2) == ["-n", "3", "--dist", "loadfile", "--no-loadscope-reorder", "-q"]
    for chosen in (["-n", "1"], ["-n4"], ["--numprocesses=2"], ["-p", "no:xdist"]):
        assert parallel.arguments([*chosen, "-q"], 2) == [*chosen, "-q"]
