// The coherence probe kernel of `python -m gpunet doctor` (gpunet/doctor.py binds it): one thread
// reads or writes a buffer of one memory kind while the host makes the NIC write or read it, and
// records what it observed. One source for every arm: g++ -x c++ (HOST), nvcc (CUDA), mxcc (MACA).
//
// The handshake goes through a ProbeCtl block in memory both sides reach (host-mapped on GPUs):
//   NIC -> SM (mode bit DIR_SM_TO_NIC clear): the kernel reads the buffer once (its caches now
//     hold the old bytes, as a kernel that polled the buffer earlier would), sets `ready`; the host
//     has the NIC RDMA-WRITE the pattern, waits for its CQE, sets `go`; the kernel then re-reads
//     until every word equals the pattern or `visible_ns` passes: `matched` says how many did.
//   SM -> NIC (DIR_SM_TO_NIC set): the kernel stores the pattern, then sets `ready`; the host has
//     the NIC RDMA-READ the buffer until it equals the pattern or its bound passes, then sets `go`;
//     the kernel waits for `go` so that it is still running while the NIC reads.
// FENCE selects the fences the coherence policy uses: receive side, an acquire on `go` and a
// system fence before each re-read (qp.cuh's CQ poll, wait_until); send side, a system fence and a
// release store of `ready` after the payload (qp.cuh's fence before the doorbell). Without FENCE
// every access is relaxed. Every wait is bounded (`wait_ns`); no remote load is ever made.
#include <gpunet/gpunet.cuh>

namespace arch = gpunet::arch;

namespace {

// Mirrored in gpunet/doctor.py (CTL_*): 128 bytes, the host's view of the handshake.
struct ProbeCtl {
  uint64_t ready;      // kernel -> host: 1 once warmed (NIC -> SM) or once the pattern is stored
  uint64_t go;         // host -> kernel: 1 once the NIC's write completed / its reads are done
  uint64_t done;       // kernel: 1 when the fields below are final
  uint64_t matched;    // NIC -> SM: words equal to the pattern at the end
  uint64_t first_bad;  // NIC -> SM: the first word that was not the pattern (pattern if none)
  uint64_t waited_ns;  // NIC -> SM: from `go` until every word matched, or the bound
  uint64_t code;       // 0 ok, 1 timed out waiting for the host's `go`
  uint64_t warm_old;   // NIC -> SM: words equal to `old` when the kernel first read the buffer
  uint64_t passes;     // NIC -> SM: read passes over the buffer after `go` (1: the first saw it)
  uint64_t pad[7];
};
static_assert(sizeof(ProbeCtl) == 128, "ProbeCtl is mirrored in gpunet/doctor.py");

enum : uint32_t { DIR_SM_TO_NIC = 1, FENCE = 2 };

GPUNET_DEVICE uint64_t read_go(ProbeCtl* c, bool fence) {
  return fence ? arch::load_acquire_sys(&c->go) : arch::load_relaxed(&c->go);
}

// Waits for `go`; false after wait_ns.
GPUNET_DEVICE bool wait_go(ProbeCtl* c, bool fence, uint64_t wait_ns) {
  const uint64_t t0 = arch::now_ns();
  while (read_go(c, fence) == 0) {
    if (arch::now_ns() - t0 > wait_ns) return false;
    arch::spin_pause();
  }
  return true;
}

GPUNET_GLOBAL void k_probe(ProbeCtl* c, uint64_t* buf, uint32_t nwords, uint64_t old,
                           uint64_t pattern, uint32_t mode, uint64_t wait_ns, uint64_t visible_ns) {
  const bool fence = (mode & FENCE) != 0;
  if (mode & DIR_SM_TO_NIC) {
    for (uint32_t i = 0; i < nwords; ++i) arch::store_relaxed(buf + i, pattern);
    if (fence) {
      arch::fence_sys();
      arch::store_release_sys(&c->ready, uint64_t(1));
    } else {
      arch::store_relaxed(&c->ready, uint64_t(1));
    }
    // Stay resident while the NIC reads: the question is what it sees before the kernel ends.
    c->code = wait_go(c, true, wait_ns) ? 0 : 1;
    arch::store_release_sys(&c->done, uint64_t(1));
    return;
  }
  uint64_t warm = 0;
  for (uint32_t i = 0; i < nwords; ++i) warm += arch::load_relaxed(buf + i) == old;
  c->warm_old = warm;
  arch::store_release_sys(&c->ready, uint64_t(1));
  if (!wait_go(c, fence, wait_ns)) {
    c->code = 1;
    arch::store_release_sys(&c->done, uint64_t(1));
    return;
  }
  const uint64_t t0 = arch::now_ns();
  uint64_t matched = 0, first_bad = pattern, passes = 0;
  for (;;) {
    ++passes;
    if (fence) arch::fence_sys();
    matched = 0;
    first_bad = pattern;
    for (uint32_t i = 0; i < nwords; ++i) {
      const uint64_t v = arch::load_relaxed(buf + i);
      if (v == pattern) ++matched;
      else if (first_bad == pattern) first_bad = v;
    }
    if (matched == nwords || arch::now_ns() - t0 > visible_ns) break;
    arch::spin_pause();
  }
  c->passes = passes;
  c->matched = matched;
  c->first_bad = first_bad;
  c->waited_ns = arch::now_ns() - t0;
  c->code = 0;
  arch::store_release_sys(&c->done, uint64_t(1));
}

}  // namespace

extern "C" {

uint32_t gpunet_doctor_ctl_size() { return sizeof(ProbeCtl); }

// One thread runs the probe; sync: the call returns when the kernel has finished (GPUs: on the
// legacy default stream, its error reported). ctl and buf are device addresses. Returns 0 or a
// launch / kernel error.
int gpunet_doctor_probe(void* ctl, uint64_t* buf, uint32_t nwords, uint64_t old, uint64_t pattern,
                        uint32_t mode, uint64_t wait_ns, uint64_t visible_ns) {
  gpunet::LaunchSpec s;
  s.sync = true;
  return gpunet::launch_kernel(s, k_probe, static_cast<ProbeCtl*>(ctl), buf, nwords, old, pattern,
                               mode, wait_ns, visible_ns);
}

}  // extern "C"
