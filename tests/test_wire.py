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


def staged_frames(state: Any, chunk_bytes: int | None) -> tuple[int, int]:
    staged = stage(
        state,
        1,
        allow_pickle=False,
        chunk_bytes=chunk_bytes,
        pack_below=64 * KiB,
        checksum=None,
        staging=DeviceStaging(),
    )
    return len(staged.plan), max(wire.chunk_length(pieces) for pieces in staged.plan)


def test_staging_without_chunk_bytes_follows_the_state_size_and_an_explicit_one_is_kept() -> None:
    state = {"w": torch.zeros(4 * MiB // 4), "b": torch.zeros(3 * MiB // 4)}  # 7 MiB
    assert staged_frames(state, None) == (28, 256 * KiB)
    assert staged_frames(state, MiB) == (7, MiB)
    assert staged_frames(state, 64 * KiB) == (112, 64 * KiB)
