"""Import torch once, without its "Failed to initialize NumPy" warning.

torch warns at import time when numpy is not installed. zmqtransport never
uses numpy (tensors travel as raw bytes), so that warning says nothing about
anything this package does, and the ``zmqtransport`` command would print it
before its own output on every run. Only that one warning is hidden, and only
while torch is first imported here; when the application imported torch
already, this does nothing. Depending on numpy instead would cost an install
and about 0.1-0.2 s per start for a module that is never used
(docs/cli.md, "Start-up").
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch  # noqa: F401
