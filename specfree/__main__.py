"""``python -m specfree``: see specfree.cli."""

from specfree.cli import main

raise SystemExit(main())
