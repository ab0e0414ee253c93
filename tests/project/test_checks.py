"""The shared argument checks (`keras_hetero._checks`): each names the
argument, the value received and what was expected."""

import math

import numpy as np
import pytest

from keras_hetero import _checks


@pytest.mark.parametrize(
    "value, low, high, above, expected",
    [
        (0.5, 0, 1, True, None),
        (1, 0, 1, True, None),
        (np.float32(0.25), 0, 1, True, None),
        (0, 0, None, False, None),
        (0, 0, 1, True, "a number in (0, 1]"),
        (1.5, 0, 1, True, "a number in (0, 1]"),
        (-1, 0, None, False, "a number >= 0"),
        (0, 0, None, True, "a number > 0"),
        (True, 0, 1, False, "a number in [0, 1]"),
        ("0.5", 0, 1, False, "a number in [0, 1]"),
        (math.nan, 0, None, False, "a number >= 0"),
        (math.inf, 0, None, False, "a number >= 0"),
    ],
)
def test_check_number(value, low, high, above, expected):
    if expected is None:
        assert _checks.check_number("x", value, low, high, above=above) == (
            float(value)
        )
        return
    with pytest.raises(ValueError) as error:
        _checks.check_number("x", value, low, high, above=above)
    assert str(error.value) == (
        f"Invalid value for argument `x`. Received: x={value!r}. "
        f"Expected {expected}."
    )
