"""Exception types raised by zmqtransport.

Timeouts are reported with the builtin :class:`TimeoutError` (a stalled
source with its subclass :class:`StalledError`), so callers that already
handle torchft's transport timeouts need nothing new.
"""

from __future__ import annotations


class TransportError(RuntimeError):
    """Base class for every error this package raises on purpose (except timeouts)."""


class ProtocolError(TransportError, ValueError):
    """A message did not follow docs/protocol.md: malformed, inconsistent or oversized.

    Raised by the decoders in :mod:`zmqtransport.wire` and :mod:`zmqtransport.codec`
    for anything a peer sent that cannot be trusted; never leaves partial state.

    ``code`` is the error code a server answers such a request with
    (docs/protocol.md, "Error codes"); callers branch on it, never on the text.
    """

    code = "bad_request"


class VersionMismatchError(ProtocolError):
    """The peer speaks another protocol version; the message names both versions."""

    code = "version"


class RemoteError(TransportError):
    """The peer answered a request with an error reply (wrong step, disallowed, ...).

    ``code`` is the machine-readable code from the reply (see docs/protocol.md).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message


class IntegrityError(TransportError):
    """A received frame did not match the checksum the sender computed for it."""


class BindError(TransportError, OSError):
    """The transport could not listen where it was told to (``bind_host`` / ``port``).

    The message names the option and its value (``port=41234 is already in
    use ...``, ``bind_host='10.9.9.9': not an address of this host``); ``errno``
    is the operating system's code (``EADDRINUSE``, ``EADDRNOTAVAIL``, ...).
    Raised by the constructor, which has released everything it set up.
    """


class ConnectionLostError(TransportError, ConnectionError):
    """The connection to the source ended while receiving from it (process killed, host gone, reset)."""


class StalledError(TimeoutError):
    """The source sent nothing for ``stall_timeout`` in the middle of a transfer."""
