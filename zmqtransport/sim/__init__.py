"""A discrete-event model of a swarm receive that runs the real decisions (issue 35).

No sockets, no threads: simulated hosts (links, latency, CPU) carry the
messages that the real :class:`~zmqtransport.fetch.planner.ReceivePlanner`
(one per receiver) and the real :class:`~zmqtransport.serve.scheduler.Scheduler`
(the source's, and each member's relaying side) decide to send. See docs/sim.md.

* :mod:`.model`: calibration constants, hosts, links, CPU.
* :mod:`.loop`: the event loop (a clock and a heap).
* :mod:`.nodes`: the glue: planner and scheduler actions become simulated messages.
* :mod:`.cli`: ``python -m zmqtransport.sim``.
* :mod:`.validation`: the lab's scenarios and the model's side of them (issue 35, item 2).
* :mod:`.plot`, :mod:`.sweep`: ``--plot``, the slowest receiver over ideal against N.
"""
