"""The `hybrid` command: its subcommands and the demo."""
from .._compat import lazy_names
from .main import main

__all__ = ["main"]

__getattr__ = lazy_names("hybrid.cli", dict.fromkeys(
    ("build_parser", "cmd_estimate", "cmd_plan", "cmd_compare", "cmd_tune", "cmd_demo", "cmd_export", "TOP_ROWS"),
    "hybrid.cli.main"))
