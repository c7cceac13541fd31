"""Memory accounting: the closed-form model (analytic), and the tensor tracker behind the traced and
measured estimates."""
from .breakdown import CATEGORIES, MemoryBreakdown

__all__ = ["CATEGORIES", "MemoryBreakdown"]
