"""Does the soft NIC's copy engine stall behind the caller's own CUDA calls? (CUDA only.)

The soft NIC on CUDA moves the bytes of a device-memory heap with the CUDA runtime
(gpunet/host/platform.py Platform.copy_engine: cudaMemcpyAsync on a non-blocking stream of its own, then
cudaStreamSynchronize, from the NIC's engine thread). A kernel that waits for NIC-set data while
the caller's thread blocks in a CUDA call queued behind that kernel deadlocks until the kernel's
bound if the engine's copy has to wait for the caller's call. This measures exactly that, with no
gpunet kernel: a ~2 s kernel (torch.cuda._sleep) on the current stream; 0.3 s into it a second
thread makes one 8-byte device-to-host copy through the copy engine and times it, while the main
thread does nothing, a pageable ``.cpu()`` of a device tensor (queued behind the kernel), or
``torch.cuda.synchronize()``, or gpunet's ``to_host`` (a stream synchronize, then the copy: what
the library's own host reads use); destination pageable or pinned host memory. A copy that takes about
as long as the rest of the kernel stalled.

  python3 bench/copy_engine_stall.py [--json FILE]      (prints a table; JSON has every row)
"""
import argparse
import ctypes
import json
import threading
import time

import numpy as np
import torch

from gpunet._launch import to_host
from gpunet.host.platform import get_platform

KERNEL_S = 2.0
START_AFTER_S = 0.3
BLOCKERS = ("nothing", ".cpu() of a device tensor", "torch.cuda.synchronize()",
            "gpunet to_host() of it")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("copy_engine_stall: needs a CUDA GPU (torch.cuda.is_available() is False)")
    plat = get_platform()
    eng = plat.copy_engine()
    vp = ctypes.c_void_p
    copy = ctypes.CFUNCTYPE(ctypes.c_int, vp, vp, ctypes.c_size_t, ctypes.c_int, vp)(eng.copy_fn)
    sync = ctypes.CFUNCTYPE(ctypes.c_int, vp)(eng.sync_fn)
    dev = torch.ones(16, dtype=torch.int64, device="cuda")
    dsts = {"pageable": np.zeros(8, dtype=np.int64), "pinned": torch.zeros(8, dtype=torch.int64).pin_memory()}
    addr = {"pageable": dsts["pageable"].ctypes.data, "pinned": dsts["pinned"].data_ptr()}
    # cycles for ~KERNEL_S (torch.cuda._sleep spins on the SM clock, ~1.9 GHz on the H200; each
    # row reports the kernel's measured length)
    cycles = int(KERNEL_S * 1.9e9)
    torch.cuda.synchronize()
    rows = []

    def timed_copy(dst, out):
        time.sleep(START_AFTER_S)
        t0 = time.perf_counter()
        rc = copy(dst, dev.data_ptr(), 8, eng.kind, eng.stream)
        rc2 = sync(eng.stream)
        out.update(copy_s=time.perf_counter() - t0, rc=rc, rc_sync=rc2)

    for kind in ("pageable", "pinned"):
        for blocker in BLOCKERS:
            res = {}
            t0 = time.perf_counter()
            torch.cuda._sleep(cycles)
            th = threading.Thread(target=timed_copy, args=(addr[kind], res))
            th.start()
            if blocker.startswith(".cpu"):
                dev.cpu()
            elif blocker.startswith("torch.cuda.synchronize"):
                torch.cuda.synchronize()
            elif blocker.startswith("gpunet to_host"):
                to_host(dev)
            th.join()
            torch.cuda.synchronize()
            kernel_s = time.perf_counter() - t0
            stalled = res["copy_s"] > 0.5 * (kernel_s - START_AFTER_S)
            rows.append(dict(destination=kind, main_thread=blocker, kernel_s=kernel_s, stalled=stalled, **res))
    eng.close()                      # its non-blocking stream
    print("copy engine (an 8-byte D2H cudaMemcpyAsync + sync on its own non-blocking stream, from a "
          "second thread, %.1f s into a %.1f s kernel), GPU %s, %s"
          % (START_AFTER_S, KERNEL_S, torch.cuda.get_device_name(), time.strftime("%Y-%m-%d")))
    print("%-10s %-28s %10s %10s %8s %s" % ("dest", "main thread meanwhile", "copy s", "kernel s", "rc", "stalled"))
    print("-" * 80)
    for r in rows:
        print("%-10s %-28s %10.4f %10.2f %8s %s" % (r["destination"], r["main_thread"], r["copy_s"],
                                                 r["kernel_s"], "%d/%d" % (r["rc"], r["rc_sync"]),
                                                 "STALLED" if r["stalled"] else "no"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                       "rows": rows}, f, indent=1)
        print("JSON:", args.json)


if __name__ == "__main__":
    main()
