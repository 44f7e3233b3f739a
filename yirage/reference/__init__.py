"""The reference oracle: float64/torch runners every backend is checked against.

Kept in one package so the oracle (graph runner, reference backend, reference
PersistentKernel runtime) can be audited as one unit and never depends on the
code it judges.
"""
