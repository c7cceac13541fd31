"""Measuring the plan's best layouts on the cluster and choosing the fastest (torch)."""
from .._compat import lazy_names

__getattr__ = lazy_names("hybrid.tune", dict.fromkeys(
    ("Trial", "TuneResult", "select", "tokens_per_s_per_gpu", "synthetic_ids", "tune", "format_tune",
     "tune_for_wrap"), "hybrid.tune.trials"))
