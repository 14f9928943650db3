"""Which platform gpunet runs on (CUDA | MACA | CPU), its memory kinds, and the coherence policy.

This module is the one place that knows:

- how the platform is detected (``get_platform()``; ``GPUNET_PLATFORM=cpu|cuda|maca`` overrides);
- the platform's coherence *profile* for the soft NIC (``"nvidia"`` or ``"c500"``) and warp size;
- how each memory kind is made through the vendor runtime, called with ctypes and loaded lazily
  (``libcudart.so*`` / ``libmcruntime.so``): ``device``, ``finegrained``, ``host``, plus host
  registration of foreign memory and dma-buf export;
- ``COHERENCE_POLICY``: for each profile and each role a buffer plays, which kind it lives in and why.

What has run where (keep this up to date):

- CPU arm: run here (CI, no GPU).
- CUDA arm: the library loading and error paths run in CI (a CUDA 13 runtime without a GPU). On one
  H200 (2026-11-30; driver 580, torch 2.11+cu130, torch's own libcudart.so.13 picked up) the CUDA-only
  tests in tests/test_platform.py and ``bench/platform_probe.py`` passed: every kind allocates, copies
  round-trip, a torch kernel's stores through each ``ptr`` land (and the CPU sees them in ``host``
  memory), host_register(Mapped) of mmap'd memory works for kernel stores, dma-buf export of device
  memory returns an fd. host_register(io_memory=True) of plain RAM fails with error 1 (invalid
  value), as it should; against a real UAR page it has not run (no NIC there).
- MACA arm: *unverified*. Names, flag values and the detection heuristics come from FACTS.md (third
  parties citing ``mcr/mc_runtime_types.h``, Mooncake's MACA IBGDA work); nothing MACA has run here.
  Every MACA assumption is in ``_MACA_API`` or ``_detect_maca`` below.
"""
import ctypes
import ctypes.util
import glob
import logging
import mmap
import os
import threading
from typing import NamedTuple, Optional

import numpy as np

from gpunet import config
from gpunet._floor import pid_alive
from gpunet.errors import ClosedError, ConfigError, GpunetError, ToolchainError
from gpunet.resource import Resource

log = logging.getLogger("gpunet.platform")

PLATFORMS = ("cpu", "cuda", "maca")
PROFILES = ("nvidia", "c500")
KINDS = ("device", "finegrained", "host")
ROLES = ("sq", "cq", "dbrec", "uar", "signal", "payload_src", "payload_dst", "p2p_dst",
         "proxy_fifo", "status", "compute")

# Runtime error codes callers act on (CUDA values; cu-bridge keeps CUDA's codes for MACA —
# *unverified* for MACA).
ERR_NOT_PERMITTED = 800          # cudaErrorNotPermitted: e.g. HostRegister(IoMemory) refused
ERR_NOT_SUPPORTED = 801          # cudaErrorNotSupported
ERR_HOST_MEMORY_ALREADY_REGISTERED = 712


class VendorRuntimeError(GpunetError):
    """A vendor runtime call (cudaX / mcX / cuX) returned an error code.

    Attributes: ``call`` (the function name), ``code`` (the runtime's integer error code),
    ``library`` (the shared library it came from). ``code == ERR_NOT_PERMITTED`` (800) from
    ``host_register`` means the driver will not map that range into the GPU: use the proxy
    transport.
    """

    def __init__(self, message, call=None, code=None, library=None):
        super().__init__(message)
        self.call = call
        self.code = code
        self.library = library


# --------------------------------------------------------------------------------------------
# The coherence policy: one table, per profile, with the reason for each row (DESIGN.md,
# "The coherence model"). Kinds: device (HBM, cached), finegrained (HBM, uncached/coherent),
# host (pinned host memory mapped into the GPU).
# --------------------------------------------------------------------------------------------

class Placement(NamedTuple):
    """Where one role's memory lives: ``kind`` (one of KINDS) and ``reason`` (the fact behind it)."""
    kind: str
    reason: str


_SAME_ON_BOTH = (" gpunet places it the same way on both profiles so that one ring layout, one "
                 "doorbell protocol and the soft NIC / proxy (which read rings from the CPU) serve "
                 "every platform.")

