"""The library's logger: user-facing lines go through `logging`, not print.

`hybrid` messages (the plan auto_wrap chose, warnings) are INFO/WARNING records of the "hybrid"
logger. Unless the application configured logging itself, they print to stdout as plain lines,
from rank 0 only (other ranks log WARNING and above). Configure the "hybrid" logger to change it.
"""
from __future__ import annotations

import logging
import os
import sys


def get_logger(name: str) -> logging.Logger:
    root = logging.getLogger("hybrid")
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        root.propagate = False
        root.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    return logging.getLogger(name)
