"""Soft NIC throughput: 64-byte RDMA WRITE rate and 1 MiB RDMA WRITE bandwidth, on this CPU.

    python bench/softnic.py [--quick] [--json PATH]

Rows:
- ``write64 engine``: the ring (32768 WQEBBs) is filled with 64-byte WRITEs, one CQE every 64,
  *before* the doorbell; the time runs from the doorbell to the last CQE. This is the engine
  alone: no producer runs while it executes.
- ``write64 stream``: a numba producer (``wq.post_rdma`` / ``ring_doorbell`` / ``poll_cq`` in one
  nopython loop on the calling thread; it sched_yield()s while the ring is full) keeps a
  4096-WQEBB ring fed, a doorbell and a CQE every 64 WQEs, while the engine thread executes:
  producer and engine share the machine's cores, so this row is wall-clock end to end.
- ``write64 engine-cpu`` / ``write1MiB engine-cpu``: the engine's own cost, immune to other load:
  the initiator's engine thread is stopped and the timing thread runs ``engine_step`` over
  pre-filled rings; seconds are that thread's CPU time (and numpy's copy is timed the same way).
- ``write1MiB stream``: the same producer posting 1 MiB WRITEs (a CQE every 8) over a 32 MiB
  source/destination cycle; beside it, ``np.copyto`` of the very same 1 MiB chunks in the same
  order, in the same run: the ratio column is soft-NIC bandwidth / numpy copy bandwidth.

Targets (the soft NIC issue): >= 5 M WQE/s per engine thread for 64-byte WRITEs; 1 MiB WRITEs at
>= 70% of a numpy copy's bandwidth. Prints a table with the machine; writes JSON (default
bench/out/softnic.json).
"""
import argparse
import json
import os
import sys
import time

import numpy as np
from numba import njit

from gpunet import mlx5
from gpunet.host import wq
from gpunet.host import softnic
from gpunet.host.softnic import SoftNic, c_sched_yield
from machine import machine  # bench/machine.py (the script's folder is on sys.path)

TARGET_MWQES = 5.0           # M WQE/s per engine thread, 64-byte WRITEs (the target)
TARGET_RATIO = 0.70          # 1 MiB WRITE bandwidth / numpy copy bandwidth (the target)
SIGNAL_EVERY = 64            # one CQE every 64 WQEs, one doorbell every 64 WQEs
ENGINE_RING = 32768          # the largest ring the soft NIC allows: the engine-only row's chunk
STREAM_RING = 4096           # the streaming rows' ring (NVSHMEM's default QP depth is 1024)
BIG = 1 << 20
BIG_CYCLE = 32               # 1 MiB chunks cycled through (32 MiB each side: beyond the L2)


@njit(cache=True, nogil=True)
def _fill(sq_addr, depth, pi0, n, qpn, raddr, rkey, laddr, lkey, nbytes, signal_every):
    """Write ``n`` RDMA WRITE WQEs from index pi0 (no doorbell); every signal_every-th signalled."""
    for k in range(n):
        fm = mlx5.WQE_CTRL_CQ_UPDATE if (k + 1) % signal_every == 0 else 0
        wq.post_rdma(sq_addr, depth, pi0 + k, qpn, mlx5.OPCODE_RDMA_WRITE, fm, raddr, rkey,
                     laddr, lkey, nbytes, 0)


@njit(cache=True, nogil=True)
def _wait_cqes(cq_addr, cqe_cnt, cq_dbrec, ci, n, out):
    """Consume ``n`` CQEs from ci; returns the new ci, or -1 on an error CQE."""
    got = 0
    while got < n:
        k = wq.poll_cq(cq_addr, cqe_cnt, cq_dbrec, ci, out, 16)
        for i in range(k):
            if (out[i * mlx5.CQE_SIZE + mlx5.CQE_OP_OWN] >> 4) != mlx5.CQE_REQ:
                return -1
        ci += k
        got += k
        if k == 0:
            c_sched_yield()          # let the engine have the core (2-core machines)
    return ci