COHERENCE_POLICY = {
    "c500": {
        "sq": Placement("host", (
            "Mooncake (C500, MACA 3.7.1.13): DevX CREATE_QP rejected queue memory at a GPU virtual "
            "address, so SQ rings must be host memory mapped into the GPU; GPU stores of 64-byte "
            "WQEs into a host-mapped ring reach 200 M/s (measured, H200), above a CX7's rate.")),
        "cq": Placement("host", (
            "Mooncake (C500): control queues (SQ, CQ, DBR) must live in host memory mapped into the "
            "GPU; also, NIC writes to `device` memory are not visible to SMs until an L2 eviction "
            "(c500 coherence model), so a CQ there could be polled stale forever.")),
        "dbrec": Placement("host", (
            "Mooncake (C500): doorbell records are rejected at a GPU virtual address like the "
            "queues; the NIC must see the GPU's DBR store, which `device` memory does not "
            "guarantee on C500 (writes stay in L2, seed report).")),
        "uar": Placement("host", (
            "Not allocated: the NIC's UAR page (MMIO in the NIC's BAR) is mapped into the GPU with "
            "host_register(..., io_memory=True), i.e. mcHostRegister(..., IoMemory) as Mooncake "
            "does through cu-bridge; the soft NIC's doorbell word lives in its host arena.")),
        "signal": Placement("finegrained", (
            "Signals are written by the NIC (remote atomics / puts) and polled by SMs, or written "
            "by SMs and read by the NIC: on C500 only finegrained (0x1) HBM is coherent with the "
            "NIC (Mooncake: default memory gave stale data that fences did not fix).")),
        "payload_src": Placement("finegrained", (
            "GPU-written data the NIC reads: with default memory the writes stayed in L2 and the "
            "NIC read stale HBM (seed report, MACA 3.8; Mooncake: successful CQEs, stale payload at "
            "the receiver, fences did not help); mcExtMallocWithFlags(..., Finegrained=0x1) fixes "
            "it. No documented flush exists, so gpunet relies on none.")),
        "payload_dst": Placement("finegrained", (
            "NIC-written data the GPU reads: in `device` memory NIC writes land in HBM and SMs may "
            "keep reading an older L2 line until an eviction (c500 coherence model, the mirror of "
            "the reported send-side staleness; this direction is modelled, not reported); "
            "finegrained HBM is uncached, so SMs see the NIC's bytes.")),
        "p2p_dst": Placement("finegrained", (
            "The heap a p2p peer's SMs store into (over MetaXLink) and this rank's SMs read: the "
            "seed measured a release-store / acquire-load flag barrier between two C500s hanging "
            "on plain device memory and passing on Finegrained (0x1); the soft NIC models a peer's "
            "stores into `device` memory as reaching the owner's loads only at L2 evictions "
            "(tests/test_peer_coherence.py). Unverified here: that mcIpc handles of a Finegrained "
            "allocation map it Finegrained on the peer too.")),
        "proxy_fifo": Placement("host", (
            "The CPU proxy drains it: host-pinned, GPU-mapped as in UCCL-EP; a host-mapped 16-byte "
            "command ring sustained 28-32 M commands/s (measured, H200).")),
        "status": Placement("device", (
            "Written by the kernel and read by the host only after the kernel has finished (stream "
            "synchronisation makes it visible); the NIC never touches it.")),
        "compute": Placement("device", (
            "Ordinary tensors: finegrained made repeated reads of a GEMM operand ~57% more "
            "expensive (seed report, C500), so use it only for what the NIC touches.")),
    },
    "nvidia": {
        "sq": Placement("host", (
            "gpunet's choice, not a hardware need (NVIDIA device memory is NIC-coherent): a GPU "
            "fills 64-byte WQEs into a host-mapped ring at 200 M/s (measured, H200), above a CX7's "
            "message rate." + _SAME_ON_BOTH)),
        "cq": Placement("host", (
            "gpunet's choice: the NIC writes CQEs and the GPU polls them; host memory mapped into "
            "the GPU is coherent for both, costing a PCIe round trip per poll (2.85 us measured "
            "host-mapped round trip)." + _SAME_ON_BOTH)),
        "dbrec": Placement("host", (
            "gpunet's choice: kept next to its rings; the GPU writes it with a system-scope "
            "release store and the NIC reads it by DMA." + _SAME_ON_BOTH)),
        "uar": Placement("host", (
            "Not allocated: the NIC's UAR page (MMIO) is mapped into the GPU with "
            "cudaHostRegister(Mapped | IoMemory) (error 800 where the driver refuses: fall back "
            "to the proxy); the soft NIC's doorbell word lives in its host arena.")),
        "signal": Placement("device", (
            "NVIDIA's L2 sits on the memory side, so NIC writes to device memory are seen by SMs "
            "and SM writes (after a system-scope release) by the NIC; polling stays in HBM.")),
        "payload_src": Placement("device", (
            "Device memory is coherent with the NIC on NVIDIA (L2 on the memory side; GPUDirect "
            "RDMA / dma-buf MRs read HBM): no uncached memory needed for GPU-written payload.")),
        "payload_dst": Placement("device", (
            "Device memory is coherent with the NIC on NVIDIA (memory-side L2): NIC writes are "
            "visible to SMs once the completion or signal has been observed with acquire.")),
        "p2p_dst": Placement("device", (
            "The heap a p2p peer's SMs store into (CUDA IPC of a cudaMalloc heap): a peer's stores "
            "before a system-scope release are seen by this GPU's acquire loads; a CUDA IPC flag "
            "ping-pong between two processes took 0.73 us a round trip under MPS (measured, "
            "H200).")),
        "proxy_fifo": Placement("host", (
            "The CPU proxy drains it: host-pinned, GPU-mapped as in UCCL-EP; a host-mapped 16-byte "
            "command ring sustained 28-32 M commands/s (measured, H200).")),
        "status": Placement("device", (
            "Written by the kernel and read by the host only after the kernel has finished; the "
            "NIC never touches it.")),
        "compute": Placement("device", (
            "Ordinary tensors: device memory is the fast path; nothing here needs another kind.")),
    },
}


def policy(role, profile=None):
    """The ``Placement(kind, reason)`` for ``role`` under ``profile`` (default: the platform's)."""
    if profile is None:
        profile = get_platform().profile
    if profile not in COHERENCE_POLICY:
        raise ConfigError(f"unknown coherence profile {profile!r}; expected one of {PROFILES}")
    table = COHERENCE_POLICY[profile]
    if role not in table:
        raise ConfigError(f"unknown buffer role {role!r}; expected one of {ROLES}")
    return table[role]


# --------------------------------------------------------------------------------------------
# Vendor runtimes, through ctypes. The CUDA and MACA arms stand side by side here.
# --------------------------------------------------------------------------------------------

class _Api(NamedTuple):
    """One vendor runtime's names and flag values (all in one place, per DESIGN's "one place")."""
    platform: str
    library: str                 # the library name users see in errors
    sonames: tuple               # names tried with dlopen, in order
    malloc: str
    malloc_flags: Optional[str]  # finegrained allocation entry point (None: plain malloc)
    finegrained_flag: int
    free: str
    host_alloc: str
    host_alloc_mapped: int
    host_get_device_pointer: str
    free_host: str
    host_register: str
    host_unregister: str
    register_mapped: int
    register_io_memory: int
    memcpy: str
    memcpy_default: int
    set_device: str
    get_error_string: str
    get_handle_for_range: str    # dma-buf export
    handle_type_dmabuf_fd: int
    driver_sonames: tuple        # where get_handle_for_range lives ('' = the runtime itself)
    ipc_get_mem_handle: str      # IPC export of a device allocation (a 64-byte handle)
    ipc_open_mem_handle: str
    ipc_close_mem_handle: str
    ipc_lazy_enable_peer_access: int
    memcpy_async: str            # the soft NIC engine's copies (Platform.copy_engine)
    stream_create_flags: str
    stream_non_blocking: int
    stream_synchronize: str
    stream_destroy: str


