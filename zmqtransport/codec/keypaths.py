"""Key paths: where a value sits in the caller's state, for error messages and in-place receives.

Imports nothing from the package.
"""

from __future__ import annotations

from typing import Any

KeyPath = tuple[Any, ...]


def format_path(path: KeyPath) -> str:
    """Render a key path the way a user would index it: ``state['optim'][0]``."""
    return "state" + "".join(f"[{key!r}]" for key in path)
