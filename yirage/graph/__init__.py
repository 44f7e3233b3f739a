"""Kernel graphs: tensors, dtypes, the op table, validation, hashing, JSON."""
