"""zmqtransport: a ZeroMQ peer-to-peer checkpoint transport for torchft.

``ZMQTransport`` implements torchft's ``CheckpointTransport`` contract: each rank
binds one ROUTER socket (advertised by ``metadata()``), receivers connect with a
DEALER and pull a step as a msgpack header followed by raw, zero-copy tensor
frames under credit-based flow control. See docs/protocol.md.
"""

# First, before anything imports torch: see _torch_import (no NumPy warning).
from . import _torch_import  # noqa: F401

# isort: split
from .contract import CheckpointTransport
from .errors import (
    BindError,
    ConnectionLostError,
    IntegrityError,
    ProtocolError,
    RemoteError,
    StalledError,
    TransportError,
    VersionMismatchError,
)
from .stats import DisallowStats, TransferStats
from .transport import ZMQTransport
from .wire import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "BindError",
    "CheckpointTransport",
    "ConnectionLostError",
    "DisallowStats",
    "IntegrityError",
    "ProtocolError",
    "RemoteError",
    "StalledError",
    "TransferStats",
    "TransportError",
    "VersionMismatchError",
    "ZMQTransport",
]
# A literal, not importlib.metadata: a checkout on PYTHONPATH beside an installed
# release would otherwise report the release's version. tests/test_version.py
# holds it equal to pyproject.toml's (and to the installed metadata, when installed).
__version__ = "0.1.0"
