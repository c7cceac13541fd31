"""The one exception type for bad user input.

Subclasses ValueError so callers that catch ValueError keep working; the CLI turns it into a
one-line message and exit code 2, while genuine bugs still show their traceback.
"""


class HybridError(ValueError):
    """Bad input: the message names the wrong value, the rule it breaks and the fix."""


def unknown_name(kind: str, value: str, valid) -> HybridError:
    """The registry-style error: `unknown GPU 'h100'. Available: a100-40gb, ...`."""
    return HybridError(f"unknown {kind} {value!r}. Available: {', '.join(sorted(valid))}")


def short(value, n: int = 80) -> str:
    """A value as an error message shows it: its repr, at most `n` characters (a job file or a
    checkpoint may hold megabytes where one word was expected)."""
    text = repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."


class NotApplicable(HybridError):
    """This strategy cannot run this job at all (not a matter of memory)."""

    def __init__(self, message: str, dim: str | None = None):
        super().__init__(message)
        self.dim = dim
        """The layout dimension (pp, tp, cp) the reason is about, when it is about one."""
