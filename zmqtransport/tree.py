"""The codec's entry points under their first import path (``zmqtransport.tree``).

The code lives in :mod:`zmqtransport.codec`; this module only gathers the names
that the receiver, the tests and existing users import from here. New code
imports from :mod:`zmqtransport.codec` directly.
"""

from __future__ import annotations

from .codec.dtypes import DTYPES, dtype_name
from .codec.paths import KeyPath, format_path
from .codec.skeleton import (
    MAX_DEPTH,
    TAG_BIGINT,
    TAG_DEVICE,
    TAG_DICT,
    TAG_DTENSOR,
    TAG_DTYPE,
    TAG_LIST,
    TAG_NAMEDTUPLE,
    TAG_ORDERED_DICT,
    TAG_PICKLE,
    TAG_SIZE,
    TAG_TENSOR,
    TAG_TUPLE,
    build_tree,
    encode_tree,
    index_skeleton,
    iter_tensor_leaves,
)
from .codec.tensors import EncodedTree, StorageRef, TensorSpec, decode_tensor_table

__all__ = [
    "DTYPES",
    "MAX_DEPTH",
    "TAG_BIGINT",
    "TAG_DEVICE",
    "TAG_DICT",
    "TAG_DTENSOR",
    "TAG_DTYPE",
    "TAG_LIST",
    "TAG_NAMEDTUPLE",
    "TAG_ORDERED_DICT",
    "TAG_PICKLE",
    "TAG_SIZE",
    "TAG_TENSOR",
    "TAG_TUPLE",
    "EncodedTree",
    "KeyPath",
    "StorageRef",
    "TensorSpec",
    "build_tree",
    "decode_tensor_table",
    "dtype_name",
    "encode_tree",
    "format_path",
    "index_skeleton",
    "iter_tensor_leaves",
]
