"""The wire format: message envelopes, the checkpoint header, and the chunk plan.

Requests (:func:`decode_request`) and replies (:func:`decode_reply`) are each
decoded in one place. Everything here is pure (no sockets) so both sides and
the tests share one definition of the protocol. docs/protocol.md is the prose version of this file;
keep the two in step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from . import digests
from .errors import ProtocolError, VersionMismatchError

PROTOCOL_VERSION = 1

# Operations, receiver -> sender.
OP_FETCH = "fetch"
OP_CREDIT = "credit"
OP_CANCEL = "cancel"
# Both ways: a receiver asks a peer (or the source) what it holds; the reply says (docs/protocol.md, "Swarm").
OP_HAVE = "have"
# Operations, sender -> receiver.
OP_HEADER = "header"
OP_DATA = "data"
OP_END = "end"
OP_ERROR = "error"
OP_DIGESTS = "digests"  # the source's digests of a span's data messages (docs/protocol.md, "Digests")

REQUEST_OPS = (OP_FETCH, OP_CREDIT, OP_CANCEL, OP_HAVE)
REPLY_OPS = (OP_HEADER, OP_DATA, OP_END, OP_ERROR, OP_DIGESTS, OP_HAVE)

# Error codes carried by OP_ERROR replies. The two for undecodable requests are
# the codes of the exceptions the decoders raise, so a server answers with exc.code.
ERR_VERSION = VersionMismatchError.code
ERR_BAD_REQUEST = ProtocolError.code
ERR_WRONG_STEP = "wrong_step"
ERR_NOT_STAGED = "not_staged"
ERR_DISALLOWED = "disallowed"
ERR_STALLED = "stalled"
ERR_PICKLE = "pickle_refused"
ERR_SHUTDOWN = "shutdown"
ERR_BUSY = "busy"
# A relay does not (or no longer) serve what a span fetch's token names: fetch it elsewhere.
ERR_NOT_RELAYING = "not_relaying"

# A request is a few dozen bytes; anything bigger is not ours (ZMQ_MAXMSGSIZE on the ROUTER).
MAX_REQUEST_BYTES = 64 * 1024
# Largest header a receiver accepts, and the largest data frame a sender may choose.
MAX_HEADER_BYTES = 256 * 1024 * 1024
MAX_CHUNK_BYTES = 64 * 1024 * 1024
MIN_CHUNK_BYTES = 4 * 1024
# Largest number of data messages one receiver may have in flight (server-side cap).
MAX_CREDIT = 256
MAX_STEP = 2**63 - 1
MAX_MESSAGES = 2**32  # bound on a span's data message numbers (a plan has far fewer)
MAX_METADATA_CHARS = 4096  # a relay's metadata string in a request or header envelope
RELAY_TOKEN_BYTES = 16
MAX_PEERS = 64  # peers one swarm member is told about (a relay order, a have reply)
# How a have question asks the source to name the other members (NamedPeer, below).
NAMES_PLAIN, NAMES_FULL, NAMES_SHORT = 0, 1, 2
MAX_NAME_NUMBER = 2**32 - 1
MAX_DIGEST_BYTES = 64  # one digest (both algorithms give 32 bytes)
# Most storages and tensor-table entries one header may describe. Each costs the
# receiver Python objects and an allocation even when empty, so without a cap a
# header of zero-sized storages could exhaust memory while claiming no bytes.
MAX_TENSORS = 1 << 20


# What a rank orders (rank's ``order``): whom the source names to a member, and whom a member keeps of them.
NAMED, KEPT = b"named", b"kept"


def rank(order: bytes, asker: bytes, member: bytes) -> bytes:
    """Where swarm member ``member`` stands in member ``asker``'s ``order`` (both relay tokens, which the
    source draws at random): the source names each member the MAX_PEERS others of lowest NAMED rank, and a
    member keeps the peers of lowest KEPT rank among those it is named, so every member is in about as many
    views as any other (docs/protocol.md, "Swarm"). The two orders are independent draws: with one order
    for both, a member kept the first half of what the source named, and in the model 256 receivers took
    1.75-1.79x the ideal, against 1.69-1.70x."""
    return hashlib.blake2b(order + asker + member, digest_size=8).digest()


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(frame: bytes | memoryview, limit: int) -> dict[str, Any]:
    """Decode one envelope frame; anything but a msgpack map of bounded size is an error."""
    if len(frame) > limit:
        raise ProtocolError(f"envelope of {len(frame)} bytes exceeds the limit of {limit}")
    try:
        # unpackb bounds every string, array and map by the frame's own length.
        value = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types for bad input
        raise ProtocolError(f"undecodable msgpack envelope: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"envelope must be a msgpack map, got {type(value).__name__}")
    return value


def _field(message: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = message.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolError(f"field {name!r} is missing or not {getattr(kind, '__name__', kind)}")
    return value


def check_version(message: dict[str, Any], who: str) -> None:
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise VersionMismatchError(
            f"protocol version mismatch: {who} speaks version {version!r}, "
            f"this side speaks version {PROTOCOL_VERSION}"
        )


@dataclass(frozen=True)
class Request:
    op: str
    xfer: int
    step: int = 0
    wait_ms: int = 0
    credit: int = 0
    accept_pickle: bool = False
    header_only: bool = False
    # A span fetch (striped receives): data messages [first, stop) of the step
    # staged as ``stage``, without a header (docs/protocol.md, "Spans").
    span: tuple[int, int] | None = None
    stage: int | None = None
    # Relays (docs/protocol.md, "Swarm"): a header fetch offering to relay
    # gives where the receiver serves (its metadata); a span fetch to a relay
    # shows the token the source handed out for it.
    relay: str | None = None
    token: bytes | None = None
    # Digests (docs/protocol.md, "Digests"): the algorithms the receiver
    # verifies with, preferred first; with ``inline`` every data envelope of
    # this transfer carries the source's digest of its frame; with
    # ``digests_only`` a span fetch is answered with the span's digests alone.
    verify: tuple[str, ...] = ()
    inline: bool = False
    digests_only: bool = False
    # A have request of a swarm member to the source: messages it asks the source to reserve for it,
    # and how it wants the other members named (NAMES_PLAIN, NAMES_FULL, NAMES_SHORT).
    claim: int = 0
    names: int = NAMES_PLAIN


def decode_request(frame: bytes | memoryview) -> Request:
    """Parse and validate one receiver->sender envelope."""
    message = unpack(frame, MAX_REQUEST_BYTES)
    check_version(message, "the receiver")
    op = message.get("op")
    if op not in REQUEST_OPS:
        raise ProtocolError(f"unknown request op {op!r}")
    xfer = _field(message, "id", int)
    if not 0 <= xfer < 2**64:
        raise ProtocolError("transfer id out of range")
    if op == OP_FETCH:
        step = _field(message, "step", int)
        if not 0 <= step <= MAX_STEP:
            raise ProtocolError(f"step {step} out of range")
        wait_ms = _field(message, "wait_ms", int)
        credit = _field(message, "credit", int)
        if wait_ms < 0 or credit < 1:
            raise ProtocolError("wait_ms must be >= 0 and credit >= 1")
        span, stage = _span(message)
        relay, token = _relay_fields(message, span is not None)
        verify, inline, digests_only = _digest_fields(message, span is not None, token is not None)
        return Request(
            op,
            xfer,
            step=step,
            wait_ms=min(wait_ms, 7 * 24 * 3600 * 1000),
            credit=min(credit, MAX_CREDIT),
            accept_pickle=bool(message.get("pickle", False)),
            header_only=bool(message.get("header_only", False)),
            span=span,
            stage=stage,
            relay=relay,
            token=token,
            verify=verify,
            inline=inline,
            digests_only=digests_only,
        )
    if op == OP_CREDIT:
        credit = _field(message, "n", int)
        if not 1 <= credit <= MAX_CREDIT:
            raise ProtocolError(f"credit {credit} out of range")
        return Request(op, xfer, credit=credit)
    if op == OP_HAVE:
        stage = _field(message, "stage", int)
        if not 0 <= stage < 2**64:
            raise ProtocolError("field 'stage' must be an unsigned 64-bit integer")
        token = message.get("token")
        if token is not None and (not isinstance(token, bytes) or len(token) != RELAY_TOKEN_BYTES):
            raise ProtocolError(f"field 'token' must be {RELAY_TOKEN_BYTES} bytes")
        claim = message.get("claim", 0)
        if type(claim) is not int or not 0 <= claim <= MAX_CREDIT or (claim and token is None):
            raise ProtocolError(f"field 'claim' must be 0 to {MAX_CREDIT}, with field 'token'")
        names = message.get("names", NAMES_PLAIN)
        if type(names) is not int or names not in (NAMES_PLAIN, NAMES_FULL, NAMES_SHORT):
            raise ProtocolError(f"field 'names' must be {NAMES_PLAIN}, {NAMES_FULL} or {NAMES_SHORT}")
        return Request(op, xfer, stage=stage, token=token, claim=claim, names=names)
    return Request(op, xfer)


def _span(message: dict[str, Any]) -> tuple[tuple[int, int] | None, int | None]:
    """The optional ``span`` and ``stage`` fields of a fetch: both or neither."""
    span, stage = message.get("span"), message.get("stage")
    if span is None and stage is None:
        return None, None
    if not (isinstance(span, list) and len(span) == 2 and all(type(n) is int for n in span)):
        raise ProtocolError("field 'span' must be [first, stop], two integers")
    first, stop = span
    if not 0 <= first < stop <= MAX_MESSAGES:
        raise ProtocolError(f"span {span!r} out of range")
    if type(stage) is not int or not 0 <= stage < 2**64:
        raise ProtocolError("a span fetch needs field 'stage', an unsigned 64-bit integer")
    return (first, stop), stage


def _relay_fields(message: dict[str, Any], is_span: bool) -> tuple[str | None, bytes | None]:
    """The optional ``relay`` (a header fetch's offer) and ``token`` (a span fetch to a relay) fields."""
    relay, token = message.get("relay"), message.get("token")
    if relay is not None and (not isinstance(relay, str) or not 0 < len(relay) <= MAX_METADATA_CHARS):
        raise ProtocolError(f"field 'relay' must be a metadata string of at most {MAX_METADATA_CHARS} characters")
    if token is not None and (not is_span or not isinstance(token, bytes) or len(token) != RELAY_TOKEN_BYTES):
        raise ProtocolError(f"field 'token' must be {RELAY_TOKEN_BYTES} bytes, on a span fetch")
    return relay, token


def _digest_fields(message: dict[str, Any], is_span: bool, to_relay: bool) -> tuple[tuple[str, ...], bool, bool]:
    """The optional ``verify``, ``inline`` and ``digests_only`` fields of a fetch."""
    verify, inline, only = message.get("verify"), message.get("inline", False), message.get("digests_only", False)
    if verify is None:
        verify = []
    if not (
        isinstance(verify, list)
        and len(verify) <= digests.MAX_OFFERED
        and all(isinstance(name, str) and 0 < len(name) <= digests.MAX_NAME_CHARS for name in verify)
    ):
        raise ProtocolError(f"field 'verify' must list at most {digests.MAX_OFFERED} algorithm names")
    if type(inline) is not bool or type(only) is not bool:
        raise ProtocolError("fields 'inline' and 'digests_only' must be booleans")
    if (inline or only) and not verify:
        raise ProtocolError("fields 'inline' and 'digests_only' need field 'verify'")
    if only and (not is_span or to_relay or inline):
        raise ProtocolError("field 'digests_only' is for a span fetch to the source, without 'inline'")
    return tuple(verify), inline, only


def fetch_request(
    xfer: int,
    step: int,
    wait_ms: int,
    credit: int,
    accept_pickle: bool,
    header_only: bool = False,
    span: tuple[int, int] | None = None,
    stage: int | None = None,
    relay: str | None = None,
    token: bytes | None = None,
    verify: Sequence[str] = (),
    inline: bool = False,
    digests_only: bool = False,
) -> bytes:
    message: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "op": OP_FETCH,
        "id": xfer,
        "step": step,
        "wait_ms": wait_ms,
        "credit": credit,
        "pickle": accept_pickle,
        "header_only": header_only,
    }
    if span is not None:
        # Only span fetches carry these, so a plain fetch stays byte for byte
        # what a sender without span support parses.
        message["span"] = list(span)
        message["stage"] = stage
    if relay is not None:
        message["relay"] = relay
    if token is not None:
        message["token"] = token
    if verify:
        message["verify"] = list(verify)
    if inline:
        message["inline"] = True
    if digests_only:
        message["digests_only"] = True
    return pack(message)


