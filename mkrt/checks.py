"""Checks of user-given options, shared by every op: each returns the clean value or raises
TypeError / ValueError naming the area (``mkrt.<area>: ...``). Nothing here needs a GPU."""

from __future__ import annotations

import math
import numbers

#: the most CTAs a 1-D grid may have (gridDim.x)
MAX_GRID = 2**31 - 1
#: the longest bound a wait may have (one day): its nanoseconds fit a u64 many times over
MAX_TIMEOUT_MS = 86_400_000.0


def integer(value, name: str, area: str, *, low: int | None = None, high: int | None = None,
            optional: bool = False):
    """`value` as an int in [low, high]; bools, floats and strings are refused (a tile
    size of 128.0 or a ctas of "4" is a caller's mistake, not something to guess at)."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"mkrt.{area}: {name} must be an int{' or None' if optional else ''}, "
                        f"got {value!r} ({type(value).__name__})")
    value = int(value)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = (f">= {low}" if high is None else f"<= {high}" if low is None
                  else f"in [{low}, {high}]")
        raise ValueError(f"mkrt.{area}: {name} must be {bounds}, got {value}")
    return value


def flag(value, name: str, area: str, *, optional: bool = False):
    """True, False (or None when `optional`): a string such as "no" is refused, not truthy."""
    if value is None and optional:
        return None
    if not isinstance(value, numbers.Integral) or value not in (0, 1):     # bools included
        raise TypeError(f"mkrt.{area}: {name} must be True, False{' or None' if optional else ''}, "
                        f"got {value!r}")
    return bool(value)


def timeout_ms(value, area: str) -> float:
    """A finite wait bound in milliseconds, > 0 and at most :data:`MAX_TIMEOUT_MS`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"mkrt.{area}: timeout_ms must be a number of milliseconds, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or not 0 < value <= MAX_TIMEOUT_MS:
        raise ValueError(f"mkrt.{area}: timeout_ms must be > 0 and <= {MAX_TIMEOUT_MS:g} "
                         f"(one day), got {value}")
    return value
