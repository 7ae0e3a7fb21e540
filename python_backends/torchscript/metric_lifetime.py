"""Custom metric objects that outlive their model instance, so that a reload does not delete the new one's.

A Triton 2.51 workaround (docs/troubleshooting.md, "Triton 2.51 defects").
Triton 2.51's Python backend deletes a ``MetricFamily`` (and a ``Metric``) on Triton's side when the Python object
is released. A reload (the watchdog's after a crash needs no finalize, but an operator's through the repository
API does) starts the new instance first; it gets the *same* family and series (same name, same labels), then the
old instance's ``finalize`` released its objects, which deleted them under the new instance: the rows vanished from
``/metrics`` at once (measured), and under load ``tritonserver`` crashed (``malloc_consolidate(): unaligned
fastbin chunk``, SIGSEGV). Objects passed to :func:`keep` are never released: one family per
metric name and one series per label set, a few hundred bytes per reload, kept by Triton until it exits.
"""

from __future__ import annotations

import ctypes


def keep(*objects: object) -> None:
    """Never release ``objects`` (one extra reference each, never dropped): their destructors never run."""
    for obj in objects:
        if obj is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
