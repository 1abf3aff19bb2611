"""DTensor specs without pickle (placeholder until the codec lands)."""

from __future__ import annotations

from typing import Any

from .errors import ProtocolError
from .tree import KeyPath, format_path


def encode_spec(spec: Any, path: KeyPath) -> Any:
    raise TypeError(f"{format_path(path)}: DTensor encoding is not implemented yet")


def validate_spec(obj: Any, path: KeyPath) -> None:
    raise ProtocolError(f"{format_path(path)}: DTensor decoding is not implemented yet")


def make_dtensor(local: Any, spec: Any, requires_grad: bool, like: Any = None) -> Any:
    raise ProtocolError("DTensor decoding is not implemented yet")
