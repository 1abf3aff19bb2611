"""The sending side: a pure scheduler driven by one socket owner.

::

    other threads ──Stage/Disallow/Stop──> server.Server (serving thread: poller, wake pipe)
                                             │ requests, time          ▲ actions
                                             ▼                         │
                                           scheduler.Scheduler (pure: transfers, credit,
                                             parked requests, limits, stalls)
    transfers       what the scheduler holds (Transfer, Parked); actions: what it returns
    admission       the limits (Limits) and every refusal of a request as it arrives (pure)
    relayed_steps.RelayedSteps (pure) the steps this side relays as a swarm member, by token
    router.Router   the ROUTER socket (options, bind, rebind on the same port)
    connections.ConnectionBook (pure) connections open per socket and per host, which one goes beyond the caps
    outbox.Outbox   carries out the scheduler's actions on the socket; SentLog of finished sends
    pump.DataPump   data messages for the transfers the scheduler offers (device staging)
    frames.HeldFrames  frames libzmq still holds, per transfer: progress, stuck receivers,
                       when to close the socket, when a disallow may return
    staged.Staged   what is served: the header and the memory of one step
    disallows.Disallows  a disallow_checkpoint in progress: the running receives' snapshot, when the caller goes
    withdrawn.Withdrawals (pure) withdrawn stagings, what their running receives may still ask for
    snapshot.Snapshot  a copy of that, taken on a thread of its own, served instead of the tensors
"""

from .server import Server
from .staged import Staged

__all__ = ["Server", "Staged"]