@njit(cache=True, nogil=True)
def _stream(sq_addr, depth, qpn, dbrec_addr, db_addr, cq_addr, cqe_cnt, cq_dbrec, ci, pi0,
            raddr, rkey, laddr, lkey, nbytes, stride, ncycle, n_wqes, batch, out):
    """Producer: post n_wqes WRITEs from WQE index pi0 (chunk i % ncycle at offset
    stride * (i % ncycle)), a doorbell and a CQE every ``batch``, reclaiming ring space from the
    CQEs. Returns the CQ's new ci, or -1 on an error CQE."""
    pi = pi0
    end = pi0 + n_wqes
    done = pi0
    while done < end:
        while pi < end and pi + batch - done <= depth:
            for k in range(batch):
                c = (pi % ncycle) * stride
                fm = mlx5.WQE_CTRL_CQ_UPDATE if k == batch - 1 else 0
                wq.post_rdma(sq_addr, depth, pi, qpn, mlx5.OPCODE_RDMA_WRITE, fm, raddr + c,
                             rkey, laddr + c, lkey, nbytes, 0)
                pi += 1
            wq.ring_doorbell(sq_addr, depth, dbrec_addr, db_addr, pi, pi - 1)
        k = wq.poll_cq(cq_addr, cqe_cnt, cq_dbrec, ci, out, 16)
        for i in range(k):
            if (out[i * mlx5.CQE_SIZE + mlx5.CQE_OP_OWN] >> 4) != mlx5.CQE_REQ:
                return -1
        if k > 0:
            ci += k
            last = (np.int64(out[(k - 1) * mlx5.CQE_SIZE + 60]) << 8) \
                | np.int64(out[(k - 1) * mlx5.CQE_SIZE + 61])
            done = pi - ((pi - 1 - last) & 0xFFFF)        # one past the newest completed WQE
        elif pi == end or pi + batch - done > depth:
            c_sched_yield()          # nothing to post: give the core to the engine (2-core CI)
    return ci


class Rig:
    """Two soft NICs, one QP pair, buffers on both sides."""

    def __init__(self, ring, cqe_cnt, buf_bytes):
        self.a = SoftNic(arena_bytes=buf_bytes + (64 << 20))
        self.b = SoftNic(arena_bytes=buf_bytes + (64 << 20))
        self.cq = self.a.create_cq(cqe_cnt)
        self.qp = self.a.create_qp(self.cq, sq_wqebbs=ring)
        rcq = self.b.create_cq(64)
        self.rqp = self.b.create_qp(rcq)
        self.a.connect(self.qp, self.rqp.info())
        self.b.connect(self.rqp, self.qp.info())
        self.src = self.a.alloc(buf_bytes, 4096)
        self.dst = self.b.alloc(buf_bytes, 4096)
        self.src[:] = np.arange(buf_bytes, dtype=np.uint64).astype(np.uint8)
        self.dst[:] = 1                                    # touch every page before timing
        self.smr, self.dmr = self.a.reg_mr(self.src), self.b.reg_mr(self.dst)
        self.out = np.zeros(16 * mlx5.CQE_SIZE, dtype=np.uint8)
        self.ci = 0

    def close(self):
        self.a.close()
        self.b.close()


