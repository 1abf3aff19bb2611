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
source uploaded. Peak RSS is the rise of ``VmHWM`` over the timed region.
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
