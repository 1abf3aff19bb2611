"""DTensor specs under their first import path (``zmqtransport.dtensor_codec``).

The code lives in :mod:`zmqtransport.codec.dtensor`; this module keeps the
names the receiver, the tests and existing users import from here. New code
imports from :mod:`zmqtransport.codec.dtensor` directly.
"""

from __future__ import annotations

from .codec.dtensor import (
    MAX_LAYOUT_MODES,
    MAX_MESH_DIMS,
    MAX_MESH_RANKS,
    MAX_NAME_CHARS,
    MAX_TENSOR_DIMS,
    REDUCE_OPS,
    dtensor_type,
    encode_spec,
    make_dtensor,
    spec_matches,
    validate_spec,
)

__all__ = [
    "MAX_LAYOUT_MODES",
    "MAX_MESH_DIMS",
    "MAX_MESH_RANKS",
    "MAX_NAME_CHARS",
    "MAX_TENSOR_DIMS",
    "REDUCE_OPS",
    "dtensor_type",
    "encode_spec",
    "make_dtensor",
    "spec_matches",
    "validate_spec",
]
