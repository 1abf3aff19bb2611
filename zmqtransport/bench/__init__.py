"""Benchmark ZMQTransport beside plain TCP, bare pyzmq and torchft's own transports.

Run ``python -m zmqtransport.bench --help`` (or ``zmqtransport bench``). One
long-lived sender process serves every method; each trial starts fresh receiver
processes, so the headline figure is **cold**: the first receive in a new
process, timed from the ``recv_checkpoint`` call to its return (for the socket
anchors: from connect to the last byte), with nothing received before in that
process. ``--warm`` adds a second receive in the same process, labelled "warm".
In every trial each method runs once, in an order rotated from trial to trial,
so slow drifts of a shared machine hit every method alike; tables show medians.

Methods (``--methods``; see :mod:`.methods`, one object each):

* ``tcp-reused`` / ``tcp-fresh``: anchors. One plain TCP stream read with
  ``recvmsg_into`` into the receiver's existing touched tensors / fresh ones.
* ``tcp-reused-4``: anchor. Four such streams at once into touched tensors,
  each a quarter of the bytes in a thread of its own (what parallel flows buy).
* ``zmq-bare``: anchor. A bare pyzmq ROUTER/DEALER credit loop, one frame per
  tensor, ``recv_into`` touched tensors: what any ZeroMQ design can do here.
* ``zmq-inplace`` / ``zmq-fresh``: ZMQTransport with / without ``state_dict``.
* ``http`` / ``http-4``: anchors. torchft's HTTPTransport, ``num_chunks`` 0
  (its default) and 4 (needs torchft).
* ``pg-inplace`` / ``pg-fresh``: torchft's PGTransport over ProcessGroupGloo
  (needs torchft and numpy), a new process group per trial.

Scenarios run on loopback, or in a network lab (``--lab``; :mod:`zmqtransport.lab`,
needs root): the source and each receiver on their own host, links rate-limited
with tbf; the lab table adds the ideal (bytes / link rate) and the bytes the
source uploaded. ``--scenario fast`` (issue 33) runs the lab over unshaped
links (no tbf: as fast as the kernel moves bytes, a NIC faster than the CPU),
MTU 1500 and 9000 (``--unshaped`` and ``--mtu`` for any lab preset). Peak RSS
is the rise of ``VmHWM`` over the timed region.

Every row has CPU seconds (user + system, all threads, from the processes'
own ``getrusage``) per GiB moved: each receiver's process from just before
the receives start to the trial's end (relaying for others included), the
source's from its release of the step, and all together. ``--profile`` adds
where that CPU goes, per process and thread, per phase of a receive, and per
function of the receiving thread (:mod:`.profiling`).
"""

from __future__ import annotations

from .command import available_requirements, build_parser, main, scenarios_from_args
from .config import (
    LAB_PRESETS,
    LOOPBACK_PRESETS,
    PRESETS,
    Knobs,
    LabSpec,
    Scenario,
    numpy_available,
    parse_size,
    torchft_available,
)
from .methods import METHODS, Method
from .runner import BenchError, ScenarioResult, run_scenario

__all__ = [
    "LAB_PRESETS",
    "LOOPBACK_PRESETS",
    "METHODS",
    "PRESETS",
    "BenchError",
    "Knobs",
    "LabSpec",
    "Method",
    "Scenario",
    "ScenarioResult",
    "available_requirements",
    "build_parser",
    "main",
    "numpy_available",
    "parse_size",
    "run_scenario",
    "scenarios_from_args",
    "torchft_available",
]