def have_request(xfer: int, stage: int, token: bytes | None, claim: int = 0, names: int = NAMES_PLAIN) -> bytes:
    """What do you hold of staging ``stage``? ``token``: the peer's (asking a relay) or the asker's own (the source).

    ``claim``: a swarm member asks the source to reserve it up to this many
    messages that the source has reserved for nobody yet; ``names``: how it
    wants the other members named (docs/protocol.md, "Swarm")."""
    message: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": OP_HAVE, "id": xfer, "stage": stage}
    if token is not None:
        message["token"] = token
    if claim:
        message["claim"] = claim
    if names != NAMES_PLAIN:
        message["names"] = names
    return pack(message)


def have_reply(
    xfer: int,
    bits: int | None,
    messages: int,
    peers: Sequence[NamedPeer] = (),
    coming: int = 0,
    claimed: tuple[int, ...] | None = None,
    alone: bool = False,
) -> bytes:
    """What this side holds (``bits``: a bit per data message; None: everything, the source), what it is
    fetching now (``coming``) and, from the source, the swarm's other members and, to a claim, the
    messages it reserved for the asker (``claimed``: ``(first, stop)``, or ``()`` when none are left);
    ``alone``: the source feeds the asker faster than the swarm would, fetch the rest from it alone."""
    message: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": OP_HAVE, "id": xfer}
    message.update(_holdings_fields(bits, coming, messages))
    if peers:
        message["peers"] = peers  # msgpack packs tuples as arrays: the same bytes as lists, no copy per entry
    if claimed is not None:
        message["claimed"] = list(claimed)
    if alone:
        message["alone"] = True
    return pack(message)


