"""``python -m gpunet doctor``: can gpunet work on this machine, and if not, why not — in one run.

It prints a table (section, check, result, detail) and writes the same as JSON (``--json``):

- platform / gpu / toolchain: what gpunet/host/platform.py detects, the GPUs torch sees, the compilers
  gpunet/device/loader.py would use (g++ for the HOST arm, nvcc, MACA's mxcc).
- nic: the RDMA devices the kernel lists (/sys/class/infiniband: ports, link layers, GIDs), what
  ``open_nic("verbs")`` says, the NIC the checks use, DevX / UMEM / atomic endianness as that NIC
  reports them (``getattr``: a NIC that does not report one says so), the doorbell's mapping into
  the device (``Nic.map_doorbell``), dma-buf export and registration of GPU memory.
- transport: what ``transport="auto"`` gives a peer on this node and on another node
  (gpunet/transports.py: p2p on this node on CUDA, else ``choose_transport``'s NIC choice).
- loopback: a one-rank Context per NIC transport (ibgda, proxy): a device-posted RDMA write (put),
  read (get) and fetch-add (atomic_add) to itself, each checked byte for byte; every device wait
  is bounded by ``--timeout``.
- coherence: measured, per memory kind (device / finegrained / host) and direction, with and
  without the fences the coherence policy uses, through gpunet/device/kernels/doctor.cu (its top comment
  is the protocol): the NIC RDMA-WRITEs a pattern and a kernel that read the buffer earlier
  re-reads it within PROBE_VISIBLE_S; a kernel stores a pattern and the NIC RDMA-READs it back
  within the same bound. No eviction, no remote SM load, every wait bounded, each probe on fresh
  buffers deregistered after. On the CPU the soft NIC's coherence model answers: the ``c500``
  profile's ``device`` memory reads stale in both directions (its HBM image syncs only at
  ``SoftNic.evict``), everything else fresh (tests/test_doctor.py).
- policy: every NIC-touched role of gpunet/host/platform.py's COHERENCE_POLICY checked against the
  measurement of the kind it is placed in.

Results: ``ok`` / ``FAIL`` (a check that must pass), ``yes`` / ``no`` (a capability),
``coherent`` / ``INCOHERENT`` (a measurement), ``skip`` (not measurable here, the detail says
why), ``info``. Exit status: 0 when no row is FAIL (the stack can work here), 1 when one is (the
table says which and why), 2 for bad arguments.

What has run where: the CPU platform with the soft NIC (CI). The CUDA branches (GPU rows, dma-buf
export, probes of ``host`` memory through the NIC's GPU mapping, loopback on a GPU) are written for
the H200 gate (scripts/gpu-check.sh step ``doctor``); the real-NIC branches (a NIC in sysfs, GPU
memory registered with a DevX NIC) have never run: no machine here has an RDMA device.
"""
import argparse
import contextlib
import ctypes
import itertools
import json
import os
import socket
import sys
import threading
import time

import numpy as np

from gpunet import config
from gpunet.errors import GpunetError
from gpunet.host.platform import KINDS      # the memory kinds probed: device, finegrained, host

SCHEMA = "gpunet-doctor/1"
SECTIONS = ("platform", "gpu", "toolchain", "nic", "transport", "loopback", "coherence", "policy")
RESULTS = ("ok", "FAIL", "yes", "no", "coherent", "INCOHERENT", "skip", "info")
DIRECTIONS = ("nic_write_sm_read", "sm_write_nic_read")

# A probe's visibility bound: a pattern not seen within it counts as not visible. Far above what
# a coherent path needs (the write has completed, or the store been released, before the other
# side looks: one cache miss, or one NIC read round trip) and small enough that the two
# INCOHERENT rows a C500 is expected to show cost little.
PROBE_VISIBLE_S = 0.02
PROBE_WORDS = 512                 # 4 KiB: 32 lines of 128 B (the c500 model's L2 line)
PROBE_OLD = 0x0DD0_0DD0_0DD0_0DD0
PROBE_PATTERN = 0x5A5A_0000_0000_0000   # + the probe's number: no probe sees another's bytes
LOOPBACK_BYTES = 4096
LOOPBACK_HEAP = 1 << 20

# ProbeCtl (gpunet/device/kernels/doctor.cu) word indices; the kernel's size is checked at load.
CTL_READY, CTL_GO, CTL_DONE, CTL_MATCHED, CTL_FIRST_BAD, CTL_WAITED_NS, CTL_CODE, CTL_WARM_OLD, \
    CTL_PASSES = range(9)
CTL_BYTES = 128
MODE_SM_TO_NIC, MODE_FENCE = 1, 2

# Which directions each role's memory must be coherent in (the roles the NIC touches; the UAR is
# MMIO, not allocated; status, compute and the proxy FIFO are never touched by the NIC).
ROLE_DIRECTIONS = {
    "sq": ("sm_write_nic_read",), "dbrec": ("sm_write_nic_read",),
    "cq": ("nic_write_sm_read",), "signal": DIRECTIONS,
    "payload_src": ("sm_write_nic_read",), "payload_dst": ("nic_write_sm_read",),
}

class Report:
    """The rows of one doctor run; ``add`` prints a progress line to ``log``."""

    def __init__(self, log=None):
        self.rows, self.coherence, self.log = [], [], log

    def add(self, section, check, result, detail="", **data):
        assert section in SECTIONS and result in RESULTS, (section, result)
        row = {"section": section, "check": check, "result": result, "detail": str(detail)}
        if data:
            row["data"] = data
        self.rows.append(row)
        if self.log is not None:
            print("[gpunet doctor] %-10s %-40s %s" % (section, check, result), file=self.log,
                  flush=True)
        return row

    def failed(self):
        return [r for r in self.rows if r["result"] == "FAIL"]

    def table(self):
        heads = ("section", "check", "result", "detail")
        w = [max([len(h)] + [len(r[h]) for r in self.rows]) for h in heads[:3]]
        out = ["  ".join(h.ljust(x) for h, x in zip(heads[:3], w)) + "  detail",
               "  ".join("-" * x for x in w) + "  " + "-" * 6]
        for r in self.rows:
            out.append("  ".join(r[h].ljust(x) for h, x in zip(heads[:3], w)) + "  " + r["detail"])
        return "\n".join(out)


