"""Backend-neutral pieces of code generation that every renderer shares.

``emit`` (indented source lines), ``indexing`` (broadcast strides, dim coalescing, flat-index arithmetic, spelled
through a small syntax table), ``exprs`` (walking the kernel IR's expression
trees) and ``fingerprint`` (a hash of a package's own sources, for cache keys);
``cstyle`` renders a KernelPlan as C-family source, ``dialect`` holds what a C
dialect spells and checks a plan against it, ``dialects`` has one small file of
spellings per language (OpenCL C, CUDA C, HIP, Metal); ``launch`` holds the launch
records every renderer produces and the header line that carries them on top of a source.
Pure Python: importing this package never imports numba or a device library.
"""
