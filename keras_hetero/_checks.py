"""Argument checks shared by keras_hetero's public functions.

Each returns the value, or raises `ValueError` in Keras' style, naming the
argument and echoing the value: ``Invalid value for argument `x`.
Received: x=<value>. Expected <expected>.`` (the `expected` argument words
the last part).
Standard library only: every layer of the package may import it.
"""

import math
import numbers


def check_int(name, value, minimum=1, expected=None, maximum=None):
    """Returns `value` as an int if it is an integer (a Python or numpy
    int, not a bool) in `[minimum, maximum]`.

    Raises:
        ValueError: Naming the argument, the value received and what was
            expected (`expected`, or "an integer >= minimum", or "an
            integer in [minimum, maximum]").
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < minimum
        or (maximum is not None and value > maximum)
    ):
        if expected is None:
            expected = (
                f"an integer >= {minimum}"
                if maximum is None
                else f"an integer in [{minimum}, {maximum}]"
            )
        _fail(name, value, expected)
    return int(value)


def check_positive(name, value, expected="a positive number"):
    """Returns `value` as a float if it is a finite real number > 0 (not a
    bool).

    Raises:
        ValueError: Naming the argument, the value received and
            `expected`.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        _fail(name, value, expected)
    return float(value)


def check_number(name, value, low=None, high=None, *, above=False):
    """Returns `value` as a float if it is a finite real number (not a
    bool) in `[low, high]` (`(low, high]` with `above`).

    Raises:
        ValueError: Naming the argument, the value received and the range
            expected.

    Example:

    >>> check_number("threshold", 0.5, 0, 1, above=True)
    0.5
    """
    inside = (
        not isinstance(value, bool)
        and isinstance(value, numbers.Real)
        and math.isfinite(value)
        and (low is None or value > low or (value == low and not above))
        and (high is None or value <= high)
    )
    if not inside:
        if high is None:
            expected = f"a number {'>' if above else '>='} {low}"
        else:
            expected = f"a number in {'(' if above else '['}{low}, {high}]"
        _fail(name, value, expected)
    return float(value)


def check_choice(name, value, choices, expected=None):
    """Returns `value` if it is one of `choices`.

    Raises:
        ValueError: Naming the argument, the value received and what was
            expected (`expected`, or "one of <choices>").
    """
    if value not in choices:
        _fail(name, value, expected or f"one of {choices}")
    return value


def _fail(name, value, expected):
    raise ValueError(
        f"Invalid value for argument `{name}`. Received: "
        f"{name}={value!r}. Expected {expected}."
    )