def _err(e):
    return "%s: %s" % (type(e).__name__, e)


@contextlib.contextmanager
def _forced(platform, profile):
    """``--platform`` / ``--profile`` for this run: they are the GPUNET_PLATFORM / GPUNET_PROFILE
    knobs (gpunet/host/platform.py reads them when it detects), set while the doctor runs and restored
    after, with the cached platform forgotten on both edges."""
    from gpunet.host.platform import reset_platform

    try:
        with config.environ({"GPUNET_PLATFORM": platform, "GPUNET_PROFILE": profile}):
            reset_platform()
            yield
    finally:
        reset_platform()


# --- platform, GPUs, toolchains -------------------------------------------------------------------

def _platform_rows(rep):
    from gpunet.host.platform import get_platform

    try:
        plat = get_platform()
    except GpunetError as e:
        rep.add("platform", "platform", "FAIL", _err(e))
        return None
    rep.add("platform", "platform", "info", "%s (profile %s, warp %d), because %s"
            % (plat.name, plat.profile, plat.warp_size, plat.detected_by),
            name=plat.name, profile=plat.profile, warp_size=plat.warp_size)
    return plat


def _gpu_rows(rep, plat):
    try:
        import torch
    except ImportError as e:
        rep.add("gpu", "torch", "FAIL", _err(e))
        return
    rep.add("gpu", "torch", "info", "torch %s (CUDA %s)" % (torch.__version__, torch.version.cuda))
    if not plat.is_gpu:
        seen = torch.cuda.is_available()
        rep.add("gpu", "GPUs", "info", "none used: the CPU platform (the HOST arm runs device code "
                "on CPU threads)%s" % ("; torch sees %d GPU(s), GPUNET_PLATFORM=cpu set"
                                      % torch.cuda.device_count() if seen else ""), count=0)
        return
    try:
        n = torch.cuda.device_count()
        names = []
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            names.append("%d: %s, %.0f GiB, sm %d.%d" % (i, p.name, p.total_memory / 2**30,
                                                        p.major, p.minor))
        rep.add("gpu", "GPUs", "ok" if n else "FAIL", "; ".join(names) or "torch sees no GPU",
                count=n)
    except Exception as e:  # noqa: BLE001 - a driver problem is the finding
        rep.add("gpu", "GPUs", "FAIL", _err(e))


def _toolchain_rows(rep, plat):
    from gpunet.device import loader
    from gpunet.errors import ToolchainError

    need = {"cpu": "host", "cuda": "cuda", "maca": "maca"}[plat.name]
    for arm, what in (("host", "g++ (HOST arm)"), ("cuda", "nvcc (CUDA arm)"),
                      ("maca", "mxcc (MACA arm)")):
        try:
            path = loader._find_compiler(arm)
            lines = [ln for ln in loader._compiler_version(path).splitlines() if ln.strip()]
            first = next((ln for ln in lines if "release" in ln), lines[0] if lines else "")
            rep.add("toolchain", what, "yes", "%s: %s" % (path, first.strip()), path=path)
        except ToolchainError as e:
            rep.add("toolchain", what, "FAIL" if arm == need else "no",
                    ("the %s platform needs it: %s" % (plat.name, e)) if arm == need else str(e))


# --- NICs ---------------------------------------------------------------------------------------

SYSFS_IB = "/sys/class/infiniband"


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def sysfs_nics(root=None):
    """The RDMA devices the kernel lists under ``root`` (default SYSFS_IB): [{name, ports:
    [{port, state, link_layer, rate, gids: [(index, gid, type)]}]}] (non-zero GIDs only). []
    when there is none."""
    root = SYSFS_IB if root is None else root
    out = []
    try:
        devs = sorted(os.listdir(root))
    except OSError:
        return out
    for d in devs:
        ports = []
        pdir = os.path.join(root, d, "ports")
        for p in sorted(os.listdir(pdir), key=lambda s: int(s) if s.isdigit() else 0) \
                if os.path.isdir(pdir) else []:
            base = os.path.join(pdir, p)
            gids = []
            gdir = os.path.join(base, "gids")
            for g in sorted(os.listdir(gdir), key=lambda s: int(s) if s.isdigit() else 0) \
                    if os.path.isdir(gdir) else []:
                gid = _read(os.path.join(gdir, g))
                if gid and gid.replace(":", "").strip("0"):
                    gids.append((int(g), gid, _read(os.path.join(base, "gid_attrs", "types", g))))
            ports.append({"port": int(p) if p.isdigit() else p,
                          "state": _read(os.path.join(base, "state")),
                          "link_layer": _read(os.path.join(base, "link_layer")),
                          "rate": _read(os.path.join(base, "rate")), "gids": gids})
        out.append({"name": d, "ports": ports})
    return out


