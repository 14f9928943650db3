"""Progress hooks of the HOST arm, process-wide: which host libraries run them and which hooks exist.

A HOST-arm device thread that spins (``arch::spin_pause``, strong mode) first calls every hook
registered in its library's table (gpunet/device/include/gpunet/host_simt.h), then yields. A hook is a C
function ``int64_t fn(uint64_t arg)`` (a numba ``cfunc``) that does one bounded pass of some CPU
engine's work and returns the work done; it must be safe from any thread at any time, so each
engine takes a try-lock around its pass, shared with its own thread (gpunet/host/softnic.py H_EXEC).

Why: on the 2-core CI machine the caller, each NIC engine thread and the other ranks' threads all
poll, and each hand-off to an engine thread cost a context switch behind the others or a sleep
(bench/cpu_put.py --diag); a caller that runs the engine's pass itself while it waits has nothing
to hand off. The engine threads keep running for work nobody waits for.

Two sides meet here, so neither needs to know the other:
- ``add_library(lib)``: a library whose waits should progress the engines (gpunet/_launch.py adds
  the Context's ops library on the CPU); every hook registered now or later is added to it.
- ``register(fn, arg)`` / ``unregister(handle)``: an engine's hook (gpunet/host/softnic.py SoftNic),
  added to every such library; ``unregister`` returns once no thread is inside the hook, so the
  engine may free what ``arg`` points at right after. ``fn`` may be a callable returning the
  address: it is called (the hook compiled) only once a library needs it, so a process without
  one (CUDA) never compiles a hook (a cold numba compile of the proxy's took ~40 s).
Libraries are never unloaded (gpunet/device/loader.py caches them per process), so the list only grows.
tests/test_cpu_put.py::test_a_waiting_caller_executes_its_nics_work,
::test_closed_nics_hooks_are_gone.
"""
import ctypes
import itertools
import threading

_lock = threading.Lock()
_libs = []                       # [lib]: libraries with a hook table (gpunet_host_progress_add)
_hooks = {}                      # handle -> [fn, arg, {id(lib): slot}]
_handles = itertools.count(1)


def _bind(lib):
    add, rm = lib.gpunet_host_progress_add, lib.gpunet_host_progress_remove
    add.argtypes, add.restype = [ctypes.c_void_p, ctypes.c_uint64], ctypes.c_int
    rm.argtypes, rm.restype = [ctypes.c_int], ctypes.c_int
    return add, rm


def add_library(lib):
    """Let ``lib``'s spinning device threads run every registered hook. Returns False (and does
    nothing) for a library without a hook table (not built for arch "host"). Idempotent."""
    if getattr(lib, "gpunet_host_progress_add", None) is None:
        return False
    with _lock:
        if any(x is lib for x in _libs):
            return True
        add, _ = _bind(lib)
        _libs.append(lib)
        for hook in _hooks.values():
            slot = add(_address(hook), hook[1])
            if slot >= 0:               # a full table: that engine's thread alone serves it
                hook[2][id(lib)] = slot
    return True


def _address(hook):
    if callable(hook[0]):
        hook[0] = int(hook[0]())
    return hook[0]


def register(fn, arg):
    """Add the hook ``fn(arg)`` (``fn``: an address or a callable returning it; ``arg``: an
    address) to every library of :func:`add_library`, present and future. Returns a handle for
    :func:`unregister`."""
    with _lock:
        h = next(_handles)
        hook = [fn if callable(fn) else int(fn), int(arg), {}]
        for lib in _libs:
            slot = lib.gpunet_host_progress_add(_address(hook), hook[1])
            if slot >= 0:
                hook[2][id(lib)] = slot
        _hooks[h] = hook
        return h


def unregister(handle):
    """Remove a hook from every library; returns once no thread is inside it. Idempotent."""
    with _lock:
        hook = _hooks.pop(handle, None)
        if hook is None:
            return
        for lib in _libs:
            slot = hook[2].get(id(lib))
            if slot is not None:
                lib.gpunet_host_progress_remove(slot)


def registered(handle):
    """The number of libraries in which ``handle``'s hook is live (0 once unregistered)."""
    with _lock:
        hook = _hooks.get(handle)
        return 0 if hook is None else len(hook[2])