def credit_request(xfer: int, n: int) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "op": OP_CREDIT, "id": xfer, "n": n})


def cancel_request(xfer: int) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "op": OP_CANCEL, "id": xfer})


def error_reply(xfer: int, code: str, message: str) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "op": OP_ERROR, "id": xfer, "code": code, "msg": message})


def data_envelope(xfer: int, seq: int, crc: int | None, digest: bytes | None = None) -> bytes:
    """``digest``: the source's digest of the frame, for a transfer that asked for them inline."""
    if digest is None:
        return pack({"v": PROTOCOL_VERSION, "op": OP_DATA, "id": xfer, "seq": seq, "crc": crc})
    return pack({"v": PROTOCOL_VERSION, "op": OP_DATA, "id": xfer, "seq": seq, "crc": crc, "dg": digest})


def digests_reply(xfer: int, first: int, blob: bytes) -> bytes:
    """``blob``: the digests of data messages ``first`` on, concatenated (one per message of the span)."""
    return pack({"v": PROTOCOL_VERSION, "op": OP_DIGESTS, "id": xfer, "first": first, "dg": blob})


def end_reply(xfer: int, holdings: tuple[int, int, int] | None = None) -> bytes:
    """The end of a transfer. A relay ends a span with its ``holdings``, ``(bits, coming, messages)``: what
    it holds and is fetching, as a ``have`` reply says them, so that its downstream, which will ask it
    for more, learns them without a question (docs/protocol.md, "Swarm")."""
    fields = {} if holdings is None else _holdings_fields(*holdings)
    return pack({"v": PROTOCOL_VERSION, "op": OP_END, "id": xfer, **fields})