def _nic_rows(rep, plat, nic_kind):
    """NIC detection rows; opens the NIC the checks use. Returns (nic or None, "soft" | "verbs")."""
    from gpunet.host.nic import open_nic

    devs = sysfs_nics()
    if not devs:
        rep.add("nic", "RDMA devices (sysfs)", "no", "no NIC (soft NIC used): %s lists none"
                % SYSFS_IB, devices=[])
    for d in devs:
        rep.add("nic", "RDMA device %s" % d["name"], "yes", "%d port(s)" % len(d["ports"]),
                device=d)
        for p in d["ports"]:
            g = ", ".join("%d %s %s" % gi for gi in p["gids"][:4]) or "no GID"
            rep.add("nic", "%s port %s" % (d["name"], p["port"]),
                    "ok" if (p["state"] or "").endswith("ACTIVE") else "no",
                    "%s, %s, %s; GIDs: %s" % (p["state"], p["link_layer"], p["rate"], g))
    # the real-NIC path, as open_nic("verbs") sees it (pyverbs present? a device? drivable?)
    real = verbs_error = None
    try:
        real = open_nic("verbs", profile=plat.profile)
        rep.add("nic", "open_nic('verbs')", "yes", repr(real))
    except Exception as e:  # noqa: BLE001 - why the real NIC does not open is the finding
        verbs_error = e
        rep.add("nic", "open_nic('verbs')", "FAIL" if nic_kind == "verbs" else "no", _err(e))
    if real is not None and nic_kind in ("auto", "verbs"):
        nic, used = real, "verbs"
    else:
        if real is not None:
            real.close()
        if nic_kind == "verbs":
            return None, "verbs"
        try:
            nic, used = open_nic("soft", profile=plat.profile, name="doctor"), "soft"
        except Exception as e:  # noqa: BLE001
            rep.add("nic", "NIC used by the checks", "FAIL", _err(e))
            return None, "soft"
    rep.add("nic", "NIC used by the checks", "ok", "%s nic (asked: %s): %r" % (used, nic_kind, nic),
            kind=used)
    _nic_capability_rows(rep, nic, used, devs, verbs_error)
    return nic, used


def _nic_capability_rows(rep, nic, used, devs, verbs_error):
    """DevX, port, ring (UMEM) placement and atomic endianness, as the NIC reports them. Read
    with getattr: gpunet/host/nic.py's Nic does not require these attributes (gpunet/host/devx.py's DevxNic has
    them), and a NIC without one gets a row saying so."""
    no_nic = "no NIC (soft NIC used)"
    if getattr(nic, "devx", False):
        rep.add("nic", "DevX available", "yes", "DevX context open, HCA capabilities queried "
                "(UAR: %s)" % getattr(nic, "uar_type", "?"))
    elif devs:
        rep.add("nic", "DevX available", "no", "the RDMA device is there but the DevX NIC did "
                "not open: %s" % (_err(verbs_error) if verbs_error else "not asked"))
    else:
        rep.add("nic", "DevX available", "skip", no_nic)
    if used == "verbs":
        port = {a: getattr(nic, a, None) for a in ("device", "port", "link_layer", "lid",
                                                    "gid_index", "active_mtu")}
        gid = getattr(nic, "gid", None)
        port["gid"] = gid.hex(":") if isinstance(gid, (bytes, bytearray)) else gid
        rep.add("nic", "port used", "info", ", ".join("%s %s" % kv for kv in port.items()),
                **{k: v for k, v in port.items() if v is not None})
    placement = getattr(nic, "ring_placement", None) or {}
    rings = "; rings: " + "; ".join("%s in %s (%s)" % (r, k, why)
                                    for r, (k, why) in sorted(placement.items()))
    missing = object()
    try:
        umem = getattr(nic, "umem_in_gpu_memory", missing)     # DevxNic probes it on first read
    except Exception as e:  # noqa: BLE001 - a failed probe is the finding
        umem = e
    if umem is missing:
        rep.add("nic", "UMEM in GPU memory accepted", "skip",
                no_nic if used == "soft" else "%s does not report umem_in_gpu_memory"
                % type(nic).__name__)
    elif umem is None:
        rep.add("nic", "UMEM in GPU memory accepted", "skip",
                "no GPU memory to ask about (CPU platform)" + (rings if placement else ""))
    elif isinstance(umem, Exception):
        rep.add("nic", "UMEM in GPU memory accepted", "no", "the probe failed: %s" % _err(umem))
    else:
        rep.add("nic", "UMEM in GPU memory accepted", "yes" if umem else "no",
                "DevX UMEM registration of a GPU page %s%s"
                % ("accepted" if umem else "refused", rings if placement else ""))
    endian = getattr(nic, "atomic_endianness", None)
    if endian is None:
        rep.add("nic", "atomic endianness mode", "skip", "%s does not report atomic_endianness"
                % type(nic).__name__)
    else:
        rep.add("nic", "atomic endianness mode", "info", "%s%s" % (
            endian, " (no NIC: the soft NIC's setting)" if used == "soft" else
            " (HCA atomic_req_8B_endianness_mode)"), value=endian)


def _doorbell(rep, plat, nic):
    """Map the NIC's doorbell into the device once (Nic.map_doorbell); returns a probe for
    choose_transport that replays the outcome (a real UAR is registered once)."""
    from gpunet.host.platform import VendorRuntimeError

    try:
        how = nic.map_doorbell(plat)
        rep.add("nic", "doorbell (UAR) mappable into the GPU", "yes", how)
        return lambda: how
    except Exception as e:  # noqa: BLE001
        if isinstance(e, VendorRuntimeError):      # the driver refused: auto picks the proxy
            rep.add("nic", "doorbell (UAR) mappable into the GPU", "no",
                    "%s; transport 'auto' uses the CPU proxy" % e)
        else:
            rep.add("nic", "doorbell (UAR) mappable into the GPU", "FAIL", _err(e))
        err = e

        def refused():
            raise err
        return refused


