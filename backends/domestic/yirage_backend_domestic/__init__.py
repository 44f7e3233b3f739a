"""Backends for domestic accelerators, one small module each.

Ascend, Cambricon and Moore Threads register their own torch device through
an adapter package (torch_npu, torch_mlu, torch_musa). MetaX, Iluvatar CoreX
and Hygon DCU present themselves through ``torch.cuda`` and are told apart
from NVIDIA (and from each other) by device name and torch build.

Kernels (``_kernels``): kernel plans compile with the vendor's Triton port
where it is installed and its driver reports the device (``_triton_probe``
finds it without importing triton); otherwise they run as unfused torch ops
on the device, and a PersistentKernel runs on the reference runtime. Each
backend's ``kernel_path()`` says which and why (``yirage_backend_manager.py info``).
"""
