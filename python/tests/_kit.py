"""Makes ``converge_worker`` importable from the source tree when it is not installed
(``python3 -m unittest discover -s python/tests`` from the repository root)."""

import sys
from pathlib import Path

try:
    import converge_worker  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