def _dmabuf_rows(rep, plat, nic, used):
    if not plat.is_gpu:
        rep.add("nic", "dma-buf export of GPU memory", "skip", "no GPU (CPU platform)")
        return
    from gpunet.host.platform import VendorRuntimeError

    nbytes = 2 << 20
    try:
        mem = plat.alloc("device", nbytes)
    except GpunetError as e:
        rep.add("nic", "dma-buf export of GPU memory", "FAIL", "device allocation: %s" % _err(e))
        return
    try:
        try:
            db = plat.dmabuf_fd(mem.ptr, nbytes)
            os.close(db.fd)
            rep.add("nic", "dma-buf export of GPU memory", "yes",
                    "%d bytes at 0x%x exported (offset %d)" % (db.length, mem.ptr, db.offset))
        except (VendorRuntimeError, GpunetError) as e:
            rep.add("nic", "dma-buf export of GPU memory", "no", _err(e))
        if used == "soft":
            rep.add("nic", "GPU memory registered with the NIC", "skip",
                    "no NIC (soft NIC used): the soft NIC is a CPU thread and registers host "
                    "memory only")
            return
        try:
            mr = nic.reg_mr(mem.ptr, nbytes, kind="device")
            nic.dereg_mr(mr)
            rep.add("nic", "GPU memory registered with the NIC", "yes", repr(mr))
        except Exception as e:  # noqa: BLE001 - the refusal is the finding
            rep.add("nic", "GPU memory registered with the NIC", "no", _err(e))
    finally:
        mem.close()


def _transport_rows(rep, plat, nic, probe):
    """What "auto" gives a peer on this node and on another (gpunet/transports.py's rule: on
    CUDA p2p on this node, else the NIC's choice), and whether p2p can reach each."""
    from gpunet.errors import ConfigError
    from gpunet.transports import choose_transport, node_identity, settle_auto

    nic_choice = choose_transport("auto", probe)
    here = node_identity()
    for peer, there in (("same node", here), ("other node", ("another node", ""))):
        kind, why = (settle_auto(nic_choice, here, there) if plat.name == "cuda" else nic_choice)
        rep.add("transport", "peer on the %s: auto" % peer, "info", "%s (%s)" % (kind, why),
                kind=kind)
    if plat.is_gpu:
        p2p = ("yes", "the heap in device memory, opened by the peers' CUDA IPC handles; 'auto' "
               "picks it for peers on this node" if plat.name == "cuda"
               else "unverified (MACA IPC has never run); on request only")
    else:
        try:
            buf = nic.alloc(4096)
            nic.export_heap(buf.ctypes.data, 4096)
            p2p = ("yes", "on request: peers map this NIC's memory by name (Nic.export_heap); "
                   "'auto' keeps the soft NIC on the CPU")
        except ConfigError as e:
            p2p = ("no", str(e))
    rep.add("transport", "peer on the same node: p2p", p2p[0], p2p[1])
    rep.add("transport", "peer on the other node: p2p", "no", "p2p needs a shared machine")


# --- loopback: the whole stack, one rank, through each NIC transport ----------------------------

