"""Custom metric objects that outlive their model instance, so that a reload does not delete the new one's.

A Triton 2.51 workaround (docs/troubleshooting.md, "Triton 2.51 defects"): the Python backend deletes a
``MetricFamily`` or ``Metric`` on Triton's side when its Python object is released, and on a reload the old
instance's ``finalize`` would delete the family and series the new instance shares (same name, same labels).
Objects passed to :func:`keep` are never released: one family per metric name and one series per label set, a few
hundred bytes per reload, kept by Triton until it exits.
"""

from __future__ import annotations

import ctypes


def keep(*objects: object) -> None:
    """Never release ``objects`` (one extra reference each, never dropped): their destructors never run."""
    for obj in objects:
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
