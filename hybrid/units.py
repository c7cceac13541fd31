"""Parsing and printing of byte sizes, counts and seconds (pure, no torch)."""
from __future__ import annotations

import re

from .errors import HybridError

GiB = 1024**3
MiB = 1024**2

# Binary units are powers of 1024, decimal units powers of 1000 (IEC 80000-13).
_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_COUNT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*"


MAX_BYTES = 1024**5
"""Sizes above 1 PiB are a typo, not a GPU (and would overflow the arithmetic)."""


def parse_bytes(text: str | int | float, flag: str | None = None) -> int:
    """'80GiB' -> 85899345920, '80GB' -> 80e9, '8e10' -> 80e9. Raises HybridError otherwise.
    `flag` (e.g. "--gpu-memory"): text needs its unit, as a user writes a size (`80` alone is one
    line naming `80GiB`, never 80 bytes); a Python int or float is a count of bytes either way."""
    if isinstance(text, (int, float)):
        if not 0 < text <= MAX_BYTES:
            raise HybridError(f"memory size must be positive and at most 1 PiB, got {text}")
        return int(text)
    m = re.fullmatch(_NUMBER + r"([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise HybridError(
            f"cannot parse memory size {text!r}: use a number with an optional unit, "
            "e.g. 80GiB, 80GB, 40960MiB or 8.5e10"
        )
    if flag and not m.group(2):
        number = m.group(1)
        raise HybridError(f"{flag} {number} has no unit (bytes?): memory sizes need one, e.g. {flag} {number}GiB "
                          f"(binary) or {flag} {number}GB (decimal)")
    value = float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    if not 0 < value <= MAX_BYTES:
        raise HybridError(f"memory size must be positive and at most 1 PiB, got {text!r}")
    return int(value)


def parse_count(text: str | int | float) -> int:
    """'7.5e9' -> 7500000000, '7B' -> 7e9, '125M' -> 125e6."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(_NUMBER + r"([A-Za-z]?)\s*", str(text))
        if not m or m.group(2).lower() not in _COUNT_UNITS:
            raise HybridError(
                f"cannot parse parameter count {text!r}: use e.g. 7.5e9, 7B or 125M"
            )
        value = float(m.group(1)) * _COUNT_UNITS[m.group(2).lower()]
    if not 1 <= value <= 1e15:
        raise HybridError(f"parameter count must be between 1 and 1e15, got {text!r}")
    return int(value)


def fmt_bytes(n: int | float | None) -> str:
    """Human form in binary units, e.g. '12.4 GiB'; None prints as 'unknown'."""
    if n is None:
        return "unknown"
    n = float(n)
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def env_seconds(environ, name: str, default: float, example: str) -> float:
    """A positive number of seconds from environment variable `name` (`default` when unset), or
    one line naming the value and an example."""
    value = environ.get(name)
    if value is None:
        return default
    try:
        t = float(value)
    except ValueError:
        t = -1.0
    if not 0 < t < 1e7:
        raise HybridError(f"{name}={value!r} must be a positive number of seconds, e.g. {example}")
    return t


_RATE_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "e": 1e18}


def parse_rate(text, what: str, unit: str) -> float:
    """A rate with its unit, required: `unit` "FLOP/s" ('1.2PFLOP/s', '989TFLOPS', '989 TFLOP/s')
    or "B/s" ('4TB/s', '900GB/s', '3.35 TB/s' are bytes; '400Gb/s', '400Gbps' are bits, / 8).
    Decimal prefixes only (a vendor's datasheet writes them so). One line naming `what`, the value
    and an example otherwise; a bare number is refused (it has no unit)."""
    example = "1.2PFLOP/s or 989TFLOP/s" if unit == "FLOP/s" else "4TB/s, 900GB/s or 400Gb/s (bits)"
    m = re.fullmatch(_NUMBER + r"([A-Za-z/ ]*?)\s*", str(text)) if isinstance(text, str) else None
    if m is None:
        raise HybridError(f"{what} {text!r} needs a number and its unit, e.g. {example}")
    value, suffix = float(m.group(1)), m.group(2).replace(" ", "")
    if unit == "FLOP/s":
        u = re.fullmatch(r"([kKmMgGtTpPeE]?)(?:FLOP/s|FLOPS|flop/s|flops)", suffix)
        scale = _RATE_PREFIX[u.group(1).lower()] if u else None
    else:
        u = re.fullmatch(r"([kKmMgGtTpP]?)(B/s|b/s|bps|Bps)", suffix)
        scale = _RATE_PREFIX[u.group(1).lower()] / (8 if u.group(2) in ("b/s", "bps") else 1) if u else None
    if scale is None:
        raise HybridError(f"{what} {text!r}: unknown or missing unit; write it with one, e.g. {example}")
    if not 0 < value * scale < 1e21:
        raise HybridError(f"{what} must be positive, got {text!r}")
    return value * scale
