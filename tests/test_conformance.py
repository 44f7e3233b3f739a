"""The shared backend conformance cases, run on every available backend."""

from yirage.testing.conformance import *  # noqa: F403
