"""lucepy's scripts in tools/ (no package: each imports its neighbours by name, as when run from
there) as modules for their tests."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

TOOLS = str(Path(__file__).parent.parent / "tools")


def load_tool(name: str):
    """tools/NAME.py, imported as when tools/ is the script's directory."""
    if TOOLS not in sys.path:
        sys.path.insert(0, TOOLS)
    return importlib.import_module(name)
