"""Ground floor: addresses, aligned buffers, deadlines and process liveness. Imports nothing
from gpunet.

Every layer may use these (host/, device/, gpunet/), so this module may import only the standard
library and numpy: importing it can never close an import cycle. tests/test_layers.py guards that
rule (with gpunet/errors.py, gpunet/config.py and gpunet/resource.py, the floor's other modules).
"""
import os
import time

import numpy as np


def pid_alive(pid):
    """False once no process ``pid`` exists on this machine (a rank that exited or was killed);
    True while one does (also one of another user: kill(pid, 0) is then refused, not missing)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def address_of(arr):
    """The virtual address of a numpy array's (or a buffer's) first byte."""
    return int(np.asarray(arr).ctypes.data)


def aligned_zeros(nbytes, align=64):
    """A zeroed uint8 array of ``nbytes`` whose first byte is ``align``-aligned (the view keeps
    its over-allocated base alive)."""
    raw = np.zeros(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes]


class Deadline:
    """A host-side wait bound: ``Deadline(timeout_s)``; ``expired()``; ``remaining()`` (seconds,
    never negative). CLOCK_MONOTONIC, the clock rawmem.clock_ns reads inside numba code."""

    __slots__ = ("end",)

    def __init__(self, timeout_s):
        self.end = time.monotonic() + float(timeout_s)

    def expired(self):
        return time.monotonic() > self.end

    def remaining(self):
        return max(0.0, self.end - time.monotonic())
