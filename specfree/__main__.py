"""``python -m specfree``: see specfree.cli."""

from specfree.cli import run

run()
