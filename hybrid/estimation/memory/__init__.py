"""Memory per GPU in closed form: the activations, a rank's placement of its states, the breakdown
by category, and what cp, ep and pipeline stages change (the trace is measure/'s)."""
from .breakdown import CATEGORIES, MemoryBreakdown

__all__ = ["CATEGORIES", "MemoryBreakdown"]
