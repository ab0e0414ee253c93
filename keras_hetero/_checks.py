"""Argument checks shared by keras_hetero's public functions."""

import numbers


def check_int(name, value, minimum=1, expected=None):
    """Returns `value` as an int if it is an integer (a Python or numpy
    int, not a bool) >= `minimum`.

    Raises:
        ValueError: Naming the argument, the value received and what was
            expected (`expected`, or "an integer >= minimum").
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < minimum
    ):
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: "
            f"{name}={value!r}. Expected "
            f"{expected or f'an integer >= {minimum}'}."
        )
    return int(value)
