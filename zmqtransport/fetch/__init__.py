"""The receiving side: one receive in the calling thread; pure plans apart from its sockets.

::

    transport.recv_checkpoint ──FetchOptions (options.py), peer options──> receive.fetch
      receive.Receive      the phases: request, header, data, end; one thread owns every stream
        connection.Connections  the receive's DEALERs (Connection: a streams.DealerStream with
          │                     a path): the source's paths, extra streams, a relay's; closed together
          racing.PathChoice     pure: which advertised path to use (connect_first races them)
        streams             the stream seam (send, reply, receive into place, wait, close):
                            DealerStream + SourceWatch (socket monitor, heartbeats); MemoryStream
        liveness            pure: the bounds, ConnectionState, how a wait ended -> the exception
        replies             pure: an error reply -> the exception;  requests: every fetch request
        landing.plan_landing  pure: where each storage lands, what to prefault
        landed.land / build   the plan carried out in memory; the object built at the end
        inbox.Inbox         each data message received into place from a stream, checked, counted
        owner.Owner         the striped data phase's one socket owner: polls, drains, carries out
          planner.ReceivePlanner  pure: every decision of a striped receive (events in, actions
            │                 out; Outgoing: what is asked when), over the books below
            registry.Registry  pure: every request out (span, question, digests), by transfer id
            spans.SpanBook     pure: which span each stream asks for (rarest first, by pace), takeovers
            peers.Peers        pure: the swarm's members, when to ask each what it holds
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
