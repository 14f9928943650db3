"""Probe gpunet.host.platform on a real GPU: each memory kind, host registration, dma-buf export.

Run on a GPU machine (the CPU platform has nothing to probe):

    python bench/platform_probe.py [--json platform_probe.json]

Prints one row per check (ok / error code / skipped, and time), writes the same as JSON with the
machine's description. Checks:
  alloc-<kind>     alloc 1 MiB of each kind, copy a pattern in and out through the runtime;
  kernel-<kind>    a torch kernel fills the memory through its device pointer (via
                   __cuda_array_interface__), read back by copy (and by the CPU for host memory);
  host_register    cudaHostRegister(Mapped) of an mmap'd buffer, then a kernel writes through the
                   device pointer and the CPU reads it;
  host_register_io cudaHostRegister(Mapped|IoMemory) of ordinary RAM: expected to fail; the code
                   is recorded (a UAR page is what it is for);
  dmabuf           cuMemGetHandleForAddressRange on device memory.
"""
import argparse
import json
import mmap
import os
import platform as pyplatform
import sys
import time

import numpy as np

from gpunet.host import platform as P

N = 1 << 20


class _CAI:
    """A raw device pointer as a __cuda_array_interface__ object, so torch can wrap it."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3}


def _kernel_fill(ptr, n, value):
    import torch
    t = torch.as_tensor(_CAI(ptr, n), device="cuda")
    t.fill_(value)
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="platform_probe.json")
    args = ap.parse_args()

    p = P.get_platform()
    rows = []

    def check(name, fn):
        t0 = time.perf_counter()
        try:
            detail = fn() or ""
            status = "ok"
        except P.VendorRuntimeError as e:
            status, detail = f"error {e.code}", str(e)
        except Exception as e:  # noqa: BLE001 - a probe reports everything
            status, detail = f"{type(e).__name__}", str(e)
        rows.append({"check": name, "status": status, "ms": round((time.perf_counter() - t0) * 1e3, 3),
                     "detail": detail})

    machine = {"python": sys.version.split()[0], "host": pyplatform.node(), "platform": repr(p)}
    if p.name == "cpu":
        print(f"{p!r}: nothing to probe on the CPU platform (run on a GPU machine)")
        return 0
    import torch
    machine.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   cuda=torch.version.cuda, runtime=p.runtime().path)

    for kind in P.KINDS:
        def alloc_roundtrip(kind=kind):
            src = (np.arange(N) % 253).astype(np.uint8)
            dst = np.zeros(N, np.uint8)
            with p.alloc(kind, N) as a:
                p.memcpy(a.ptr, src.ctypes.data, N)
                p.memcpy(dst.ctypes.data, a.ptr, N)
                assert (dst == src).all(), "copied bytes differ"
                return f"ptr=0x{a.ptr:x} host_ptr={a.host_ptr and hex(a.host_ptr)}"

        def kernel_write(kind=kind):
            dst = np.zeros(N, np.uint8)
            with p.alloc(kind, N) as a:
                _kernel_fill(a.ptr, N, 0x3C)
                p.memcpy(dst.ctypes.data, a.ptr, N)
                assert (dst == 0x3C).all(), "kernel writes not seen by copy"
                if a.host_ptr is not None:
                    assert (a.view() == 0x3C).all(), "kernel writes not seen by the CPU"
            return ""
        check(f"alloc-{kind}", alloc_roundtrip)
        check(f"kernel-{kind}", kernel_write)

    def register(io_memory):
        buf = mmap.mmap(-1, N)
        arr = np.frombuffer(buf, np.uint8)
        dptr = p.host_register(arr.ctypes.data, N, io_memory=io_memory)
        try:
            _kernel_fill(dptr, N, 0x77)
            assert (arr == 0x77).all(), "kernel writes through the registered pointer not seen"
            return f"dptr=0x{dptr:x} host=0x{arr.ctypes.data:x}"
        finally:
            p.host_unregister(arr.ctypes.data)
    check("host_register", lambda: register(False))
    check("host_register_io", lambda: register(True))

    def dmabuf():
        with p.alloc("device", 2 * N) as a:
            d = p.dmabuf_fd(a.ptr + 100, N)
            os.close(d.fd)
            return f"fd ok, offset={d.offset}, length={d.length}"
    check("dmabuf", dmabuf)

    print(f"# {machine}")
    print(f"{'check':<18} {'status':<12} {'ms':>9}  detail")
    for r in rows:
        print(f"{r['check']:<18} {r['status']:<12} {r['ms']:>9.3f}  {r['detail'][:100]}")
    with open(args.json, "w") as f:
        json.dump({"machine": machine, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")
    return 0 if all(r["status"] == "ok" or r["check"] == "host_register_io" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
