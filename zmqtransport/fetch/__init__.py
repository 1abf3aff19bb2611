"""The receiving side: one receive in the calling thread, pure plans apart from its sockets.

::

    transport.recv_checkpoint ──FetchOptions (options.py), peer options──> receive.fetch
      receive.Receive      the phases: request, header, data, end; one thread owns every DEALER
        connection.Connections  the receive's DEALERs (one Connection type): the source's
          │                     paths, extra streams, a relay's; all closed together
          racing.PathChoice     pure: which advertised path to use (connect_first races them)
          liveness.SourceWatch  socket monitor, stall bound, heartbeats
        replies             reply envelopes off a DEALER, refusals -> exceptions, exact frames
        landing.plan_landing  pure: where each storage lands, what to prefault
        landed.land / build   the plan carried out in memory; the object built at the end
        inbox.Inbox         each data message received into place, checked, then counted
        striped.StripedReceive  spans over several connections (data phase); striped.Lanes
          │                 its streams and their fate (added, dropped, a peer dropped)
          asking.Asking     what goes out: span fetches, swarm questions, cancels
          peers.Peers       pure: the swarm's members, when to ask each what it holds
          spans.SpanBook    pure: which span each connection asks for (rarest first, by
                            pace), takeovers, re-queues, what peers hold
          checking.RelayCheck  what relays send, checked against the source's digests
            verify.DigestBook  pure: digests published, asked, and messages waiting for theirs
        relaying.RelayDuty  serving what has landed onward (through this transport's server)
      published.fetch_digests  every digest a source publishes for a step (inspect --digests)

It imports nothing from :mod:`zmqtransport.serve`: what both sides share (the
wire format, the relayed-step record, sockets, the codec) lies below both.
"""

from .options import FetchOptions, ProgressCallback, RelayOffer
from .published import Published, fetch_digests
from .receive import fetch, fetch_header

__all__ = ["FetchOptions", "ProgressCallback", "Published", "RelayOffer", "fetch", "fetch_digests", "fetch_header"]