def _holdings_fields(bits: int | None, coming: int, messages: int) -> dict[str, bytes]:
    """A ``have`` or ``end`` reply's ``bits`` (absent when None) and ``coming`` (absent when empty), a bit
    per data message, little-endian; :func:`_holdings` reads them back."""
    size = (messages + 7) // 8
    fields = {} if bits is None else {"bits": bits.to_bytes(size, "little")}
    if coming:
        fields["coming"] = coming.to_bytes(size, "little")
    return fields


@dataclass(frozen=True, slots=True)
class Reply:
    """One validated sender->receiver envelope; ``more``: frames follow it (a header body, a payload).

    What a field means depends on ``op``: ``seq`` and ``crc`` of a data
    message; ``stage`` and ``relay`` of a header; ``code`` and ``text`` of an
    error; ``digest`` of a header (the algorithm the source chose) and
    ``digests_ahead`` (it hashes any message on request, sent or not); ``dg``
    of a data message (its digest) or of a ``digests`` reply (the digests of
    messages ``seq`` on, concatenated). ``xfer`` is None only for an error
    reply without a usable id (a sender refusing a request it could not
    decode answers with id 0).
    """

    op: str
    xfer: int | None
    more: bool
    seq: int = -1
    crc: int | None = None
    stage: int | None = None
    relay: RelayOrder | None = None
    code: str = ""
    text: str = ""
    digest: str | None = None
    digests_ahead: bool = False
    dg: bytes | None = None
    have: int | None = None  # a have reply's bit set (None: holds everything); a relay's end's (None: not said)
    coming: int = 0  # a have reply's (or a relay's end's) messages being fetched
    peers: tuple[NamedPeer, ...] = ()  # a have reply's swarm members, from the source
    claimed: tuple[int, ...] | None = None  # the messages the source reserved: (first, stop), () none left
    alone: bool = False  # a have reply's: the source's uplink outpaces the swarm, fetch from it alone


