"""The dtypes that can travel, by name; imports nothing from the package.

A tensor's dtype travels as its short name (``"float32"``); the receiver looks
it up in :data:`DTYPES`, which holds exactly the dtypes this torch can allocate
on CPU with at least one byte per element, so a name outside it is refused
before anything is allocated.
"""

from __future__ import annotations

import warnings

import torch


def _usable_dtypes() -> dict[str, torch.dtype]:
    """Every dtype that can hold raw bytes on CPU, by its short name ("float32")."""
    found: dict[str, torch.dtype] = {}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if not isinstance(value, torch.dtype) or "qint" in str(value) or "quint" in str(value):
            continue
        short = str(value).removeprefix("torch.")
        if short in found:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
                torch.empty(1, dtype=value)
        except (RuntimeError, TypeError):
            continue  # dtypes that cannot be allocated on CPU
        if value.itemsize < 1:
            continue
        found[short] = value
    return found


DTYPES: dict[str, torch.dtype] = _usable_dtypes()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
