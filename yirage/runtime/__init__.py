"""Executables: compiled kernel graphs with input checking, per backend, and the per-graph cache of them."""
