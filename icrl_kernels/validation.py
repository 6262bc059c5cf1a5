"""Argument and value checks, public: the helpers both packages use (``icrl_models`` imports them from here),
for code that builds on the ops too.

Argument checks raise ``TypeError`` for a value of the wrong kind and ``ValueError`` for one out of range,
naming the argument. Value checks (:func:`check_values`, :func:`check_status_codes`) read a tensor's values
without a host sync on CUDA: see :func:`set_value_checks` and docs/architecture.md#the-value-check-funnel.
"""

from ._validation import (
    FLOAT_DTYPES,
    INT_DTYPES,
    KERNEL_FLOAT_DTYPES,
    VALUE_CHECK_MODES,
    check_bool,
    check_choice,
    check_device,
    check_features,
    check_finite_float,
    check_generator,
    check_int,
    check_matches_params,
    check_positive_float,
    check_probability,
    check_same_device,
    check_shape,
    check_status_codes,
    check_tensor,
    check_values,
    device_side_value_checks,
    row_mask,
    set_value_checks,
    value_checks,
)

__all__ = [
    "FLOAT_DTYPES",
    "INT_DTYPES",
    "KERNEL_FLOAT_DTYPES",
    "VALUE_CHECK_MODES",
    "check_bool",
    "check_choice",
    "check_device",
    "check_features",
    "check_finite_float",
    "check_generator",
    "check_int",
    "check_matches_params",
    "check_positive_float",
    "check_probability",
    "check_same_device",
    "check_shape",
    "check_status_codes",
    "check_tensor",
    "check_values",
    "device_side_value_checks",
    "row_mask",
    "set_value_checks",
    "value_checks",
]