def decode_reply(frame: bytes | memoryview, more: bool, who: str) -> Reply:
    """Parse and validate one sender->receiver envelope from ``who`` (a peer's description)."""
    message = unpack(frame, MAX_REQUEST_BYTES)
    check_version(message, who)
    op = message.get("op")
    xfer = message.get("id")
    if type(xfer) is not int or not 0 <= xfer < 2**64:
        if op != OP_ERROR:
            raise ProtocolError(f"a {op!r} reply without a valid transfer id from {who}")
        xfer = None
    if op == OP_DATA:
        seq = message.get("seq")
        if type(seq) is not int or not 0 <= seq < MAX_MESSAGES:
            raise ProtocolError(f"data message number {seq!r} out of range from {who}")
        crc = message.get("crc")
        dg = message.get("dg")
        if dg is not None and (type(dg) is not bytes or not 0 < len(dg) <= MAX_DIGEST_BYTES):
            raise ProtocolError(f"data message digest must be 1 to {MAX_DIGEST_BYTES} bytes from {who}")
        return Reply(op, xfer, more, seq=seq, crc=crc if type(crc) is int else None, dg=dg)
    if op == OP_HEADER:
        stage = message.get("stage")
        if stage is not None and (type(stage) is not int or not 0 <= stage < 2**64):
            raise ProtocolError(f"header field 'stage' must be an unsigned 64-bit integer, got {stage!r}")
        digest = message.get("digest")
        if digest is not None and (type(digest) is not str or not 0 < len(digest) <= digests.MAX_NAME_CHARS):
            raise ProtocolError(f"header field 'digest' must name an algorithm, got {digest!r}")
        ahead = message.get("ahead", False)
        if type(ahead) is not bool or (ahead and digest is None):
            raise ProtocolError(f"header field 'ahead' must be true or false, and only beside 'digest', from {who}")
        relay = decode_relay_order(message.get("relay"))
        return Reply(op, xfer, more, stage=stage, relay=relay, digest=digest, digests_ahead=ahead)
    if op == OP_DIGESTS:
        first, dg = message.get("first"), message.get("dg")
        if type(first) is not int or not 0 <= first < MAX_MESSAGES or type(dg) is not bytes:
            raise ProtocolError(f"a malformed digests reply from {who}")
        return Reply(op, xfer, more, seq=first, dg=dg)
    if op == OP_ERROR:
        return Reply(op, xfer, more, code=str(message.get("code", "unknown")), text=str(message.get("msg", "")))
    if op == OP_END:
        have, fetching = _holdings(message, who)
        return Reply(op, xfer, more, have=have, coming=fetching)
    if op == OP_HAVE:
        have, fetching = _holdings(message, who)
        claimed = _claimed(message.get("claimed"), who)
        alone = message.get("alone", False)
        if type(alone) is not bool:
            raise ProtocolError(f"a have reply's 'alone' must be true or false, from {who}")
        return Reply(
            op, xfer, more, have=have, coming=fetching, peers=decode_named_peers(message.get("peers")),
            claimed=claimed, alone=alone,
        )
    raise ProtocolError(f"unknown reply op {op!r} from {who}")


