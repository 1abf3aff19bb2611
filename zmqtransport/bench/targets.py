"""The performance targets of issue 4, checked wherever a run measured what they need."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .runner import ScenarioResult


@dataclass
class Target:
    scenario: str
    text: str
    measured: float
    limit: float
    higher_is_better: bool

    @property
    def holds(self) -> bool:
        return self.measured >= self.limit if self.higher_is_better else self.measured <= self.limit


def evaluate_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    """The performance targets of issue 4, wherever the run measured what they need."""
    targets: list[Target] = []
    mib = float(1 << 20)

    def add(scenario: str, text: str, measured: float, limit: float, higher: bool = True) -> None:
        targets.append(Target(scenario, text, measured, limit, higher))

    for result in results:
        name, s = result.scenario.name, result.summary
        zi, zf = s.get("zmq-inplace"), s.get("zmq-fresh")
        if name == "inplace" and zi is not None:
            if "tcp-reused" in zi.ratios:
                add(name, "zmq-inplace speed / tcp-reused ceiling", zi.ratios["tcp-reused"], 0.75)
            add(name, "sender peak RSS growth, MiB", zi.send_rss_max / mib, 64, higher=False)
            add(
                name,
                "in-place receiver peak RSS growth, MiB",
                zi.recv_rss_max / mib,
                128,
                higher=False,
            )
        if name == "fresh" and zf is not None:
            if "http" in zf.ratios:
                add(name, "zmq-fresh speed / http (num_chunks=0)", zf.ratios["http"], 2.0)
            if "http-4" in zf.ratios:
                add(name, "zmq-fresh speed / http-4 (num_chunks=4)", zf.ratios["http-4"], 1.3)
            add(name, "sender peak RSS growth, MiB", zf.send_rss_max / mib, 64, higher=False)
        if name == "small" and zf is not None and "http" in zf.ratios:
            add(name, "zmq-fresh speed / http (num_chunks=0)", zf.ratios["http"], 6.0)
        if name == "fanout":
            for method in ("zmq-fresh", "zmq-inplace"):
                entry = s.get(method)
                if entry is None:
                    continue
                if "http" in entry.ratios:
                    add(
                        name,
                        f"{method} slowest receiver speed / http slowest",
                        entry.ratios["http"],
                        2.0,
                    )
                add(name, f"{method} slowest / fastest receiver", entry.spread, 1.5, higher=False)
        if name == "tiny":
            for method in ("zmq-fresh", "zmq-inplace"):
                entry = s.get(method)
                if entry is not None:
                    add(name, f"{method} median recv, ms", entry.slowest_s * 1000, 5.0, higher=False)
    return targets