_CUDA_API = _Api(
    platform="cuda", library="libcudart.so",
    sonames=("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"),
    malloc="cudaMalloc",
    # H100/H200 device memory is already coherent with the NIC (the L2 is on the memory side), so
    # "finegrained" on CUDA is plain cudaMalloc: no uncached allocation exists or is needed.
    malloc_flags=None, finegrained_flag=0,
    free="cudaFree",
    host_alloc="cudaHostAlloc", host_alloc_mapped=0x02 | 0x01,   # Mapped | Portable
    host_get_device_pointer="cudaHostGetDevicePointer", free_host="cudaFreeHost",
    host_register="cudaHostRegister", host_unregister="cudaHostUnregister",
    register_mapped=0x02 | 0x01, register_io_memory=0x04,       # Mapped | Portable ; IoMemory
    memcpy="cudaMemcpy", memcpy_default=4,                      # cudaMemcpyDefault (UVA)
    set_device="cudaSetDevice", get_error_string="cudaGetErrorString",
    get_handle_for_range="cuMemGetHandleForAddressRange",
    handle_type_dmabuf_fd=0x1,                                  # CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    driver_sonames=("libcuda.so.1", "libcuda.so"),
    ipc_get_mem_handle="cudaIpcGetMemHandle", ipc_open_mem_handle="cudaIpcOpenMemHandle",
    ipc_close_mem_handle="cudaIpcCloseMemHandle",
    ipc_lazy_enable_peer_access=0x1,                            # cudaIpcMemLazyEnablePeerAccess
    memcpy_async="cudaMemcpyAsync", stream_create_flags="cudaStreamCreateWithFlags",
    stream_non_blocking=0x1,                                    # cudaStreamNonBlocking
    stream_synchronize="cudaStreamSynchronize", stream_destroy="cudaStreamDestroy",
)

# *Unverified*: every name and value below is taken from FACTS.md or assumed to mirror CUDA's
# (cu-bridge maps cudaX to mcX one to one). Nothing here has run on a C500.
_MACA_API = _Api(
    platform="maca", library="libmcruntime.so",
    sonames=("libmcruntime.so",),
    malloc="mcMalloc",
    malloc_flags="mcExtMallocWithFlags", finegrained_flag=0x1,  # mcDeviceMallocFinegrained (FACTS)
    free="mcFree",
    host_alloc="mcHostAlloc", host_alloc_mapped=0x02 | 0x01,    # assumed = CUDA's values
    host_get_device_pointer="mcHostGetDevicePointer", free_host="mcFreeHost",
    host_register="mcHostRegister", host_unregister="mcHostUnregister",
    register_mapped=0x02 | 0x01, register_io_memory=0x04,       # mcHostRegisterIoMemory: assumed
    memcpy="mcMemcpy", memcpy_default=4,                        # assumed = cudaMemcpyDefault
    set_device="mcSetDevice", get_error_string="mcGetErrorString",
    get_handle_for_range="mcMemGetHandleForAddressRange",       # FACTS; lives in the runtime?
    handle_type_dmabuf_fd=0x1,                                  # mcMemHandleTypePosixFileDescriptor: assumed 1
    driver_sonames=("",),
    ipc_get_mem_handle="mcIpcGetMemHandle", ipc_open_mem_handle="mcIpcOpenMemHandle",
    ipc_close_mem_handle="mcIpcCloseMemHandle",
    ipc_lazy_enable_peer_access=0x1,                            # assumed = CUDA's value
    memcpy_async="mcMemcpyAsync", stream_create_flags="mcStreamCreateWithFlags",
    stream_non_blocking=0x1,                                    # assumed = CUDA's value
    stream_synchronize="mcStreamSynchronize", stream_destroy="mcStreamDestroy",
)

_APIS = {"cuda": _CUDA_API, "maca": _MACA_API}


