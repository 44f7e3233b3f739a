"""Executables: compiled kernel graphs with input checking, per backend."""