def _holdings(message: dict[str, Any], who: str) -> tuple[int | None, int]:
    """A ``have`` or ``end`` reply's optional ``bits`` and ``coming``, as bit sets (``bits`` absent: None)."""
    bits, coming = message.get("bits"), message.get("coming", b"")
    if (bits is not None and not isinstance(bits, bytes)) or not isinstance(coming, bytes):
        raise ProtocolError(f"a {message.get('op')} reply's 'bits' and 'coming' must be bytes, from {who}")
    return None if bits is None else int.from_bytes(bits, "little"), int.from_bytes(coming, "little")


def _claimed(value: Any, who: str) -> tuple[int, ...] | None:
    """A have reply's optional ``claimed``: [first, stop] within the plan's bounds, or [] (none left)."""
    if value is None:
        return None
    if value == []:
        return ()
    if not (isinstance(value, list) and len(value) == 2 and all(type(n) is int for n in value)):
        raise ProtocolError(f"a have reply's 'claimed' must be [first, stop] or [], from {who}")
    first, stop = value
    if not 0 <= first < stop <= MAX_MESSAGES:
        raise ProtocolError(f"a have reply's 'claimed' {value!r} is out of range, from {who}")
    return first, stop


# ----------------------------------------------------------------------------- checkpoint header


@dataclass(frozen=True)
class Header:
    """The description of a staged checkpoint, sent once before its data frames."""

    step: int
    skeleton: Any
    tensors: list[Any]
    storages: list[int]  # nbytes of each storage, in stream order
    chunk_bytes: int
    pack_below: int
    checksum: str | None  # name of the per-frame checksum, or None

    @property
    def total_bytes(self) -> int:
        return sum(self.storages)

    def body(self) -> bytes:
        """The header frame that follows the envelope; packed once per staged step."""
        return pack(
            {
                "step": self.step,
                "skeleton": self.skeleton,
                "tensors": self.tensors,
                "storages": self.storages,
                "chunk_bytes": self.chunk_bytes,
                "pack_below": self.pack_below,
                "checksum": self.checksum,
            }
        )


def header_envelope(
    xfer: int,
    stage: int | None = None,
    relay: RelayOrder | None = None,
    digest: str | None = None,
    digests_ahead: bool = False,
) -> bytes:
    """``stage``: the staging's id, which also says that this sender serves span fetches.

    ``relay``: for a receiver that offered to relay, the token it serves
    under and where to fetch from instead of this sender (docs/protocol.md, "Swarm").
    ``digest``: for a receiver that offered to verify, the algorithm of the
    digests this sender serves it (docs/protocol.md, "Digests"); with
    ``digests_ahead``, this sender hashes any message on request, sent or
    not (device memory through its pinned ring), so a digest request waits
    for nothing but its turn.
    """
    message: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": OP_HEADER, "id": xfer}
    if stage is not None:
        message["stage"] = stage
    if digest is not None:
        message["digest"] = digest
        if digests_ahead:
            message["ahead"] = True
    if relay is not None:
        order: dict[str, Any] = {"token": relay.token}
        if relay.upstream is not None:
            order["from"] = relay.upstream
            order["from_token"] = relay.upstream_token
        if relay.peers:
            order["peers"] = [[at, token] for at, token in relay.peers]
        message["relay"] = order
    return pack(message)


# A member of a staging's swarm: where it serves (its metadata) and the token to show it.
Peer = tuple[str, bytes]
# A member as a source's have reply names it (docs/protocol.md, "Swarm"): [metadata, token] to an
# asker that said nothing of names (an earlier release); with the source's number for that entry,
# [metadata, token, number], to one that said NAMES_FULL or NAMES_SHORT; and to one that said
# NAMES_SHORT, the number alone once the source has named that entry to it in full. At 256 members
# the full names of 64 members, in every answer, were a sixth of the source's uplink (docs/sim.md).
NamedPeer = Peer | tuple[str, bytes, int] | int


@dataclass(frozen=True)
class RelayOrder:
    """What a source tells a receiver that offered to relay (the ``relay`` map of a header envelope).

    ``peers``: every member of the staging's swarm so far, to fetch from
    beside the source (docs/protocol.md, "Swarm"). ``upstream`` is the newest
    of them, for receivers that know only a chain.
    """

    token: bytes  # serve span fetches that show this token, for this staging
    upstream: str | None = None  # fetch spans from this relay (its metadata) ...
    upstream_token: bytes | None = None  # ... showing this token
    peers: tuple[Peer, ...] = ()


