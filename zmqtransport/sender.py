"""The sending side, as it was named before it moved to :mod:`zmqtransport.serve`."""

from __future__ import annotations

from .serve import Server, Staged

__all__ = ["Server", "Staged"]
