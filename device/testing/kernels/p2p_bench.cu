// Test and benchmark support, not the API.
// bench/p2p.py's device-side put_signal ping-pong between two ranks.
//
//   k_pingpong  one thread per rank. The ping rank, for i = 1 .. iters: send `nbytes` from `buf`
//               to the peer's `buf` and SET base + i on the peer's word sig[0]; then wait until
//               its own sig[1] >= base + i. The pong rank: wait until its sig[0] >= base + i,
//               then send back with SET of base + i on the peer's sig[1]. SET: one writer per
//               word, the form store-only (c500) p2p peers allow. The ping rank times round
//               trips warmup + 1 .. iters with arch::now_ns() (%globaltimer on CUDA) and writes
//               out[0] = ns, out[1] = round trips timed, out[2] = 1 when every call returned
//               true.
//   mode (how a send and a wait are made; 0 is the figure bench/p2p.py holds to its target):
//     MODE_VERBS        gpunet.cuh's put_signal_nbi and wait_until on a copy of the DevCtx held
//                       by the kernel (`const DevCtx c = *ctx`: its fields stay in registers, as
//                       a user kernel that calls many verbs keeps them);
//     MODE_VERBS_PTR    the same verbs on *ctx itself: every call reads the DevCtx again (after
//                       a wait's acquire, from L2);
//     MODE_RAW_ACQ      the floor under the verbs, no verb at all: the payload's relaxed store and
//                       a device-scope release store of the signal into the peer's heap (the
//                       same stores put_signal_nbi makes to a P2P_SAME_DEVICE peer), and a poll
//                       of the own word with ld.acquire.sys, no pause;
//     MODE_RAW_RELAXED  as MODE_RAW_ACQ, polling with a relaxed (volatile) load and one acquire
//                       load of the word once the relaxed one saw it;
//     MODE_RAW_PAUSE    as MODE_RAW_ACQ with arch::spin_pause() after every poll that failed
//                       (what every wait_until poll did before Spin::fast).
//               The raw modes need both heaps mapped here (a p2p peer); their waits are bounded
//               by the context's timeout like any wait (a timeout is recorded as SITE_WAIT_UNTIL).
//
// The launcher is synchronous (it returns when the kernel has finished) and returns 0 or the
// launch error; a failed wait is recorded in the context's Status block, which the caller checks.
#include <gpunet/gpunet.cuh>

namespace arch = gpunet::arch;
using gpunet::DevCtx;