def decode_peers(value: Any) -> tuple[Peer, ...]:
    """Validate a list of ``[metadata, token]`` pairs (None: none)."""
    return tuple(_peer(entry) for entry in _peer_list(value))


def decode_named_peers(value: Any) -> tuple[NamedPeer, ...]:
    """Validate a have reply's ``peers`` (None: none): ``[metadata, token]``, ``[metadata, token, number]``
    or ``number`` (:data:`NamedPeer`)."""
    named: list[NamedPeer] = []
    for entry in _peer_list(value):
        if isinstance(entry, list) and len(entry) == 3:
            named.append((*_peer(entry[:2]), _name_number(entry[2])))
        elif isinstance(entry, list):
            named.append(_peer(entry))
        else:
            named.append(_name_number(entry))
    return tuple(named)


def _peer_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_PEERS:
        raise ProtocolError(f"'peers' must be a list of at most {MAX_PEERS} entries")
    return value


def _peer(entry: Any) -> Peer:
    if not (isinstance(entry, list) and len(entry) == 2):
        raise ProtocolError("a peer must be [metadata, token]")
    at, token = entry
    if not isinstance(at, str) or not 0 < len(at) <= MAX_METADATA_CHARS:
        raise ProtocolError("a peer's metadata must be a string")
    if not isinstance(token, bytes) or len(token) != RELAY_TOKEN_BYTES:
        raise ProtocolError(f"a peer's token must be {RELAY_TOKEN_BYTES} bytes")
    return at, token


def _name_number(value: Any) -> int:
    if type(value) is not int or not 0 <= value <= MAX_NAME_NUMBER:
        raise ProtocolError(f"a peer's number must be 0 to {MAX_NAME_NUMBER}")
    return value


def decode_relay_order(order: Any) -> RelayOrder | None:
    """Validate a header envelope's ``relay`` map (None: absent)."""
    if order is None:
        return None
    if not isinstance(order, dict):
        raise ProtocolError("header field 'relay' must be a map")
    token, upstream, upstream_token = order.get("token"), order.get("from"), order.get("from_token")
    if not isinstance(token, bytes) or len(token) != RELAY_TOKEN_BYTES:
        raise ProtocolError(f"relay token must be {RELAY_TOKEN_BYTES} bytes")
    peers = decode_peers(order.get("peers"))
    if upstream is None and upstream_token is None:
        return RelayOrder(token, peers=peers)
    if not isinstance(upstream, str) or not 0 < len(upstream) <= MAX_METADATA_CHARS:
        raise ProtocolError("relay field 'from' must be a metadata string")
    if not isinstance(upstream_token, bytes) or len(upstream_token) != RELAY_TOKEN_BYTES:
        raise ProtocolError(f"relay field 'from_token' must be {RELAY_TOKEN_BYTES} bytes")
    return RelayOrder(token, upstream, upstream_token, peers)


