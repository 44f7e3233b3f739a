"""Every OpenCL device on the machine, best first: what the probe reports and ``devices.device()`` picks from.

A leaf module (pyopencl is imported only when asked) so that the plugin module, which must stay import-light,
and devices.py, which selects the device a program runs on, share one enumeration without importing each other.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

TYPE_RANK = {"GPU": 0, "ACCELERATOR": 1, "CUSTOM": 2, "CPU": 3}


def type_name(cl: Any, device: Any) -> str:
    """The OpenCL device type of ``device`` as a word: GPU, ACCELERATOR, CUSTOM, CPU (else DEFAULT)."""
    for name in ("GPU", "ACCELERATOR", "CUSTOM", "CPU"):
        if device.type & getattr(cl.device_type, name):
            return name
    return "DEFAULT"


@functools.cache
def all_devices() -> tuple[list[Any], str]:
    """Every OpenCL device, best first (GPU, then more compute units), or an empty list and why."""
    cl = importlib.import_module("pyopencl")
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:
        return [], f"no OpenCL platform ({exc}); install an ICD such as PoCL: pip install pocl-binary-distribution"
    devices = []
    for platform in platforms:
        try:
            devices.extend(platform.get_devices())
        except cl.Error:
            continue  # a platform with no devices of any type is not an error
    devices.sort(key=lambda d: (TYPE_RANK.get(type_name(cl, d), 9), -d.max_compute_units))
    if not devices:
        names = ", ".join(p.name for p in platforms)
        return [], f"OpenCL platforms ({names}) expose no device"
    return devices, ""
