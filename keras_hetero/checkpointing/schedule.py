"""When `ElasticCheckpoint` saves: `save_every` parsed, and the Young/Daly
interval for `save_every="auto"`.

`parse_save_every` accepts steps, durations or `"auto"`, and
`young_daly_interval` gives the interval that minimises expected lost time,
`sqrt(2 * C * MTBF)` for a save cost `C` (Young, 1974; Daly, 2006).
"""

import dataclasses
import math
import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


@dataclasses.dataclass(frozen=True)
class SaveEvery:
    """A parsed `save_every`: exactly one of the fields is set.

    Attributes:
        steps: Save every this many train steps.
        seconds: Save when this many seconds passed since the last save.
        auto: Young/Daly interval from the measured save cost.
    """

    steps: int = None
    seconds: float = None
    auto: bool = False


def parse_duration(value, name):
    """Seconds in `value`: a positive number, or a string like "30s", "5m".

    Raises:
        ValueError: Naming `name` and the value, if it is neither.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and _DURATION.match(value):
        number, unit = _DURATION.match(value).groups()
        seconds = float(number) * _UNIT_SECONDS[unit]
    else:
        seconds = float("nan")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: "
            f"{name}={value!r}. Expected a positive number of seconds or a "
            'duration string such as "500ms", "30s", "5m" or "2h".'
        )
    return seconds


def parse_save_every(value):
    """Parses `ElasticCheckpoint(save_every=...)`.

    Args:
        value: A positive int (steps), a duration string ("30s", "5m",
            "2h", "500ms"), or "auto".

    Returns:
        A `SaveEvery`.

    Raises:
        ValueError: For anything else.

    Example:

    >>> parse_save_every("5m").seconds
    300.0
    """
    if isinstance(value, str) and value.strip() == "auto":
        return SaveEvery(auto=True)
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 1:
            return SaveEvery(steps=value)
    elif isinstance(value, str) and _DURATION.match(value):
        return SaveEvery(seconds=parse_duration(value, "save_every"))
    raise ValueError(
        "Invalid value for argument `save_every`. Received: "
        f"save_every={value!r}. Expected a positive int (steps), a duration "
        'string such as "30s", "5m" or "2h", or "auto".'
    )


def young_daly_interval(save_cost, mtbf, minimum=0.0):
    """Seconds between saves minimising expected lost work: sqrt(2·C·MTBF).

    Args:
        save_cost: Seconds one save costs training (C).
        mtbf: Mean seconds between failures.
        minimum: Lower bound (e.g. the time a background write takes, so at
            most one save is in flight). Defaults to `0.0`.

    Returns:
        The interval in seconds.

    Example:

    >>> round(young_daly_interval(0.5, 3600), 1)
    60.0
    """
    return max(math.sqrt(2.0 * max(save_cost, 0.0) * mtbf), minimum)
