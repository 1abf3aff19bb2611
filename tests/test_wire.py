"""The frame size a sender picks when its ``chunk_bytes`` is not set (``wire.frame_bytes``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zmqtransport import wire
from zmqtransport.device import DeviceStaging
from zmqtransport.serve.staged import stage

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(
    ("total", "pack_below", "frame"),
    [
        (GiB, 64 * KiB, MiB),  # a large state keeps 1 MiB frames: per-message cost matters there
        (256 * MiB, 64 * KiB, MiB),  # 256 frames already
        (256 * MiB - 1, 64 * KiB, 512 * KiB),
        (128 * MiB, 64 * KiB, 512 * KiB),
        (64 * MiB, 64 * KiB, 256 * KiB),  # the lab's fan-out state: 256 frames
        (MiB, 64 * KiB, 256 * KiB),  # never below 256 KiB
        (0, 64 * KiB, 256 * KiB),
        (64 * MiB, 512 * KiB, 512 * KiB),  # packed storages must fit a frame
        (64 * MiB, MiB, MiB),
    ],
)
def test_a_small_state_gets_smaller_frames(total: int, pack_below: int, frame: int) -> None:
    assert wire.frame_bytes(total, pack_below) == frame


@pytest.mark.parametrize(
    ("total", "receivers", "frame"),
    [
        (256 * MiB, 1, MiB),  # one receiver, or a few: as before
        (256 * MiB, 16, MiB),  # 16 frames of 1 MiB are a sixteenth of the state
        (256 * MiB, 17, 512 * KiB),
        (256 * MiB, 64, 256 * KiB),  # a job start of 65 replica groups
        (256 * MiB, 255, 256 * KiB),  # never below SMALL_STATE_FRAME: each message costs CPU
        (64 * MiB, 11, 256 * KiB),  # the lab's swarms: as before
        (16 * MiB, 31, 256 * KiB),
        (GiB, 64, MiB),
        (GiB, 65, 512 * KiB),
    ],
)
def test_a_source_expecting_many_receivers_cuts_smaller_frames(total: int, receivers: int, frame: int) -> None:
    # The swarm's start costs each member about receivers x frame of the source's uplink before its
    # first message; kept to a sixteenth of the state (docs/sim.md, "The frame at job scale").
    assert wire.frame_bytes(total, 64 * KiB, receivers) == frame
    assert wire.frame_bytes(total, 512 * KiB, receivers) == max(frame, 512 * KiB)  # packed storages must fit


def staged_frames(state: Any, chunk_bytes: int | None, receivers: int = 1) -> tuple[int, int]:
    staged = stage(
        state,
        1,
        allow_pickle=False,
        chunk_bytes=chunk_bytes,
        pack_below=64 * KiB,
        checksum=None,
        staging=DeviceStaging(),
        receivers=receivers,
    )
    return len(staged.plan), max(wire.chunk_length(pieces) for pieces in staged.plan)


def test_staging_without_chunk_bytes_follows_the_state_size_and_an_explicit_one_is_kept() -> None:
    state = {"w": torch.zeros(4 * MiB // 4), "b": torch.zeros(3 * MiB // 4)}  # 7 MiB
    assert staged_frames(state, None) == (28, 256 * KiB)
    assert staged_frames(state, MiB) == (7, MiB)
    assert staged_frames(state, 64 * KiB) == (112, 64 * KiB)


def test_send_checkpoint_stages_for_as_many_receivers_as_dst_ranks_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import timedelta

    from zmqtransport import transport as module

    seen: list[int] = []
    real = module.stage

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["receivers"])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, "stage", spy)
    sender = module.ZMQTransport(timedelta(seconds=5))
    try:
        sender.send_checkpoint(list(range(1, 65)), 1, {"w": torch.zeros(16)})
        sender.send_checkpoint([], 2, {"w": torch.zeros(16)})
    finally:
        sender.shutdown()
    assert seen == [64, 1]
    state = {"w": torch.empty(128 * MiB // 4)}
    assert staged_frames(state, None) == (256, 512 * KiB)
    assert staged_frames(state, None, receivers=64) == (512, 256 * KiB)
    assert staged_frames(state, MiB, receivers=64) == (128, MiB)  # an explicit chunk_bytes is kept
