"""Backends for domestic accelerators, one small module each.

Ascend, Cambricon and Moore Threads register their own torch device through
an adapter package (torch_npu, torch_mlu, torch_musa). MetaX, Iluvatar CoreX
and Hygon DCU present themselves through ``torch.cuda`` and are told apart
from NVIDIA (and from each other) by device name and torch build.
"""