namespace {

enum : uint32_t {
  MODE_VERBS = 0, MODE_VERBS_PTR = 1, MODE_RAW_ACQ = 2, MODE_RAW_RELAXED = 3, MODE_RAW_PAUSE = 4,
};

// Bounded poll of `word` until it is >= v (raw modes). false (and a recorded timeout) after
// ctx.timeout_ns; the clock is read every 256 polls.
GPUNET_DEVICE bool raw_wait(const DevCtx& ctx, const uint64_t* word, uint64_t v, uint32_t mode) {
  uint64_t t0 = 0;
  for (uint32_t n = 0;; ++n) {
    if (mode == MODE_RAW_RELAXED) {
      if (arch::load_relaxed(word) >= v && arch::load_acquire_sys(word) >= v) return true;
    } else {
      if (arch::load_acquire_sys(word) >= v) return true;
      if (mode == MODE_RAW_PAUSE) arch::spin_pause();
    }
    if ((n & 255) == 0) {
      const uint64_t now = arch::now_ns();
      if (t0 == 0) t0 = now;
      if (now - t0 > ctx.timeout_ns) {
        gpunet::Failure f(gpunet::STATUS_TIMEOUT, gpunet::SITE_WAIT_UNTIL);
        f.addr = uint64_t(uintptr_t(word));
        f.expected = v;
        f.observed = arch::load_relaxed(word);
        f.waited_ns = now - t0;
        gpunet::record_failure(reinterpret_cast<gpunet::Status*>(uintptr_t(ctx.status)), f);
        return false;
      }
    }
  }
}

// The stores put_signal_nbi makes to a P2P_SAME_DEVICE peer, without the verb (raw modes).
GPUNET_DEVICE void raw_send(uint8_t* peer_buf, const uint8_t* buf, uint32_t nbytes,
                            uint64_t* peer_sig, uint64_t v) {
  for (uint32_t k = 0; k + 8 <= nbytes; k += 8)
    arch::store_relaxed(reinterpret_cast<uint64_t*>(peer_buf + k),
                        *reinterpret_cast<const uint64_t*>(buf + k));
  arch::store_release_gpu(peer_sig, v);
}

GPUNET_DEVICE bool run(const DevCtx& c, uint8_t* buf, uint64_t* sig, uint64_t base, uint32_t iters,
                       uint32_t warmup, uint32_t nbytes, int32_t peer, uint32_t ping, uint32_t mode,
                       uint64_t* out) {
  const bool raw = mode >= MODE_RAW_ACQ;
  uint8_t* peer_buf = static_cast<uint8_t*>(gpunet::ptr(c, buf, peer));
  uint64_t* peer_sig = static_cast<uint64_t*>(gpunet::ptr(c, sig, peer));
  bool ok = !raw || (peer_buf && peer_sig);
  uint64_t t0 = arch::now_ns();
  for (uint32_t i = 1; i <= iters && ok; ++i) {
    if (ping && i == warmup + 1) t0 = arch::now_ns();
    const uint64_t v = base + i;
    if (raw && ping) {
      raw_send(peer_buf, buf, nbytes, &peer_sig[0], v);
      ok = raw_wait(c, &sig[1], v, mode);
    } else if (raw) {
      ok = raw_wait(c, &sig[0], v, mode);
      if (ok) raw_send(peer_buf, buf, nbytes, &peer_sig[1], v);
    } else if (ping) {
      ok = gpunet::put_signal_nbi(c, buf, buf, nbytes, &sig[0], v, peer, gpunet::SIGNAL_SET) &&
           gpunet::wait_until(c, &sig[1], gpunet::CMP_GE, v);
    } else {
      ok = gpunet::wait_until(c, &sig[0], gpunet::CMP_GE, v) &&
           gpunet::put_signal_nbi(c, buf, buf, nbytes, &sig[1], v, peer, gpunet::SIGNAL_SET);
    }
  }
  const uint64_t t1 = arch::now_ns();
  if (ok) ok = gpunet::quiet(c);
  out[0] = t1 - t0;
  out[1] = iters > warmup ? iters - warmup : 0;
  return ok;
}

GPUNET_GLOBAL void k_pingpong(const DevCtx* ctx, uint8_t* buf, uint64_t* sig, uint64_t base,
                              uint32_t iters, uint32_t warmup, uint32_t nbytes, int32_t peer,
                              uint32_t ping, uint32_t mode, uint64_t* out) {
  bool ok;
  if (mode == MODE_VERBS_PTR) {
    ok = run(*ctx, buf, sig, base, iters, warmup, nbytes, peer, ping, mode, out);
  } else {
    const DevCtx c = *ctx;
    ok = run(c, buf, sig, base, iters, warmup, nbytes, peer, ping, mode, out);
  }
  out[2] = ok ? 1 : 0;
}

}  // namespace

extern "C" {

int gpunet_bench_pingpong(uint32_t warp_size, const DevCtx* ctx, void* buf, uint64_t* sig,
                          uint64_t base, uint32_t iters, uint32_t warmup, uint32_t nbytes,
                          int32_t peer, uint32_t ping, uint32_t mode, uint64_t* out, void* stream) {
  if (mode > MODE_RAW_PAUSE || (nbytes & 7) != 0) return -1;
  gpunet::LaunchSpec s;
  s.warp_size = warp_size;
  s.stream = stream;
  s.sync = true;
  return gpunet::launch_kernel(s, k_pingpong, ctx, static_cast<uint8_t*>(buf), sig, base, iters,
                               warmup, nbytes, peer, ping, mode, out);
}

}  // extern "C"