def bench_engine64(n_chunks):
    """Engine alone: a full ring posted before its doorbell, timed doorbell -> last CQE."""
    r = Rig(ENGINE_RING, 1024, 1 << 16)
    q = r.qp
    try:
        pi, times = 0, []
        for _ in range(n_chunks + 1):                      # the first chunk warms up
            _fill(q.sq_addr, ENGINE_RING, pi, ENGINE_RING, q.qpn, r.dmr.addr, r.dmr.rkey,
                  r.smr.addr, r.smr.lkey, 64, SIGNAL_EVERY)
            t0 = time.perf_counter()
            wq.ring_doorbell(q.sq_addr, ENGINE_RING, q.dbrec_addr, q.db_addr,
                             pi + ENGINE_RING, pi + ENGINE_RING - 1)
            r.ci = _wait_cqes(r.cq.buf_addr, r.cq.cqe_cnt, r.cq.dbrec_addr, r.ci,
                              ENGINE_RING // SIGNAL_EVERY, r.out)
            times.append(time.perf_counter() - t0)
            assert r.ci >= 0, "error CQE"
            pi += ENGINE_RING
        n = ENGINE_RING * n_chunks
        t = sum(times[1:])
        assert np.array_equal(r.dst[:64], r.src[:64])
        return {"test": "write64 engine", "wqes": n, "bytes_per_wqe": 64,
                "producer": "none while timed: ring pre-filled (%d WQEs), one doorbell"
                            % ENGINE_RING,
                "seconds": t, "mwqes": n / t / 1e6, "gbps": n * 64 / t / 1e9}
    finally:
        r.close()


def _numpy_copy_gbps(src, dst, nbytes, stride, ncycle, n):
    t0 = time.perf_counter()
    for i in range(n):
        c = (i % ncycle) * stride
        np.copyto(dst[c:c + nbytes], src[c:c + nbytes])
    return n * nbytes / (time.perf_counter() - t0) / 1e9


def bench_stream(nbytes, n_wqes, ncycle, batch):
    """The numba producer feeding the engine; bandwidth next to numpy copying the same chunks."""
    stride = max(nbytes, 64)
    r = Rig(STREAM_RING, 1024, stride * ncycle)
    q, cq = r.qp, r.cq
    pi = [0]

    def run(n):
        t0 = time.perf_counter()
        ci = _stream(q.sq_addr, STREAM_RING, q.qpn, q.dbrec_addr, q.db_addr, cq.buf_addr,
                     cq.cqe_cnt, cq.dbrec_addr, r.ci, pi[0], r.dmr.addr, r.dmr.rkey, r.smr.addr,
                     r.smr.lkey, nbytes, stride, ncycle, n, batch, r.out)
        dt = time.perf_counter() - t0
        assert ci >= 0, "error CQE"
        r.ci = ci
        pi[0] += n
        return dt

    try:
        run(max(batch, (ncycle // batch) * batch))               # compile, touch every chunk
        _numpy_copy_gbps(r.src, r.dst, nbytes, stride, ncycle, ncycle)
        r.dst[:] = 0
        dt = run(n_wqes)
        assert np.array_equal(r.dst[:nbytes], r.src[:nbytes])
        gbps = n_wqes * nbytes / dt / 1e9
        res = {"test": "write%s stream" % ("1MiB" if nbytes == BIG else str(nbytes)),
               "wqes": n_wqes, "bytes_per_wqe": nbytes,
               "producer": "numba loop on the calling thread: post_rdma, doorbell + CQE "
                           "every %d, poll_cq; ring %d" % (batch, STREAM_RING),
               "seconds": dt, "mwqes": n_wqes / dt / 1e6, "gbps": gbps}
        if nbytes >= BIG:
            # a numpy copy of 64 bytes is all call overhead: compare bandwidth only where it
            # means something, i.e. the 1 MiB row
            np_gbps = _numpy_copy_gbps(r.src, r.dst, nbytes, stride, ncycle, n_wqes)
            res.update(numpy_gbps=np_gbps, ratio=gbps / np_gbps)
        return res
    finally:
        r.close()


def _stop_engine(nic):
    """Stop ``nic``'s engine thread so that this thread can drive ``engine_step`` itself (uses the
    soft NIC's internals: the header's stop word and the thread; the NIC still closes normally)."""
    nic._arena.T[softnic.H_STOP] = 1
    nic._thread.join()


def bench_engine_cpu(nbytes, n_wqes, ncycle):
    """The engine's cost in CPU time, immune to other load on the machine: the initiator's engine
    thread is stopped and this thread runs ``engine_step`` over pre-filled rings; time is this
    thread's CPU time (time.thread_time). For 1 MiB, numpy copies the same chunks, timed alike."""
    stride = max(nbytes, 64)
    ring = ENGINE_RING if nbytes < BIG else 256
    r = Rig(ring, 1024, stride * ncycle)
    q = r.qp
    a = r.a
    try:
        _stop_engine(a)
        pi, cpu, done_total = 0, 0.0, 0
        rounds = max(1, n_wqes // ring)
        for it in range(rounds + 1):                       # round 0 warms up
            if nbytes < BIG:
                _fill(q.sq_addr, ring, pi, ring, q.qpn, r.dmr.addr, r.dmr.rkey, r.smr.addr,
                      r.smr.lkey, nbytes, SIGNAL_EVERY)
            else:
                for k in range(ring):
                    c = ((pi + k) % ncycle) * stride
                    fm = mlx5.WQE_CTRL_CQ_UPDATE if (k + 1) % SIGNAL_EVERY == 0 else 0
                    wq.post_rdma(q.sq_addr, ring, pi + k, q.qpn, mlx5.OPCODE_RDMA_WRITE, fm,
                                 r.dmr.addr + c, r.dmr.rkey, r.smr.addr + c, r.smr.lkey,
                                 nbytes, 0)
            wq.ring_doorbell(q.sq_addr, ring, q.dbrec_addr, q.db_addr, pi + ring, pi + ring - 1)
            pi += ring
            t0 = time.thread_time()
            done = 0
            while done < ring:
                done += softnic.engine_step(a._arena.base, a._peer_bases, time.monotonic_ns(),
                                            softnic.ENGINE_BUDGET, a._scratch, a._segs)
            dt = time.thread_time() - t0
            r.ci = _wait_cqes(r.cq.buf_addr, r.cq.cqe_cnt, r.cq.dbrec_addr, r.ci,
                              ring // SIGNAL_EVERY, r.out)
            assert r.ci >= 0, "error CQE"
            if it:
                cpu += dt
                done_total += ring
        res = {"test": "write%s engine-cpu" % ("1MiB" if nbytes >= BIG else str(nbytes)),
               "wqes": done_total, "bytes_per_wqe": nbytes,
               "producer": "none while timed: rings pre-filled, engine_step driven on the "
                           "timing thread; seconds = that thread's CPU time",
               "seconds": cpu, "mwqes": done_total / cpu / 1e6,
               "gbps": done_total * nbytes / cpu / 1e9}
        if nbytes >= BIG:
            t0 = time.thread_time()
            for i in range(done_total):
                c = (i % ncycle) * stride
                np.copyto(r.dst[c:c + nbytes], r.src[c:c + nbytes])
            np_gbps = done_total * nbytes / (time.thread_time() - t0) / 1e9
            res.update(numpy_gbps=np_gbps, ratio=res["gbps"] / np_gbps)
        return res
    finally:
        r.close()


def table(results, mach):
    lines = ["soft NIC benchmark — %s, %d cores, python %s, numba %s, numpy %s; load average "
             "%.1f before the run (other work on the machine skews every row)"
             % (mach["cpu"], mach["cores"], mach["python"], mach["numba"], mach["numpy"],
                mach["loadavg_1min"]), ""]
    hdr = "%-20s %10s %9s %10s %9s %11s %7s  %-8s" % (
        "test", "WQEs", "seconds", "M WQE/s", "GB/s", "numpy GB/s", "ratio", "target")
    lines += [hdr, "-" * len(hdr)]
    for r in results:
        if r["bytes_per_wqe"] >= BIG:
            tgt = "ratio>=%.2f %s" % (TARGET_RATIO,
                                      "MET" if r["ratio"] >= TARGET_RATIO else "MISSED")
        else:
            tgt = ">=%.0fM %s" % (TARGET_MWQES, "MET" if r["mwqes"] >= TARGET_MWQES else "MISSED")
        lines.append("%-20s %10d %9.3f %10.2f %9.2f %11s %7s  %s" % (
            r["test"], r["wqes"], r["seconds"], r["mwqes"], r["gbps"],
            "%.2f" % r["numpy_gbps"] if "numpy_gbps" in r else "-",
            "%.2f" % r["ratio"] if "ratio" in r else "-", tgt))
    lines.append("")
    for r in results:
        lines.append("  %-20s producer: %s" % (r["test"], r["producer"]))
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short run (seconds)")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "out", "softnic.json"),
                    help="where to write the JSON results (default: bench/out/softnic.json)")
    args = ap.parse_args(argv)
    mach = machine()
    q = args.quick
    results = [
        bench_engine64(4 if q else 32),
        bench_stream(64, (1 << 18) if q else (1 << 22), 1024, SIGNAL_EVERY),
        bench_engine_cpu(64, (1 << 17) if q else (1 << 20), 1),
        bench_stream(BIG, 256 if q else 2048, BIG_CYCLE, 8),
        bench_engine_cpu(BIG, 256 if q else 1024, BIG_CYCLE),
    ]
    print(table(results, mach))
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"machine": mach, "quick": q, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                   "targets": {"mwqes_64B": TARGET_MWQES, "ratio_1MiB": TARGET_RATIO},
                   "results": results}, f, indent=2)
    print("\nJSON: %s" % args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