def _loopback_rows(rep, transport, nic_kind, timeout_s, refused):
    check = "%s: " % transport
    if refused is not None:
        rep.add("loopback", check + "write, read, atomic", "skip",
                "the doorbell cannot be mapped into the device (%s): ibgda cannot work here, "
                "'auto' uses the proxy" % refused)
        return
    import torch
    import gpunet

    t0 = time.perf_counter()
    try:
        ctx = gpunet.init(transport=transport, nic=nic_kind, heap_bytes=LOOPBACK_HEAP,
                          timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001 - every failure becomes a FAIL row
        rep.add("loopback", check + "init", "FAIL", _err(e))
        return
    try:
        rep.add("loopback", check + "init", "ok", "one rank, %s (%.1f s)"
                % (ctx.reasons[0], time.perf_counter() - t0))
        n = LOOPBACK_BYTES // 8
        src, dst, word = (ctx.alloc((n,), torch.int64), ctx.alloc((n,), torch.int64),
                          ctx.alloc((1,), torch.int64))
        me = ctx.rank
        gen = torch.Generator().manual_seed(12)
        pattern = torch.randint(-2**62, 2**62, (n,), generator=gen, dtype=torch.int64)

        def write():
            src.copy_(pattern.to(src.device))
            gpunet.put(ctx.remote(me, dst), src)
            gpunet.quiet()
            if not torch.equal(dst.cpu(), pattern):
                raise GpunetError("the destination differs from the source after quiet")
            return "%d B RDMA WRITE, bytes checked" % LOOPBACK_BYTES

        def read():
            src.zero_()
            gpunet.get(src, ctx.remote(me, dst))
            gpunet.quiet()
            if not torch.equal(src.cpu(), pattern):
                raise GpunetError("the bytes read differ from the remote's")
            return "%d B RDMA READ, bytes checked" % LOOPBACK_BYTES

        def atomic():
            olds = [gpunet.atomic_add(ctx.remote(me, word), v) for v in (5, 7, 0)]
            if olds != [0, 5, 12]:
                raise GpunetError("fetch-add returned %s, expected [0, 5, 12]" % olds)
            return "3 fetch-adds returned %s" % olds

        for name, fn in (("write", write), ("read", read), ("atomic", atomic)):
            t = time.perf_counter()
            try:
                detail = fn()
                rep.add("loopback", check + name, "ok", "%s (%.0f us)"
                        % (detail, (time.perf_counter() - t) * 1e6))
            except Exception as e:  # noqa: BLE001
                rep.add("loopback", check + name, "FAIL", _err(e))
    finally:
        try:
            ctx.close()
        except Exception as e:  # noqa: BLE001
            rep.add("loopback", check + "close", "FAIL", _err(e))


def warm(nic_kind="soft", timeout_s=60.0, log=None):
    """Compile, once and serially, what every rank's first ``init`` would otherwise compile at
    the same moment: numba's disk caches (the soft NIC's engine, the proxy's drain pass and
    progress hook, the wire builders) and the HOST arm's kernel library, by running the loopback
    checks (a one-rank Context per NIC transport: write, read, fetch-add). A cold compile on the
    2-core CI VM takes ~45 s in one process; two or four rank processes compiling the same
    functions at once on 2 cores took over 120 s (CI stop 15). Returns the Report; raises
    GpunetError naming the failed checks."""
    rep = Report(log)
    for t in ("ibgda", "proxy"):
        _loopback_rows(rep, t, nic_kind, timeout_s, None)
    bad = rep.failed()
    if bad:
        raise GpunetError("warm-up failed: %s" % "; ".join(
            "%s (%s)" % (r["check"], r["detail"]) for r in bad))
    return rep


# The library's kernel sources (gpunet/device/kernels) that its calls build for the CUDA arm on first
# use: prebuild_cuda's default. Serially they took 56 s on this project's 2-core CI VM (ep_ll.cu
# alone 25 s), and each GPU call of the development machines starts on a fresh machine.
CUDA_KERNELS = ("ep_ll.cu", "ep_ht.cu", "ops.cu", "doctor.cu")


def cuda_variants():
    """(file, defines) of the builds with defines that the library's calls also load: gpunet.ep's
    kernels for a world of p2p peers only (gpunet/ep/buffer.py _kernel_kinds)."""
    from gpunet.device import abi
    from gpunet.device import ep as dep
    d = dep.with_transports({}, {abi.TRANSPORT_P2P})
    return (("ep_ll.cu", d), ("ep_ht.cu", d))


def _prebuild_one(path, defines=None):
    """One CUDA build in a worker process of prebuild_cuda: (name, seconds, error or None); the
    name is the file's, with its defines after it."""
    from gpunet.device import loader
    name = path.name + "".join(" %s=%s" % kv for kv in sorted((defines or {}).items()))
    t0 = time.perf_counter()
    try:
        loader.build([path], arch="cuda", defines=defines or {})
    except GpunetError as e:
        return name, time.perf_counter() - t0, str(e)
    return name, time.perf_counter() - t0, None


def prebuild_cuda(sources=None, jobs=None, then=None):
    """Compile each of ``sources`` (paths of .cu files, or (path, defines) pairs; default:
    CUDA_KERNELS and cuda_variants()) for the CUDA arm
    into the kernel cache, in a process of its own (at most ``jobs`` at once, default the CPU
    count), while ``then()`` (if given) runs here; no GPU is needed. Later builds of the same
    sources (same cache key) load the cached libraries instead of compiling: ``python -m gpunet
    warmup --cuda``, and the GPU gate's scripts/gpu_warm.py. Returns {file name: seconds};
    raises ToolchainError naming every source that failed (with the compiler's message), after
    the others are built."""
    import concurrent.futures
    from pathlib import Path

    from gpunet.device import loader
    from gpunet.errors import ToolchainError

    if sources is None:
        sources = [loader.kernels_dir() / k for k in CUDA_KERNELS] + \
            [(loader.kernels_dir() / k, d) for k, d in cuda_variants()]
    builds = [(Path(p[0]), p[1]) if isinstance(p, tuple) else (Path(p), None) for p in sources]
    workers = max(1, min(len(builds), jobs or os.cpu_count() or 1))
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
        futs = [pool.submit(_prebuild_one, p, d) for p, d in builds]
        if then is not None:
            then()
        done = [f.result() for f in futs]
    bad = [(name, err) for name, _, err in done if err]
    if bad:
        raise ToolchainError("cuda prebuild failed for %s:\n%s" % (
            ", ".join(n for n, _ in bad), "\n".join("%s: %s" % (n, e[-2000:]) for n, e in bad)))
    return {name: sec for name, sec, _ in done}


# --- coherence probes -----------------------------------------------------------------------------

def load_probe(arch):
    """Build (cached) and bind gpunet/device/kernels/doctor.cu for ``arch``; checks ProbeCtl's size."""
    from gpunet.device import loader
    from gpunet.errors import ToolchainError

    lib = loader.build([loader.kernels_dir() / "doctor.cu"], arch=arch)
    if not getattr(lib, "_gpunet_bound", False):
        u32, u64, vp = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
        lib.gpunet_doctor_ctl_size.argtypes, lib.gpunet_doctor_ctl_size.restype = [], u32
        lib.gpunet_doctor_probe.argtypes = [vp, vp, u32, u64, u64, u32, u64, u64]
        lib.gpunet_doctor_probe.restype = ctypes.c_int
        if lib.gpunet_doctor_ctl_size() != CTL_BYTES:
            raise ToolchainError("doctor.cu was built with sizeof(ProbeCtl) = %d, gpunet/doctor.py "
                                 "expects %d" % (lib.gpunet_doctor_ctl_size(), CTL_BYTES))
        lib._gpunet_bound = True
    return lib


class Prober:
    """The coherence probes on one NIC: a connected QP pair on it (the NIC writes and reads with
    host-posted WQEs, gpunet/host/wq.py), a staging buffer in host memory, and the probe kernel.

    ``g`` translates NIC-memory addresses for the kernel (identity on the CPU; on a GPU the
    NicMapping of the NIC's memory). ``timeout_s`` bounds every wait of the handshake."""

    def __init__(self, plat, nic, used, lib, g, timeout_s):
        from gpunet.host.nic import Access
        from gpunet.host.wq import CompletionQueue, SendQueue

        self.plat, self.nic, self.used, self.lib, self.g = plat, nic, used, lib, g
        self.timeout_s = timeout_s
        self.nbytes = PROBE_WORDS * 8
        self._queues = (SendQueue, CompletionQueue)
        self._new_pair()
        self.stage = nic.alloc(self.nbytes, 4096)
        self.stage_mr = nic.reg_mr(self.stage, access=Access.ALL, kind="host")
        self.count = 0
        self.stuck = False       # a probe kernel outlived its bounds: the NIC must stay open
        self._dma = None         # soft NIC on a GPU: copy engine attached (see _copy_engine)
        _ctl_access()            # compiled (or loaded from numba's cache) before any probe's clock

    def _new_pair(self):
        """A fresh connected QP pair (loopback on this NIC); after an error completion the old
        one stays in ERR, unused, so one failed probe does not fail the next."""
        SendQueue, CompletionQueue = self._queues
        cq_a, cq_b = self.nic.create_cq(64), self.nic.create_cq(64)
        self.qa = self.nic.create_qp(cq_a, sq_wqebbs=64)
        qb = self.nic.create_qp(cq_b, sq_wqebbs=64)
        self.nic.connect(self.qa, qb.info())
        self.nic.connect(qb, self.qa.info())
        self.sq, self.cq = SendQueue(self.qa), CompletionQueue(cq_a)

    def _buffer(self, kind, old):
        """(NIC address, kernel address, MR, release) of a fresh ``kind`` buffer holding ``old``
        in every word, or raise _Skip with why it cannot be measured here."""
        words = np.full(PROBE_WORDS, old, dtype=np.uint64)
        if not self.plat.is_gpu or kind == "host":
            buf = self.nic.alloc(self.nbytes, 4096)
            buf.view(np.uint64)[:] = words           # before reg_mr: both c500 images hold it
            mr = self.nic.reg_mr(buf, kind=kind)
            addr = buf.ctypes.data
            return addr, self.g(addr), mr, lambda: self.nic.dereg_mr(mr)
        extra = {}
        if self.used == "soft":
            # The soft NIC (a CPU thread) reaches GPU memory only through a copy engine
            # (SoftNic.attach_copy_engine: cudaMemcpyAsync, as a NIC's DMA over GPUDirect), and
            # only on the nvidia profile; what it measures is then the copy engine's coherence
            # with the SMs, not a NIC's.
            if not self._copy_engine():
                raise _Skip("no NIC (soft NIC used): the soft NIC is a CPU thread and cannot "
                            "reach %s memory of the GPU%s; a real NIC registers it by dma-buf"
                            % (kind, "" if self.plat.profile == "nvidia" else
                               " on the %s profile" % self.plat.profile))
            extra = {"device_memory": True}
        mem = self.plat.alloc(kind, self.nbytes)     # NOT YET RUN on a GPU
        try:
            self.plat.memcpy(mem.ptr, words.ctypes.data, self.nbytes)
            mr = self.nic.reg_mr(mem.ptr, self.nbytes, kind=kind, **extra)
        except Exception as e:  # noqa: BLE001 - a refused registration is the finding
            mem.close()
            raise _Skip("the NIC did not register %s memory: %s" % (kind, _err(e)))

        def release():
            self.nic.dereg_mr(mr)
            mem.close()
        return mem.ptr, mem.ptr, mr, release

    def _copy_engine(self):
        """Attach the platform's copy engine to a soft NIC once (nvidia profile only: the c500
        model keeps CPU images of device memory instead); False where either side lacks it."""
        if self._dma is None:
            attach = getattr(self.nic, "attach_copy_engine", None)
            make = getattr(self.plat, "copy_engine", None)
            self._dma = bool(attach and make and self.plat.profile == "nvidia")
            if self._dma:
                try:
                    attach(make())
                except Exception as e:  # noqa: BLE001 - every probe that needs it reports it
                    self._dma = e
        if isinstance(self._dma, Exception):
            raise GpunetError("attaching the copy engine to the soft NIC failed: %s"
                              % _err(self._dma))
        return self._dma

    def _wait(self, ctl, word, what):
        load_acquire_u64 = _ctl_access()[0]
        deadline = time.monotonic() + self.timeout_s
        addr = ctl.ctypes.data + 8 * word
        while load_acquire_u64(addr) == 0:
            if time.monotonic() > deadline:
                raise GpunetError("the probe kernel did not %s within %.1f s" % (what, self.timeout_s))
            time.sleep(20e-6)

    def _completion(self, what):
        try:
            c = self.cq.wait(1, timeout=self.timeout_s)[0]
        except GpunetError:
            self._new_pair()
            raise
        if c.error:
            self._new_pair()
            raise GpunetError("the NIC's %s completed with %s (syndrome 0x%x)"
                              % (what, c.status, c.syndrome))

    def probe(self, kind, direction, fence):
        """One measurement: a dict (kind, direction, fence, coherent, ...); ``coherent`` None
        with ``skip`` when it cannot be measured here."""
        store_release_u64 = _ctl_access()[1]
        t_start = time.perf_counter()
        self.count += 1
        pattern = PROBE_PATTERN + self.count
        res = {"kind": kind, "direction": direction, "fence": fence, "coherent": None,
               "words": PROBE_WORDS}
        try:
            naddr, kaddr, mr, release = self._buffer(kind, PROBE_OLD)
        except _Skip as s:
            res.update(skip=str(s), elapsed_s=round(time.perf_counter() - t_start, 4))
            return res
        except Exception as e:  # noqa: BLE001 - no kernel runs yet: a FAIL row, the next probe
            res.update(error=_err(e), elapsed_s=round(time.perf_counter() - t_start, 4))
            return res
        ctl = self.nic.alloc(CTL_BYTES, 64).view(np.uint64)
        to_nic = direction == "sm_write_nic_read"
        mode = (MODE_SM_TO_NIC if to_nic else 0) | (MODE_FENCE if fence else 0)
        rc = []
        kernel = threading.Thread(
            target=lambda: rc.append(self.lib.gpunet_doctor_probe(
                self.g(ctl.ctypes.data), kaddr, PROBE_WORDS, PROBE_OLD, pattern, mode,
                int(self.timeout_s * 1e9), int(PROBE_VISIBLE_S * 1e9))),
            name="gpunet-doctor-probe", daemon=True)
        kernel.start()
        try:
            self._wait(ctl, CTL_READY, "start")
            if to_nic:
                self.stage.view(np.uint64)[:] = 0
                t0, reads, fresh = time.monotonic(), 0, False
                while True:
                    self.sq.post_read(self.stage_mr.addr, self.stage_mr.lkey, naddr, mr.rkey,
                                      self.nbytes, signaled=True)
                    self._completion("RDMA READ")
                    reads += 1
                    got = self.stage.view(np.uint64)
                    fresh = bool((got == pattern).all())
                    if fresh or time.monotonic() - t0 > PROBE_VISIBLE_S:
                        break
                res.update(coherent=fresh, nic_reads=reads,
                           matched=int((got == pattern).sum()),
                           first_bad=None if fresh else "0x%016x" % int(got[got != pattern][0]))
            else:
                self.stage.view(np.uint64)[:] = pattern
                self.sq.post_write(self.stage_mr.addr, self.stage_mr.lkey, naddr, mr.rkey,
                                   self.nbytes, signaled=True)
                self._completion("RDMA WRITE")
            store_release_u64(ctl.ctypes.data + 8 * CTL_GO, 1)
            kernel.join(self.timeout_s + PROBE_VISIBLE_S + 5.0)
            if kernel.is_alive():
                raise GpunetError("the probe kernel did not finish within %.1f s"
                                  % (self.timeout_s + PROBE_VISIBLE_S + 5.0))
            if rc != [0]:
                raise GpunetError("the probe kernel's launch failed (%s)" % rc)
            if int(ctl[CTL_CODE]) != 0:
                raise GpunetError("the probe kernel timed out waiting for the host")
            if not to_nic:
                if int(ctl[CTL_WARM_OLD]) != PROBE_WORDS:     # the probe's premise
                    raise GpunetError("the kernel did not see the buffer's initial contents "
                                      "(%d/%d words) before the NIC wrote"
                                      % (int(ctl[CTL_WARM_OLD]), PROBE_WORDS))
                matched = int(ctl[CTL_MATCHED])
                res.update(coherent=matched == PROBE_WORDS, matched=matched,
                           warm_old=int(ctl[CTL_WARM_OLD]), waited_ns=int(ctl[CTL_WAITED_NS]),
                           passes=int(ctl[CTL_PASSES]),
                           first_bad=None if matched == PROBE_WORDS
                           else "0x%016x" % int(ctl[CTL_FIRST_BAD]))
        except Exception as e:  # noqa: BLE001 - recorded; the kernel must be let go whatever failed
            res["error"] = _err(e)
            store_release_u64(ctl.ctypes.data + 8 * CTL_GO, 1)     # let a waiting kernel go
            kernel.join(self.timeout_s + PROBE_VISIBLE_S + 5.0)
        finally:
            if not kernel.is_alive():
                release()
            else:                  # never free memory a kernel may still touch
                self.stuck = True
                res.setdefault("error", "the probe kernel is still running; its buffer is kept")
        res["elapsed_s"] = round(time.perf_counter() - t_start, 4)
        return res


class _Skip(Exception):
    pass


_ctl_fns = []


def _ctl_access():
    """(load_acquire(addr), store_release(addr, v)) on a ProbeCtl word, callable from Python
    (rawmem's intrinsics inside njit): the host's half of the handshake orders like the kernel's."""
    if not _ctl_fns:
        from gpunet.host.rawmem import load_acquire_u64, store_release_u64, wire_njit

        @wire_njit(cache=True)
        def load(addr):
            return load_acquire_u64(addr)

        @wire_njit(cache=True)
        def store(addr, v):
            store_release_u64(addr, v)
        _ctl_fns.extend((load, store))
    return _ctl_fns


def _coherence_rows(rep, plat, nic, used, timeout_s):
    """The probes, then their rows. Returns True when a probe kernel may still be running (the
    NIC must then not be closed)."""
    pr = None
    arch = {"cpu": "host", "cuda": "cuda", "maca": "maca"}[plat.name]
    try:
        lib = load_probe(arch)
    except GpunetError as e:
        rep.add("coherence", "probe kernel (gpunet/device/kernels/doctor.cu)", "FAIL", _err(e))
        return
    mapping = None
    try:
        if plat.is_gpu:
            from gpunet.device.descriptors import NicMapping
            mapping = NicMapping(plat, nic)
            g = mapping.g
        else:
            g = int
        pr = Prober(plat, nic, used, lib, g, timeout_s)
        for kind, direction, fence in itertools.product(KINDS, DIRECTIONS, (False, True)):
            res = pr.probe(kind, direction, fence)
            rep.coherence.append(res)
            what = "%s: %s, %s" % (kind, "NIC write -> SM read" if direction == "nic_write_sm_read"
                                   else "SM write -> NIC read",
                                   "policy fences" if fence else "no fence")
            if "error" in res:
                rep.add("coherence", what, "FAIL", res["error"], probe=res)
            elif res["coherent"] is None:
                rep.add("coherence", what, "skip", res["skip"], probe=res)
            else:
                rep.add("coherence", what, "coherent" if res["coherent"] else "INCOHERENT",
                        _probe_detail(res), probe=res)
            if pr.stuck:
                break
    except Exception as e:  # noqa: BLE001
        rep.add("coherence", "probes", "FAIL", _err(e))
    finally:
        if pr is not None and pr.stuck:
            rep.add("coherence", "probe kernels finished", "FAIL", "a probe kernel is still "
                    "running past its bounds: its NIC and memory are left open (not freed)")
            return True
        if mapping is not None:
            mapping.close()


def _probe_detail(res):
    if res["direction"] == "sm_write_nic_read":
        if res["coherent"]:
            return "the NIC read the kernel's stores (%d READ(s))" % res["nic_reads"]
        return ("the NIC read stale bytes for %.0f ms (%d READs, %d/%d words fresh, first stale "
                "%s)" % (PROBE_VISIBLE_S * 1e3, res["nic_reads"], res["matched"], res["words"],
                         res["first_bad"]))
    if res["coherent"]:
        if res["passes"] == 1:
            return ("the kernel's first read pass saw the NIC's write (%d words in %.1f us)"
                    % (res["words"], res["waited_ns"] / 1e3))
        return ("the kernel saw the NIC's write on read pass %d, after %.1f us"
                % (res["passes"], res["waited_ns"] / 1e3))
    return ("the kernel read stale bytes for %.0f ms (%d passes; %d/%d words fresh, first stale "
            "%s)" % (PROBE_VISIBLE_S * 1e3, res["passes"], res["matched"], res["words"],
                     res["first_bad"]))


def _policy_rows(rep, plat):
    """Each NIC-touched role of the policy against the measurement of its kind (with fences)."""
    from gpunet.host.platform import policy

    measured = {(c["kind"], c["direction"]): c["coherent"] for c in rep.coherence
                if c["fence"] and "error" not in c}
    for role, dirs in ROLE_DIRECTIONS.items():
        kind = policy(role, plat.profile).kind
        got = [measured.get((kind, d)) for d in dirs]
        what = "%s in %s memory" % (role, kind)
        if any(g is False for g in got):
            bad = [d for d, g in zip(dirs, got) if g is False]
            rep.add("policy", what, "FAIL", "measured INCOHERENT (%s) with the policy's fences, "
                    "but the %s policy places %s there" % (", ".join(bad), plat.profile, role))
        elif all(g is True for g in got):
            rep.add("policy", what, "ok", "measured coherent (%s)" % ", ".join(dirs))
        else:
            rep.add("policy", what, "skip", "%s memory not measured here" % kind)


# --- the run --------------------------------------------------------------------------------------

def run(profile=None, nic="auto", platform=None, timeout_s=10.0, loopback=True, log=None):
    """One doctor run; returns the report as a dict (the JSON's content: schema, rows,
    coherence, summary, exit_code). ``profile`` / ``platform`` force GPUNET_PROFILE /
    GPUNET_PLATFORM for the run; ``nic``: "auto" | "soft" | "verbs"; ``loopback``: False leaves
    out the loopback section (no Context is made); ``log``: a stream for progress lines."""
    t0 = time.perf_counter()
    rep = Report(log)
    plat = None

    def guarded(section, fn, *args, default=None):
        # A check that raises what it does not expect becomes a FAIL row: the doctor reports on
        # a broken machine, it does not die on one.
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            rep.add(section, "%s (unexpected error)" % fn.__name__.strip("_"), "FAIL", _err(e))
            return default

    with _forced(platform, profile):
        plat = guarded("platform", _platform_rows, rep)
        if plat is not None:
            guarded("gpu", _gpu_rows, rep, plat)
            guarded("toolchain", _toolchain_rows, rep, plat)
            dev_nic, used = guarded("nic", _nic_rows, rep, plat, nic, default=(None, nic))
            refused, in_use = None, False
            if dev_nic is not None:
                try:
                    probe = guarded("nic", _doorbell, rep, plat, dev_nic)
                    if probe is not None:
                        try:
                            probe()
                        except Exception as e:  # noqa: BLE001 - replayed from _doorbell's row
                            refused = str(e)
                        guarded("nic", _dmabuf_rows, rep, plat, dev_nic, used)
                        guarded("transport", _transport_rows, rep, plat, dev_nic, probe)
                    in_use = guarded("coherence", _coherence_rows, rep, plat, dev_nic, used,
                                     timeout_s)
                    guarded("policy", _policy_rows, rep, plat)
                finally:
                    if not in_use:
                        guarded("nic", dev_nic.close)
                for t in ("ibgda", "proxy") if loopback else ():
                    guarded("loopback", _loopback_rows, rep, t, used, timeout_s,
                            refused if t == "ibgda" else None)
    failed = rep.failed()
    counts = {r: sum(1 for x in rep.rows if x["result"] == r) for r in RESULTS}
    return {
        "schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "args": {"profile": profile, "nic": nic, "platform": platform, "timeout_s": timeout_s,
                 "loopback": loopback},
        "platform": None if plat is None else {"name": plat.name, "profile": plat.profile,
                                               "warp_size": plat.warp_size,
                                               "detected_by": plat.detected_by},
        "rows": rep.rows, "coherence": rep.coherence,
        "summary": {"counts": counts, "failed": ["%s: %s" % (r["section"], r["check"])
                                                 for r in failed],
                    "verdict": "the stack can work here" if not failed else
                    "%d check(s) failed" % len(failed)},
        "exit_code": 1 if failed else 0,
        "elapsed_s": round(time.perf_counter() - t0, 2),
        "table": rep.table(),
    }


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpunet doctor", description="Can gpunet work on this "
                                "machine, and why not: a table, JSON, exit status 0 (no check "
                                "failed) or 1.")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument("--profile", choices=("nvidia", "c500"), default=None,
                   help="coherence profile (GPUNET_PROFILE; default: the platform's)")
    p.add_argument("--nic", choices=("auto", "soft", "verbs"), default="auto",
                   help="the NIC the checks use (default auto: a real one if open_nic finds it)")
    p.add_argument("--platform", choices=("cpu", "cuda", "maca"), default=None,
                   help="skip platform detection (GPUNET_PLATFORM)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="bound on every device wait and handshake step (default 10 s)")
    p.add_argument("--no-loopback", action="store_true",
                   help="leave out the loopback checks (they build and run the ops kernel)")
    a = p.parse_args(argv)
    if not 0 < a.timeout <= 3600:
        p.error("--timeout must be in (0, 3600] seconds")
    for knob in ("GPUNET_PLATFORM", "GPUNET_PROFILE"):
        try:
            config.get(knob)
        except ValueError as e:
            p.error(str(e))
    report = run(profile=a.profile, nic=a.nic, platform=a.platform, timeout_s=a.timeout,
                 loopback=not a.no_loopback, log=sys.stderr)
    print(report["table"])
    print("\n%s (%d ok, %d failed; %.1f s)" % (report["summary"]["verdict"],
                                               report["summary"]["counts"]["ok"],
                                               len(report["summary"]["failed"]),
                                               report["elapsed_s"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return report["exit_code"]
