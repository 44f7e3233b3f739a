"""The backend conformance kit: helpers plus a pytest plugin (``--yirage-backend``).

Plugin authors run the shared cases against their backend with::

    pytest --pyargs yirage.testing.conformance --yirage-backend NAME
"""

from __future__ import annotations

from yirage.testing.oracle import (
    DTYPE_TOLERANCE,
    TOLERANCE,
    assert_close,
    assert_matches_reference,
    assert_matches_torch,
    assert_same_floats,
    random_inputs,
)

__all__ = ["DTYPE_TOLERANCE", "TOLERANCE", "assert_close", "assert_matches_reference", "assert_matches_torch",
           "assert_same_floats", "random_inputs"]