def _mapped_libraries(fragment):
    """Paths of shared objects already mapped into this process whose name contains ``fragment``.

    Preferring these means gpunet talks to the same runtime copy torch loaded."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if fragment in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


def _runtime_candidates(api):
    """Library paths to try for ``api``, in order. ``GPUNET_RUNTIME_LIB`` replaces the search."""
    forced = config.get("GPUNET_RUNTIME_LIB")
    if forced:
        return [forced]
    stem = "libcudart" if api.platform == "cuda" else "libmcruntime"
    cands = [p for p in _mapped_libraries(stem + ".so")]
    if api.platform == "cuda":
        for root in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                                  "/usr/local/cuda")):
            cands += sorted(glob.glob(os.path.join(root, "lib*", "libcudart.so*")))
        try:  # the pip wheel torch depends on
            import nvidia.cuda_runtime as _ncr  # type: ignore
            for d in getattr(_ncr, "__path__", []):
                cands += sorted(glob.glob(os.path.join(d, "lib", "libcudart.so*")))
        except ImportError:
            pass
        found = ctypes.util.find_library("cudart")
    else:
        # *Unverified* layout: MACA installs under $MACA_PATH (default /opt/maca) with lib/.
        for root in filter(None, (os.environ.get("MACA_PATH"), "/opt/maca")):
            cands.append(os.path.join(root, "lib", "libmcruntime.so"))
        found = ctypes.util.find_library("mcruntime")
    if found:
        cands.append(found)
    cands += list(api.sonames)
    out = []
    for c in cands:
        if c not in out and not c.endswith(".a"):
            out.append(c)
    return out


def _torch_device():
    """torch's current CUDA device where torch has initialised CUDA in this process, else None
    (the runtime's calls then use the device the runtime has current)."""
    try:
        import torch
    except ImportError:
        return None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return None


IPC_HANDLE_BYTES = 64            # sizeof(cudaIpcMemHandle_t): CUDA_IPC_HANDLE_SIZE


class IpcMemHandle(ctypes.Structure):
    """cudaIpcMemHandle_t: 64 opaque bytes, passed by value to cudaIpcOpenMemHandle."""
    _fields_ = [("reserved", ctypes.c_ubyte * IPC_HANDLE_BYTES)]   # c_ubyte: NULs kept


class _Runtime:
    """A loaded vendor runtime: typed entry points and error decoding."""

    def __init__(self, api):
        self.api = api
        tried = []
        self.lib = None
        for cand in _runtime_candidates(api):
            try:
                self.lib = ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL)
                self.path = cand
                break
            except OSError as e:
                tried.append(f"{cand} ({e})")
        if self.lib is None:
            hint = ("install the CUDA runtime (or torch's nvidia-cuda-runtime wheel) or set "
                    "GPUNET_RUNTIME_LIB=/path/to/libcudart.so" if api.platform == "cuda" else
                    "install MACA and set MACA_PATH, or set GPUNET_RUNTIME_LIB=/path/to/"
                    "libmcruntime.so")
            raise ToolchainError(
                f"gpunet needs {api.library} for the {api.platform} platform but could not load it "
                f"(tried: {'; '.join(tried) or 'nothing'}). {hint}; or run on the CPU with "
                f"GPUNET_PLATFORM=cpu.")
        self._driver = None
        vp, sz, ui = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint
        pvp = ctypes.POINTER(ctypes.c_void_p)
        self._sig(api.malloc, (pvp, sz))
        if api.malloc_flags:
            self._sig(api.malloc_flags, (pvp, sz, ui))
        self._sig(api.free, (vp,))
        self._sig(api.host_alloc, (pvp, sz, ui))
        self._sig(api.host_get_device_pointer, (pvp, vp, ui))
        self._sig(api.free_host, (vp,))
        self._sig(api.host_register, (vp, sz, ui))
        self._sig(api.host_unregister, (vp,))
        self._sig(api.memcpy, (vp, vp, sz, ctypes.c_int))
        self._sig(api.set_device, (ctypes.c_int,))
        self._sig(api.ipc_get_mem_handle, (ctypes.POINTER(IpcMemHandle), vp))
        self._sig(api.ipc_open_mem_handle, (pvp, IpcMemHandle, ui))   # the handle by value
        self._sig(api.ipc_close_mem_handle, (vp,))
        fn = getattr(self.lib, api.get_error_string, None)
        if fn is not None:
            fn.argtypes, fn.restype = (ctypes.c_int,), ctypes.c_char_p

    def _sig(self, name, argtypes, lib=None):
        fn = getattr(lib or self.lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, ctypes.c_int

    def error_string(self, code):
        fn = getattr(self.lib, self.api.get_error_string, None)
        if fn is None:
            return "?"
        s = fn(code)
        return s.decode(errors="replace") if s else "?"

    def call(self, name, *args, lib=None, hint=""):
        fn = getattr(lib or self.lib, name, None)
        if fn is None:
            raise ToolchainError(f"{self.path} has no symbol {name}: the runtime is too old or not "
                                 f"the one gpunet expects (platform {self.api.platform}).")
        rc = fn(*args)
        if rc != 0:
            what = self.error_string(rc) if lib is None else "driver error"
            raise VendorRuntimeError(f"{name} failed with error {rc} ({what}).{hint}",
                                     call=name, code=rc, library=self.path)

    def driver(self):
        """The library holding the dma-buf export (libcuda for CUDA; the runtime for MACA)."""
        if self._driver is None:
            tried = []
            for soname in self.api.driver_sonames:
                if soname == "":
                    self._driver = self.lib
                    break
                try:
                    self._driver = ctypes.CDLL(soname)
                    break
                except OSError as e:
                    tried.append(f"{soname} ({e})")
            if self._driver is None:
                raise ToolchainError(f"dma-buf export needs the GPU driver library "
                                     f"({', '.join(tried)}); is the GPU driver installed?")
            self._sig(self.api.get_handle_for_range,
                      (ctypes.POINTER(ctypes.c_int), ctypes.c_uint64, ctypes.c_size_t,
                       ctypes.c_int, ctypes.c_ulonglong), lib=self._driver)
        return self._driver


# --------------------------------------------------------------------------------------------
# Allocations and the Platform object.
# --------------------------------------------------------------------------------------------

class Allocation(Resource):
    """Memory made by ``Platform.alloc``; ``close()`` frees it (a gpunet.resource.Resource:
    idempotent, a context manager). ``Platform.free(a)`` is ``a.close()``.

    ``ptr``: the address GPU code and NIC registration use (device pointer). ``host_ptr``: the
    address the CPU may dereference, or None (device / finegrained memory on a GPU). On the CPU
    platform both are the same shared mapping. ``kind``, ``nbytes`` as requested.
    """

    def __init__(self, platform, kind, nbytes, ptr, host_ptr, _keep=None):
        self.platform, self.kind, self.nbytes = platform, kind, nbytes
        self.ptr, self.host_ptr = ptr, host_ptr
        self._keep = _keep

    def view(self):
        """A numpy uint8[nbytes] view of the memory, where the CPU can address it."""
        if self.closed:
            raise ClosedError(f"{self!r} was freed")
        if self._keep is not None:      # CPU: the mapping's own array keeps the mapping alive
            return self._keep[1]
        if self.host_ptr is None:
            raise ConfigError(f"{self.kind} memory on {self.platform.name} is not CPU-addressable; "
                              f"copy it with Platform.memcpy")
        buf = (ctypes.c_uint8 * self.nbytes).from_address(self.host_ptr)
        return np.frombuffer(buf, dtype=np.uint8)

    def _release(self):
        self.platform._free(self)

    def __repr__(self):
        return (f"Allocation({self.kind}, {self.nbytes} B, ptr=0x{self.ptr:x}, "
                f"platform={self.platform.name}{', closed' if self.closed else ''})")


class IpcMapping(Resource):
    """A peer process's device allocation opened here (``Platform.ipc_open``): ``base`` is its
    first byte's device address in this process, ``nbytes`` its size, ``pid`` the exporting
    process (None: not known); ``close()`` unmaps it (cudaIpcCloseMemHandle), idempotently."""

    def __init__(self, platform, base, nbytes, pid=None):
        self.platform, self.base, self.nbytes, self.pid = platform, base, nbytes, pid

    def owner_alive(self):
        """False once the exporting process is gone (it exited or was killed): nothing may be
        stored into the mapping any more (gpunet/transports.py close_barrier), only closed. True
        while it lives or when its pid is not known."""
        return not self.closed and (self.pid is None or pid_alive(self.pid))

    def _release(self):
        rt = self.platform.runtime()
        rt.call(rt.api.ipc_close_mem_handle, ctypes.c_void_p(self.base))

    def __repr__(self):
        return (f"IpcMapping(0x{self.base:x}, {self.nbytes} B{', closed' if self.closed else ''})")


class CopyEngine(Resource):
    """What a CPU engine that moves bytes from native code (the soft NIC, gpunet/host/softnic.py
    SoftNic.attach_copy_engine) calls to reach device memory, as a NIC's DMA engine would over
    GPUDirect: ``copy_fn`` (the address of the runtime's memcpy-async entry, C signature
    ``int (void* dst, const void* src, size_t n, int kind, void* stream)``), ``sync_fn``
    (``int (void* stream)``), ``kind`` (cudaMemcpyDefault: any direction under UVA) and
    ``stream``: a NON-BLOCKING stream of its own, so that its copies never wait behind a kernel
    on the legacy default stream (a kernel spinning in wait_until for the very bytes the engine
    is copying would deadlock). ``close()`` destroys the stream."""

    def __init__(self, platform, copy_fn, sync_fn, kind, stream, set_device_fn=0, device=0,
                 destroy=None):
        self.platform, self.copy_fn, self.sync_fn = platform, copy_fn, sync_fn
        self.kind, self.stream, self._destroy = kind, stream, destroy
        self.set_device_fn, self.device = set_device_fn, device   # int (int device): the
        # engine's thread selects the stream's device before each copy (its own thread state)

    def _release(self):
        if self._destroy is not None:
            self._destroy()

    def __repr__(self):
        return "CopyEngine(%s, stream=0x%x)" % (self.platform.name, self.stream or 0)


class DmaBuf(NamedTuple):
    """A dma-buf export: ``fd`` (owned by the caller: os.close it), ``offset`` of the requested
    address inside the exported page-aligned range, and the exported ``length``. Register with
    ``ibv_reg_dmabuf_mr(pd, offset, length, iova=addr, fd, access)``."""
    fd: int
    offset: int
    length: int


def _env_choice(var, allowed, default=None):
    """The value of choice knob ``var`` (gpunet/config.py's table), or ``default`` when unset."""
    try:
        val = config.get(var)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    assert val is None or val in allowed, (var, val, allowed)
    return default if val is None else val


def _detect_maca(torch):
    """Is this torch a MACA build? *Unverified* heuristics (no C500 here): FACTS.md says MACA's
    torch exposes ``torch.cuda``; we look for a ``torch.version.maca`` attribute, the MACA
    runtime mapped into the process, or a MetaX device name. Returns the evidence or None."""
    ver = getattr(torch.version, "maca", None)
    if ver:
        return f"torch.version.maca={ver}"
    if _mapped_libraries("libmcruntime"):
        return "libmcruntime is loaded in this process"
    try:
        name = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - any failure means "no evidence"
        name = ""
    if "metax" in name.lower() or name.lower().startswith("c500"):
        return f"device name {name!r}"
    return None


def _detect():
    """(platform name, evidence) from the environment and torch."""
    forced = _env_choice("GPUNET_PLATFORM", PLATFORMS)
    if forced:
        return forced, "GPUNET_PLATFORM"
    try:
        import torch
    except ImportError:
        return "cpu", "torch is not importable"
    if getattr(torch.version, "hip", None):
        raise ConfigError(f"torch is a ROCm build (hip {torch.version.hip}); gpunet supports CUDA, "
                          f"MACA and the CPU. Set GPUNET_PLATFORM=cpu to use the soft NIC.")
    if not torch.cuda.is_available():
        return "cpu", "torch.cuda.is_available() is False"
    evidence = _detect_maca(torch)
    if evidence:
        return "maca", evidence
    return "cuda", f"torch.cuda available (CUDA {torch.version.cuda})"


class Platform:
    """The platform gpunet runs on. Get it with ``get_platform()``.

    Attributes:
        name: "cpu" | "cuda" | "maca".
        profile: the soft NIC's coherence profile, "nvidia" | "c500".
        warp_size: 32 (CUDA), 64 (MACA), on the CPU 32 unless ``GPUNET_WARP_SIZE=64``.
        detected_by: the evidence for ``name`` (for logs and bug reports).
    """

    def __init__(self, name, detected_by="", profile=None, warp_size=None):
        if name not in PLATFORMS:
            raise ConfigError(f"unknown platform {name!r}; expected one of {PLATFORMS}")
        self.name, self.detected_by = name, detected_by
        if profile is None:
            profile = _env_choice("GPUNET_PROFILE", PROFILES)
        if name == "maca":
            # The c500 profile is what the hardware needs; "nvidia" on a C500 would place NIC
            # payload in cached device memory, which the seed saw go stale.
            if profile not in (None, "c500"):
                raise ConfigError(f"profile {profile!r} is unsafe on MACA (device memory is not "
                                  f"NIC-coherent on C500); unset GPUNET_PROFILE")
            profile = "c500"
        elif profile is None:
            profile = "nvidia"   # CUDA: the hardware; CPU: the default model. c500 is allowed on
            #                      both: it is the stricter policy and only costs speed.
        if profile not in PROFILES:
            raise ConfigError(f"unknown coherence profile {profile!r}; expected one of {PROFILES}")
        self.profile = profile
        if warp_size is None:
            ws = _env_choice("GPUNET_WARP_SIZE", ("32", "64"))
            if name == "cuda":
                warp_size = 32
            elif name == "maca":
                warp_size = 64   # C500 (FACTS: code assuming 32 lanes broke)
            else:
                warp_size = int(ws) if ws else 32
            if ws and name != "cpu" and int(ws) != warp_size:
                raise ConfigError(f"GPUNET_WARP_SIZE={ws} contradicts the {name} hardware "
                                  f"({warp_size}); it only applies to the CPU platform")
        if warp_size not in (32, 64):
            raise ConfigError(f"warp_size must be 32 or 64, not {warp_size}")
        self.warp_size = warp_size
        self._rt = None
        self._lock = threading.Lock()
        self._allocs = {}           # ptr -> Allocation
        self._registered = {}       # host addr -> (nbytes, device ptr)

    def __repr__(self):
        return (f"Platform(name={self.name!r}, profile={self.profile!r}, "
                f"warp_size={self.warp_size}, detected_by={self.detected_by!r})")

    @property
    def is_gpu(self):
        return self.name != "cpu"

    def policy(self, role):
        """``Placement(kind, reason)`` for ``role`` under this platform's profile."""
        return policy(role, self.profile)

    # -- the vendor runtime ------------------------------------------------------------------

    def runtime(self):
        """The loaded vendor runtime (lazily). Raises ToolchainError naming the missing library."""
        if self.name == "cpu":
            raise ConfigError("the CPU platform has no vendor runtime")
        with self._lock:
            if self._rt is None:
                self._rt = _Runtime(_APIS[self.name])
        return self._rt

    def _set_device(self, rt, device):
        if device is None:
            device = _torch_device()
        if device is not None:
            rt.call(rt.api.set_device, int(device))

    # -- memory kinds -------------------------------------------------------------------------

    def alloc(self, kind, nbytes, device=None):
        """Allocate ``nbytes`` of memory of ``kind`` ("device" | "finegrained" | "host").

        On a GPU ``device`` selects the GPU (default: torch's current device if torch has
        initialised CUDA, else the runtime's current one). Returns an ``Allocation``.

        - device: cudaMalloc / mcMalloc.
        - finegrained: MACA mcExtMallocWithFlags(..., 0x1) (uncached, NIC-coherent; *unverified*);
          CUDA cudaMalloc, because H100/H200 device memory is already coherent with the NIC (the
          L2 sits on the memory side), so there is nothing finer to ask for.
        - host: cudaHostAlloc(Mapped | Portable) + cudaHostGetDevicePointer (MACA: mcHostAlloc,
          same flag values assumed, *unverified*). ``host_ptr`` is CPU-addressable, ``ptr`` is
          the GPU's address for it.

        CPU platform: every kind is the same thing, an anonymous shared mapping (MAP_SHARED |
        MAP_ANONYMOUS, zeroed, page-aligned, inherited across fork but not nameable by another
        process); ``ptr == host_ptr``. The kind is only recorded: the soft NIC models coherence
        from the kind it is told at ``reg_mr``, and owns its own cross-process arena, so the CPU
        path mostly just reports kinds.
        """
        if kind not in KINDS:
            raise ConfigError(f"unknown memory kind {kind!r}; expected one of {KINDS}")
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ConfigError(f"nbytes must be positive, not {nbytes}")
        if self.name == "cpu":
            mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
            arr = np.frombuffer(mm, dtype=np.uint8)
            addr = arr.ctypes.data
            a = Allocation(self, kind, nbytes, addr, addr, _keep=(mm, arr))
        else:
            rt = self.runtime()
            api = rt.api
            self._set_device(rt, device)
            p = ctypes.c_void_p()
            if kind == "device" or (kind == "finegrained" and not api.malloc_flags):
                rt.call(api.malloc, ctypes.byref(p), nbytes)
                a = Allocation(self, kind, nbytes, p.value, None)
            elif kind == "finegrained":
                rt.call(api.malloc_flags, ctypes.byref(p), nbytes, api.finegrained_flag)
                a = Allocation(self, kind, nbytes, p.value, None)
            else:
                rt.call(api.host_alloc, ctypes.byref(p), nbytes, api.host_alloc_mapped)
                d = ctypes.c_void_p()
                try:
                    rt.call(api.host_get_device_pointer, ctypes.byref(d), p, 0)
                except VendorRuntimeError:
                    rt.call(api.free_host, p)
                    raise
                ctypes.memset(p.value, 0, nbytes)
                a = Allocation(self, kind, nbytes, d.value, p.value)
        with self._lock:
            self._allocs[a.ptr] = a
        return a

    def free(self, alloc):
        """Free an ``Allocation`` (or its ``ptr``) made by ``alloc``: ``alloc.close()``.
        Idempotent on Allocations; a ``ptr`` this Platform does not hold raises ConfigError."""
        if not isinstance(alloc, Allocation):
            ptr = int(alloc)
            with self._lock:
                alloc = self._allocs.get(ptr)
            if alloc is None:
                raise ConfigError(f"0x{ptr:x} was not allocated by this Platform (or is already "
                                  f"freed)")
        alloc.close()

    def _free(self, a):
        """Allocation._release: give ``a``'s memory back to the runtime (or unmap it)."""
        with self._lock:
            if self._allocs.pop(a.ptr, None) is None:
                raise ConfigError(f"{a!r} was not allocated by this Platform")
        if self.name == "cpu":
            mm, arr = a._keep
            a._keep = None
            del arr
            try:
                mm.close()
            except BufferError:
                # a numpy view of it is still alive somewhere; the mapping goes with the last one
                pass
            return
        rt = self.runtime()
        if a.kind == "host":
            rt.call(rt.api.free_host, ctypes.c_void_p(a.host_ptr))
        else:
            rt.call(rt.api.free, ctypes.c_void_p(a.ptr))

    def memcpy(self, dst, src, nbytes):
        """Copy ``nbytes`` between any two addresses this platform knows (UVA: cudaMemcpyDefault;
        MACA mcMemcpy with the same value, *unverified*; CPU memmove). Synchronous."""
        if self.name == "cpu":
            ctypes.memmove(int(dst), int(src), int(nbytes))
            return
        rt = self.runtime()
        rt.call(rt.api.memcpy, ctypes.c_void_p(int(dst)), ctypes.c_void_p(int(src)),
                int(nbytes), rt.api.memcpy_default)

    def copy_engine(self, device=None):
        """A :class:`CopyEngine` on ``device`` (default: torch's current one): the runtime's
        memcpy-async and stream-synchronize entry points and a non-blocking stream, for the soft
        NIC's engine thread to copy between host and device memory (CUDA cudaMemcpyAsync +
        cudaStreamSynchronize; MACA mc*, *unverified*). CPU platform: a stand-in whose copy is
        a native memmove and whose sync does nothing (rawmem.memmove_copy_engine), for a heap the
        soft NIC is told is device memory (GPUNET_HEAP_MEMORY=device): every byte its engine
        moves to or from that heap then goes through this hook, as on a GPU."""
        if self.name == "cpu":
            from gpunet.host.rawmem import memmove_copy_engine
            copy_fn, sync_fn = memmove_copy_engine()
            return CopyEngine(self, copy_fn, sync_fn, 0, 0)
        rt = self.runtime()
        api = rt.api
        if device is None:
            device = _torch_device()
        device = 0 if device is None else int(device)
        self._set_device(rt, device)
        vp = ctypes.c_void_p
        rt._sig(api.memcpy_async, (vp, vp, ctypes.c_size_t, ctypes.c_int, vp))
        rt._sig(api.stream_create_flags, (ctypes.POINTER(vp), ctypes.c_uint))
        rt._sig(api.stream_synchronize, (vp,))
        rt._sig(api.stream_destroy, (vp,))
        st = vp()
        rt.call(api.stream_create_flags, ctypes.byref(st), api.stream_non_blocking)

        def fn_addr(name):
            fn = getattr(rt.lib, name, None)
            if fn is None:
                raise ToolchainError(f"{rt.path} has no symbol {name} (platform {self.name})")
            return ctypes.cast(fn, vp).value

        return CopyEngine(self, fn_addr(api.memcpy_async), fn_addr(api.stream_synchronize),
                          api.memcpy_default, st.value or 0,
                          set_device_fn=fn_addr(api.set_device), device=device,
                          destroy=lambda: rt.call(api.stream_destroy, st))

    def host_register(self, addr, nbytes, io_memory=False, device=None):
        """Map existing host memory (or, with ``io_memory=True``, a device BAR such as an mlx5
        UAR page) into the GPU; returns the device pointer for it.

        cudaHostRegister(Mapped | Portable [| IoMemory]) then cudaHostGetDevicePointer (MACA:
        mcHostRegister, flag values assumed equal, *unverified*). Raises ``VendorRuntimeError``
        with ``.code``: ``ERR_NOT_PERMITTED`` (800) means the driver refuses to map it; callers
        then fall back to the proxy transport. On the CPU platform the memory is already shared
        with the HOST arm: returns ``addr`` unchanged.
        """
        addr, nbytes = int(addr), int(nbytes)
        if nbytes <= 0:
            raise ConfigError(f"nbytes must be positive, not {nbytes}")
        if self.name == "cpu":
            with self._lock:
                self._registered[addr] = (nbytes, addr)
            return addr
        rt = self.runtime()
        api = rt.api
        self._set_device(rt, device)
        flags = api.register_mapped | (api.register_io_memory if io_memory else 0)
        hint = ""
        what = "an I/O (BAR) range" if io_memory else "host memory"
        try:
            rt.call(api.host_register, ctypes.c_void_p(addr), nbytes, flags)
        except VendorRuntimeError as e:
            if e.code == ERR_NOT_PERMITTED:
                hint = (" The driver does not allow mapping this range into the GPU (for a NIC "
                        "doorbell: GPU-initiated doorbells are not permitted here); use the proxy "
                        "transport.")
            raise VendorRuntimeError(f"{api.host_register}(0x{addr:x}, {nbytes}, flags=0x{flags:x}) "
                                     f"for {what} failed with error {e.code} "
                                     f"({rt.error_string(e.code)}).{hint}",
                                     call=e.call, code=e.code, library=e.library) from None
        d = ctypes.c_void_p()
        try:
            rt.call(api.host_get_device_pointer, ctypes.byref(d), ctypes.c_void_p(addr), 0)
        except VendorRuntimeError:
            rt.call(api.host_unregister, ctypes.c_void_p(addr))
            raise
        with self._lock:
            self._registered[addr] = (nbytes, d.value)
        return d.value

    def host_unregister(self, addr):
        """Undo ``host_register(addr, ...)``."""
        addr = int(addr)
        with self._lock:
            ent = self._registered.pop(addr, None)
        if ent is None:
            raise ConfigError(f"0x{addr:x} is not registered with this Platform")
        if self.name != "cpu":
            rt = self.runtime()
            rt.call(rt.api.host_unregister, ctypes.c_void_p(addr))

    def dmabuf_fd(self, addr, nbytes):
        """Export GPU memory ``[addr, addr+nbytes)`` as a dma-buf for ``ibv_reg_dmabuf_mr``.

        The driver wants a range aligned to the host page size, so the exported range is
        ``[align_down(addr), align_up(addr+nbytes))`` and ``DmaBuf.offset`` says where ``addr``
        sits in it. CUDA: cuMemGetHandleForAddressRange(..., DMA_BUF_FD, 0) from libcuda (needs
        a current context: call after the runtime has been used on this thread, e.g. after
        ``alloc``). MACA: mcMemGetHandleForAddressRange(&fd, ptr, size,
        mcMemHandleTypePosixFileDescriptor, 0) (FACTS.md; library and enum value *unverified*).
        The caller owns ``fd`` and closes it. Not available on the CPU platform.
        """
        if self.name == "cpu":
            raise ConfigError("dma-buf export needs a GPU; on the CPU platform the soft NIC "
                              "registers its arena memory directly (nic.reg_mr)")
        addr, nbytes = int(addr), int(nbytes)
        page = mmap.PAGESIZE
        base = addr & ~(page - 1)
        end = (addr + nbytes + page - 1) & ~(page - 1)
        rt = self.runtime()
        drv = rt.driver()
        fd = ctypes.c_int(-1)
        rt.call(rt.api.get_handle_for_range, ctypes.byref(fd), ctypes.c_uint64(base), end - base,
                rt.api.handle_type_dmabuf_fd, 0, lib=drv,
                hint=" dma-buf export needs Linux >= 5.12, an open-source-kernel-module driver "
                     "(CUDA) and device memory; fall back to nvidia-peermem/ibv_reg_mr or the "
                     "proxy.")
        return DmaBuf(fd.value, addr - base, end - base)


    # -- IPC: a device allocation shared with another process on this node ------------------

    def ipc_export(self, ptr):
        """The IPC handle (``IPC_HANDLE_BYTES`` bytes) of the device allocation that starts at
        ``ptr`` (memory from ``alloc("device")``: the handle names the whole allocation), for a
        process on this node to pass to :meth:`ipc_open`. CUDA cudaIpcGetMemHandle (MACA
        mcIpcGetMemHandle, *unverified*). ConfigError on the CPU platform."""
        if self.name == "cpu":
            raise ConfigError("IPC handles need a GPU; on the CPU platform a peer maps the soft "
                              "NIC's arena by name (Nic.export_heap)")
        rt = self.runtime()
        h = IpcMemHandle()
        rt.call(rt.api.ipc_get_mem_handle, ctypes.byref(h), ctypes.c_void_p(int(ptr)),
                hint=" The address must be the start of a device allocation (cudaMalloc).")
        return bytes(h.reserved)

    def ipc_open(self, handle, nbytes, device=None, pid=None):
        """Open a peer process's ``ipc_export`` handle here (lazily enabling peer access where
        the allocation is on another GPU): an :class:`IpcMapping` of ``nbytes`` (``pid``: the
        exporting process, for IpcMapping.owner_alive). Opening a
        handle of this same process fails (the driver refuses it): use the pointer itself.
        CUDA cudaIpcOpenMemHandle (MACA mcIpcOpenMemHandle, *unverified*)."""
        if self.name == "cpu":
            raise ConfigError("IPC handles need a GPU; on the CPU platform a peer maps the soft "
                              "NIC's arena by name (Nic.map_peer_heap)")
        if not isinstance(handle, (bytes, bytearray)) or len(handle) != IPC_HANDLE_BYTES:
            raise ConfigError("ipc_open: an IPC handle is %d bytes (from Platform.ipc_export), "
                              "not %r" % (IPC_HANDLE_BYTES, type(handle).__name__ if not
                                          isinstance(handle, (bytes, bytearray)) else
                                          "%d bytes" % len(handle)))
        rt = self.runtime()
        self._set_device(rt, device)
        h = IpcMemHandle.from_buffer_copy(bytes(handle))
        p = ctypes.c_void_p()
        rt.call(rt.api.ipc_open_mem_handle, ctypes.byref(p), h, rt.api.ipc_lazy_enable_peer_access,
                hint=" The exporting process must be alive, on this node, and (several processes "
                     "on one GPU) running under one MPS daemon or the driver's IPC rules.")
        return IpcMapping(self, p.value, int(nbytes), pid)


_platform = None
_platform_lock = threading.Lock()


def get_platform():
    """The process's ``Platform`` (detected once and cached; see ``reset_platform()``).

    Environment: ``GPUNET_PLATFORM=cpu|cuda|maca`` skips detection (tests, or forcing the CPU on
    a GPU machine); ``GPUNET_PROFILE=nvidia|c500`` picks the CPU (or CUDA) coherence model;
    ``GPUNET_WARP_SIZE=32|64`` the HOST arm's warp size; ``GPUNET_RUNTIME_LIB`` the runtime path.
    """
    global _platform
    with _platform_lock:
        if _platform is None:
            name, evidence = _detect()
            _platform = Platform(name, detected_by=evidence)
            log.info("gpunet platform: %s (profile %s, warp %d) because %s", _platform.name,
                     _platform.profile, _platform.warp_size, evidence)
        return _platform


def reset_platform():
    """Forget the cached platform (tests that change the environment call this)."""
    global _platform
    with _platform_lock:
        _platform = None
