"""Stagings ``disallow_checkpoint`` withdrew while receives of them ran (docs/protocol.md, "Releasing staged memory").

Pure bookkeeping for the :class:`~zmqtransport.serve.scheduler.Scheduler`
(no zmq, no threads, an explicit ``now``).

The contract asks two things of a disallow: once it returns the caller may
mutate the staged tensors, and a checkpoint being sent gets sent. So a
withdrawn staging serves no new receive, but the receives running at that
moment finish, from a :class:`~zmqtransport.serve.snapshot.Snapshot` of what
they may still ask for; the caller waits only for that copy. What a running
receive may still ask for:

* a **whole transfer** (a plain ``fetch`` over one connection): the messages
  not sent yet. A receive that loses its connection fails, so nothing sent is
  asked for again;
* a **reader**, a receiver that was sent the header alone (a striped receive,
  or one the source sent to a relay), fetches spans: as it goes, over
  connections the source cannot tie to it (each has its own routing id), again
  after a lost connection, and from the source whenever its relay fails. It may
  still ask for **any** message. Every span fetch that names a withdrawn
  staging comes from a reader: the staging's id travels only with its header,
  and no header of it is sent any more.

The snapshot is taken as soon as what the running receives may need fits the
cap (usually at once), by a thread of its own while the transfers go on from
the caller's tensors; it copies from the end and stops at the *floor*, the
first message some transfer may still need (:meth:`Withdrawals.publish_floors`).
Until it is taken the disallow waits; beyond the cap that is the fallback,
still the contract. A withdrawn staging ends when its receives have: whole transfers end
(finished, failed, stalled), readers leave (their connection closes; or no
request, credit or frame of the staging moves for the stall bound: a frozen
receiver is let go; after a forced rebind, which drops every reader's
connections and what libzmq queued for them, not before the rebind grace).
It ends in any case at the transport timeout after the disallow (its
transfers then end ``disallowed``): receives are bounded by the same timeout.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeVar

from .. import wire
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .staged import Served, Staged


class Transfer(Protocol):
    """What this module reads of a running transfer (serve/transfers.py's ``Transfer``)."""

    staged: Served  # what it sends from: switched to the snapshot once it is taken
    span: bool
    next_seq: int
    stop: int
    last_progress: float

    @property
    def done(self) -> bool: ...


T = TypeVar("T", bound=Transfer)

# Seconds between looks at a staging still served from the caller's tensors
# (beyond the cap): whether what its receives may need fits the cap by now.
RECHECK = 0.05
# Readers one staging remembers (the oldest go first): far above any number of
# receivers fetching one step at once, and a bound on a flood of header fetches.
MAX_READERS = 4096


@dataclass(eq=False)
class Withdrawn:
    """One withdrawn staging: what its running transfers read, and the readers that may still ask."""

    staged: Staged
    since: float  # when disallow_checkpoint withdrew it
    cap: int  # the most bytes its snapshot (with the others alive) may hold
    readers: set[bytes]
    last_activity: float  # the latest span fetch for it, or progress of a transfer of it
    source: Staged | Snapshot = field(init=False)  # the caller's tensors until the snapshot is taken
    checked: float = float("-inf")  # when the cap was last tried
    # Readers are kept at least until then: a forced rebind dropped their
    # connections and what libzmq still queued for them, and they come back
    # only once they have landed what they had and noticed the loss.
    kept_until: float = float("-inf")
    copying: bool = False  # a snapshot is being taken
    # No transfer needs a message below this (the copy stops there). Written by
    # the serving thread (publish_floors), read by the thread taking the snapshot.
    floor: int = 0

    def __post_init__(self) -> None:
        self.source = self.staged

    @property
    def snapshotted(self) -> bool:
        return self.source is not self.staged

    def serves(self, transfer: Transfer) -> bool:
        return transfer.staged is self.staged or transfer.staged is self.source


class Withdrawals:
    """The withdrawn stagings still serving receives, by staging id."""

    def __init__(self, stall: float, timeout: float) -> None:
        self.stall = stall
        self.timeout = timeout
        self.by_stage: dict[int, Withdrawn] = {}
        # The staged step's readers (insertion-ordered, at most MAX_READERS);
        # the scheduler clears them when it stages another.
        self.readers: dict[bytes, None] = {}

    def reader(self, peer: bytes) -> None:
        """``peer`` was sent the staged step's header alone: it fetches spans as it goes."""
        self.readers.pop(peer, None)
        self.readers[peer] = None
        while len(self.readers) > MAX_READERS:
            del self.readers[next(iter(self.readers))]

    def withdraw(self, staged: Staged, transfers: Iterable[Transfer], now: float, cap: int) -> tuple[int, int]:
        """``staged`` serves no new receive from now on; kept while receives of it run.

        Returns how many receives run, and the bytes they may still ask for.
        """
        running = list(transfers)
        withdrawn = Withdrawn(staged, now, cap, set(self.readers), now)
        self.readers = {}
        whole = sum(1 for t in running if withdrawn.serves(t) and not t.span)
        if not withdrawn.readers and not any(withdrawn.serves(t) for t in running):
            return 0, 0
        self.by_stage[staged.stage_id] = withdrawn
        needed = wire.plan_bytes([staged.plan[seq] for seq in self.needed(withdrawn, running)])
        return whole + len(withdrawn.readers), needed

    def find(self, stage_id: int | None) -> Withdrawn | None:
        return None if stage_id is None else self.by_stage.get(stage_id)

    def refusal(
        self, withdrawn: Withdrawn, request: wire.Request, now: float, busy: str | None
    ) -> tuple[str, str] | None:
        """Why a span fetch for ``withdrawn`` is refused (code, message); None: its source serves it.

        ``busy``: why the scheduler's limits would refuse one more transfer from its peer, if they would.
        """
        assert request.span is not None  # wire.decode_request: a stage id comes with a span
        source, (first, stop) = withdrawn.source, request.span
        if request.step != source.step:
            return wire.ERR_WRONG_STEP, f"staging {source.stage_id} is step {source.step}"
        if stop > source.messages:
            return wire.ERR_BAD_REQUEST, f"span {list(request.span)} beyond the plan"
        if not all(source.available(seq) for seq in range(first, stop)):
            return wire.ERR_DISALLOWED, f"step {source.step} is no longer served"
        withdrawn.last_activity = now  # its receive is still going
        return None if busy is None else (wire.ERR_BUSY, busy)

    def held(self, withdrawn: Withdrawn, now: float) -> int | None:
        """What ``withdrawn`` still serves, for a swarm member's ``have`` question: None (everything) or bits."""
        withdrawn.last_activity = now  # its receive is still going
        source = withdrawn.source
        if all(source.available(seq) for seq in range(source.messages)):
            return None
        return sum(1 << seq for seq in range(source.messages) if source.available(seq))

    def digests_of(self, withdrawn: Withdrawn, now: float) -> Staged | Snapshot:
        """What a digest request for ``withdrawn`` hashes: its source (its receive is still going)."""
        withdrawn.last_activity = now
        return withdrawn.source

    @property
    def reading_caller_memory(self) -> bool:
        """Whether a transfer may still read a withdrawn staging's tensors (one beyond the cap)."""
        return any(not w.snapshotted for w in self.by_stage.values())

    @property
    def snapshot_bytes(self) -> int:
        return sum(w.source.nbytes for w in self.by_stage.values() if isinstance(w.source, Snapshot))

    def needed(self, withdrawn: Withdrawn, transfers: Iterable[Transfer]) -> list[int]:
        """The data messages its running receives may still ask for (ascending)."""
        mine = [t for t in transfers if withdrawn.serves(t)]
        if withdrawn.readers or any(t.span for t in mine):
            return list(range(withdrawn.staged.messages))
        seqs: set[int] = set()
        for transfer in mine:
            seqs.update(range(transfer.next_seq, transfer.stop))
        return sorted(seqs)

    def due(self, transfers: Iterable[Transfer], now: float) -> list[tuple[Withdrawn, list[int]]]:
        """Stagings whose snapshot fits the cap now, with the messages to copy."""
        pending = [
            w for w in self.by_stage.values() if not w.snapshotted and not w.copying and now - w.checked >= RECHECK
        ]
        if not pending:
            return []
        running = list(transfers)
        held = self.snapshot_bytes
        chosen: list[tuple[Withdrawn, list[int]]] = []
        for withdrawn in pending:
            withdrawn.checked = now
            seqs = self.needed(withdrawn, running)
            nbytes = wire.plan_bytes([withdrawn.staged.plan[seq] for seq in seqs])
            if held + nbytes <= withdrawn.cap:
                chosen.append((withdrawn, seqs))
                withdrawn.copying = True
                held += nbytes
        return chosen

    def publish_floors(self, transfers: Iterable[Transfer]) -> None:
        """Move each snapshot being taken's floor up to the first message a transfer may still need."""
        copying = [w for w in self.by_stage.values() if w.copying]
        if not copying:
            return
        running = list(transfers)
        for withdrawn in copying:
            mine = [t for t in running if withdrawn.serves(t)]
            if withdrawn.readers or any(t.span for t in mine):
                continue  # they may ask for any message: the floor stays 0
            withdrawn.floor = min((t.next_seq for t in mine), default=withdrawn.staged.messages)

    def snapshotted(self, withdrawn: Withdrawn, snapshot: Snapshot, transfers: Iterable[Transfer]) -> None:
        """Its transfers read ``snapshot`` from now on, never the caller's tensors."""
        withdrawn.copying = False
        for transfer in transfers:
            if transfer.staged is withdrawn.staged:
                # The copy stopped at a floor no transfer had gone below: it holds what is left to send.
                assert transfer.done or snapshot.available(transfer.next_seq), (transfer.next_seq, snapshot.step)
                transfer.staged = snapshot
        withdrawn.source = snapshot

    def copy_failed(self, withdrawn: Withdrawn) -> None:
        """The snapshot could not be taken (no memory): its receives are waited for instead."""
        withdrawn.copying = False
        withdrawn.cap = 0

    def left(self, peer: bytes) -> None:
        """The connection of ``peer`` closed: it reads nothing any more."""
        self.readers.pop(peer, None)
        for withdrawn in self.by_stage.values():
            withdrawn.readers.discard(peer)

    def expire(self, transfers: Iterable[T], now: float) -> list[T]:
        """Forget readers gone quiet and stagings nobody receives; returns transfers past the timeout."""
        running = list(transfers)
        overdue: list[T] = []
        for stage_id, withdrawn in list(self.by_stage.items()):
            mine = [t for t in running if withdrawn.serves(t)]
            if now - withdrawn.since >= self.timeout:
                overdue += mine
                del self.by_stage[stage_id]
                continue
            # Kept in the record: a span transfer ends as soon as libzmq has its last
            # frame, long before a slow reader has landed it and asks for more.
            withdrawn.last_activity = max([withdrawn.last_activity, *(t.last_progress for t in mine)])
            if withdrawn.readers and now >= self._quiet_until(withdrawn):
                withdrawn.readers.clear()
            if not mine and not withdrawn.readers:
                del self.by_stage[stage_id]
        return overdue

    def deadlines(self, transfers: Iterable[Transfer]) -> list[float]:
        """When :meth:`expire` or :meth:`due` may have something to do."""
        running = list(transfers)
        times: list[float] = []
        for withdrawn in self.by_stage.values():
            times.append(withdrawn.since + self.timeout)
            if not withdrawn.snapshotted and not withdrawn.copying:  # a copy's end wakes the socket owner
                times.append(withdrawn.checked + RECHECK)
            if withdrawn.readers:
                mine = [t.last_progress for t in running if withdrawn.serves(t)]
                times.append(max([self._quiet_until(withdrawn), *(t + self.stall for t in mine)]))
        return times

    def _quiet_until(self, withdrawn: Withdrawn) -> float:
        """When ``withdrawn``'s readers are let go if nothing of it moves (progress folded in by expire)."""
        return max(withdrawn.last_activity + self.stall, withdrawn.kept_until)

    def rebound(self, now: float, grace: float) -> None:
        """The socket was closed and bound again: every reader reconnects and asks again, given ``grace``."""
        for withdrawn in self.by_stage.values():
            withdrawn.kept_until = max(withdrawn.kept_until, now + grace)

    def clear(self) -> None:
        self.by_stage.clear()
        self.readers.clear()