def decode_header(message: dict[str, Any]) -> Header:
    """Validate the fields of an OP_HEADER envelope (the tree itself is checked in codec/)."""
    if not isinstance(message, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(message).__name__}")
    step = _field(message, "step", int)
    if not 0 <= step <= MAX_STEP:
        raise ProtocolError(f"header step {step} out of range")
    storages = _field(message, "storages", list)
    if len(storages) > MAX_TENSORS:
        raise ProtocolError(f"header lists {len(storages)} storages, more than {MAX_TENSORS}")
    for nbytes in storages:
        if type(nbytes) is not int or not 0 <= nbytes <= 2**50:
            raise ProtocolError(f"invalid storage size {nbytes!r}")
    chunk_bytes = _field(message, "chunk_bytes", int)
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ProtocolError(f"chunk_bytes {chunk_bytes} outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
    pack_below = _field(message, "pack_below", int)
    if not 0 <= pack_below <= chunk_bytes:
        raise ProtocolError(f"pack_below {pack_below} outside [0, chunk_bytes]")
    checksum = message.get("checksum")
    if checksum is not None and checksum not in CHECKSUMS:
        raise ProtocolError(f"unknown checksum {checksum!r}")
    if "skeleton" not in message:
        raise ProtocolError("header has no skeleton")
    tensors = _field(message, "tensors", list)
    if len(tensors) > MAX_TENSORS:
        raise ProtocolError(f"header lists {len(tensors)} tensors, more than {MAX_TENSORS}")
    return Header(
        step=step,
        skeleton=message["skeleton"],
        tensors=tensors,
        storages=storages,
        chunk_bytes=chunk_bytes,
        pack_below=pack_below,
        checksum=checksum,
    )


# ----------------------------------------------------------------------------- chunk plan


class Piece(NamedTuple):
    """``length`` bytes of storage ``storage`` from byte ``start``: one part of a data message.

    A named tuple, not a frozen dataclass: both sides make one per small
    storage, and a frozen dataclass's ``__init__`` cost 1.1 us against 0.3 us
    (20,480 storages: 19 ms against 6 ms).
    """

    storage: int
    start: int
    length: int


def plan_chunks(storages: list[int], chunk_bytes: int, pack_below: int) -> list[list[Piece]]:
    """Split the storages into data messages; both sides compute the same plan.

    A storage of at least ``pack_below`` bytes travels alone, in slices of up to
    ``chunk_bytes`` (each slice one zero-copy frame). Smaller storages are packed,
    in order, into shared frames of up to ``chunk_bytes``: thousands of tiny
    tensors then cost a handful of messages instead of one each.
    """
    plan: list[list[Piece]] = []
    pack: list[Piece] = []
    packed = 0
    for index, nbytes in enumerate(storages):
        if nbytes == 0:
            continue
        if nbytes >= pack_below:
            for start in range(0, nbytes, chunk_bytes):
                plan.append([Piece(index, start, min(chunk_bytes, nbytes - start))])
            continue
        if packed + nbytes > chunk_bytes:
            plan.append(pack)
            pack, packed = [], 0
        pack.append(Piece(index, 0, nbytes))
        packed += nbytes
    if pack:
        plan.append(pack)
    return plan


# The frames a sender cuts a state into when its ``chunk_bytes`` is not set
# (frame_bytes): LARGE_STATE_FRAME, halved while the state would be fewer than
# SMALL_STATE_MESSAGES data messages, down to SMALL_STATE_FRAME. A fan-out
# pipelines in whole messages: a member serves a message to its peers only once
# it has landed and checked all of it, and a swarm's first messages share the
# source's uplink; so the start costs each receiver about (members x frame) /
# state of its transfer, whatever the link rate. In the lab (64 MiB, 400 Mbit/s)
# seven receivers took 1.27-1.30x the one-receiver time in 1 MiB frames and
# 1.14-1.19x in 256 KiB ones; three over two NICs 0.60-0.62x against 0.56-0.57x.
# Large states keep 1 MiB: there the start is a small part anyway, while each
# message costs ~100 us of Python on each side, which shows at loopback rates
# (1 GiB in place in 256 KiB frames: 0.35-0.46 s, in 1 MiB ones 0.24-0.32 s; 64 MiB:
# the same within noise, 36 against 38 ms).
LARGE_STATE_FRAME = 1024 * 1024
SMALL_STATE_FRAME = 256 * 1024
SMALL_STATE_MESSAGES = 256


def frame_bytes(total: int, pack_below: int) -> int:
    """The frame size (the header's ``chunk_bytes``) for a state of ``total`` bytes when the sender set none.

    :data:`LARGE_STATE_FRAME`, halved while the state would be fewer than
    :data:`SMALL_STATE_MESSAGES` messages, never below :data:`SMALL_STATE_FRAME`
    nor ``pack_below`` (packed storages must fit a frame).
    """
    floor = max(SMALL_STATE_FRAME, pack_below)
    size = LARGE_STATE_FRAME
    while size // 2 >= floor and total < SMALL_STATE_MESSAGES * size:
        size //= 2
    return size


def chunk_length(pieces: list[Piece]) -> int:
    return sum(piece.length for piece in pieces)


def plan_bytes(messages: Sequence[list[Piece]]) -> int:
    """Bytes of these data messages of a chunk plan (a span, or the whole plan)."""
    return sum(chunk_length(pieces) for pieces in messages)


# Per-frame checksums (opt-in). crc32 from zlib runs at several GB/s.
CHECKSUMS = ("crc32",)
