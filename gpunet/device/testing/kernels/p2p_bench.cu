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
//     MODE_SEND_VERB    put_signal_nbi (as MODE_VERBS) and MODE_RAW_ACQ's wait: with MODE_WAIT_VERB,
//     MODE_WAIT_VERB    MODE_RAW_ACQ's send and wait_until: they split what the verbs add to the
//                       raw floor between the sending and the waiting side.
//     MODE_VERB_PREFETCH as MODE_VERBS, the send preceded by L1 prefetches of the source and of
//                       the peer's PeerDesc (CUDA prefetch.global.L1; elsewhere nothing): is the
//                       verb's extra time its dependent loads after the wait's acquire?
//     MODE_VERBS_HELD   as MODE_VERBS, the peer named by a PeerRef taken once before the loop
//                       (gpunet::peer_ref): the send loads no PeerDesc, so after the wait's
//                       acquire the source's load is the first memory round trip, as in the raw
//                       send. The figure held to the target (what a kernel that waits and puts in
//                       a loop writes; MODE_VERBS beside it is the by-number form).
//     MODE_RAW_ACQ_GPU  as MODE_RAW_ACQ, polling with ld.acquire.gpu (device scope: the writer is a
//                       thread of this GPU) instead of ld.acquire.sys;
//     MODE_RAW_BARE     the machine's floor: no payload, the signal's relaxed (volatile) store and
//                       a relaxed poll (FACTS.md's 0.73 us ping-pong was made so); no ordering;
//     MODE_RAW_FENCE_GPU as MODE_RAW_ACQ_GPU with the signal's release made by fence.acq_rel.gpu
//                       and a relaxed store (fence_gpu is fence.sc.gpu; st.release.gpu is its own
//                       form): which release costs what.
//     MODE_HELD_WAIT_GPU MODE_VERBS_HELD's send and MODE_RAW_ACQ_GPU's wait: what wait_until would
//                       give if it polled a word only this GPU's threads write at device scope.
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
  MODE_SEND_VERB = 5, MODE_WAIT_VERB = 6, MODE_VERB_PREFETCH = 7, MODE_VERBS_HELD = 8,
  MODE_RAW_ACQ_GPU = 9, MODE_RAW_BARE = 10, MODE_RAW_FENCE_GPU = 11, MODE_HELD_WAIT_GPU = 12,
  MODE_LAST = 12,
};
// the raw modes' wait and send (the verbs' are gpunet.cuh's)
GPUNET_DEVICE bool raw_mode(uint32_t m) {
  return (m >= MODE_RAW_ACQ && m <= MODE_WAIT_VERB) || (m >= MODE_RAW_ACQ_GPU && m <= MODE_RAW_FENCE_GPU);
}

// Bounded poll of `word` until it is >= v (raw modes). false (and a recorded timeout) after
// ctx.timeout_ns; the clock is read every 256 polls.
GPUNET_DEVICE bool raw_wait(const DevCtx& ctx, const uint64_t* word, uint64_t v, uint32_t mode) {
  uint64_t t0 = 0;
  for (uint32_t n = 0;; ++n) {
    if (mode == MODE_RAW_RELAXED) {
      if (arch::load_relaxed(word) >= v && arch::load_acquire_sys(word) >= v) return true;
    } else if (mode == MODE_RAW_BARE) {
      if (arch::load_relaxed(word) >= v) return true;
    } else if (mode == MODE_RAW_ACQ_GPU || mode == MODE_RAW_FENCE_GPU || mode == MODE_HELD_WAIT_GPU) {
      if (arch::load_acquire_gpu(word) >= v) return true;
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
                            uint64_t* peer_sig, uint64_t v, uint32_t mode) {
  if (mode == MODE_RAW_BARE) {
    arch::store_relaxed(peer_sig, v);
    return;
  }
  for (uint32_t k = 0; k + 8 <= nbytes; k += 8)
    arch::store_relaxed(reinterpret_cast<uint64_t*>(peer_buf + k),
                        *reinterpret_cast<const uint64_t*>(buf + k));
  if (mode == MODE_RAW_FENCE_GPU) {
#if defined(GPUNET_ARM_CUDA)
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
#else
    arch::fence_gpu();
#endif
    arch::store_relaxed(peer_sig, v);
    return;
  }
  arch::store_release_gpu(peer_sig, v);
}

GPUNET_DEVICE bool run(const DevCtx& c, uint8_t* buf, uint64_t* sig, uint64_t base, uint32_t iters,
                       uint32_t warmup, uint32_t nbytes, int32_t peer, uint32_t ping, uint32_t mode,
                       uint64_t* out) {
  const bool raw = raw_mode(mode);
  const bool verb_send = !raw || mode == MODE_SEND_VERB;
  const bool verb_wait = (!raw && mode != MODE_HELD_WAIT_GPU) || mode == MODE_WAIT_VERB;
  const gpunet::PeerRef held = gpunet::peer_ref(c, peer);  // MODE_VERBS_HELD's
  const void* peer_desc = gpunet::api::peers(c) + peer;
  (void)peer_desc;  // read by MODE_VERB_PREFETCH on CUDA only
  const uint32_t poll = mode == MODE_SEND_VERB || mode == MODE_WAIT_VERB ? uint32_t(MODE_RAW_ACQ) : mode;
  uint8_t* peer_buf = static_cast<uint8_t*>(gpunet::ptr(c, buf, peer));
  uint64_t* peer_sig = static_cast<uint64_t*>(gpunet::ptr(c, sig, peer));
  bool ok = !raw || (peer_buf && peer_sig);
  // one leg: send (sig word `to` on the peer) or wait (own word `from`), verb or raw per mode
  auto send = [&](uint32_t to, uint64_t v) {
#if defined(GPUNET_ARM_CUDA)
    if (mode == MODE_VERB_PREFETCH) {
      asm volatile("prefetch.global.L1 [%0];" ::"l"(buf));
      asm volatile("prefetch.global.L1 [%0];" ::"l"(peer_desc));
    }
#endif
    if (mode == MODE_VERBS_HELD || mode == MODE_HELD_WAIT_GPU)
      return gpunet::put_signal_nbi(c, buf, buf, nbytes, &sig[to], v, held, gpunet::SIGNAL_SET);
    if (verb_send)
      return gpunet::put_signal_nbi(c, buf, buf, nbytes, &sig[to], v, peer, gpunet::SIGNAL_SET);
    raw_send(peer_buf, buf, nbytes, &peer_sig[to], v, mode);
    return true;
  };
  auto wait = [&](uint32_t from, uint64_t v) {
    return verb_wait ? gpunet::wait_until(c, &sig[from], gpunet::CMP_GE, v)
                     : raw_wait(c, &sig[from], v, poll);
  };
  uint64_t t0 = arch::now_ns();
  for (uint32_t i = 1; i <= iters && ok; ++i) {
    if (ping && i == warmup + 1) t0 = arch::now_ns();
    const uint64_t v = base + i;
    if (ping) ok = send(0, v) && wait(1, v);
    else ok = wait(0, v) && send(1, v);
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
  if (mode > MODE_LAST || (nbytes & 7) != 0) return -1;
  gpunet::LaunchSpec s;
  s.warp_size = warp_size;
  s.stream = stream;
  s.sync = true;
  return gpunet::launch_kernel(s, k_pingpong, ctx, static_cast<uint8_t*>(buf), sig, base, iters,
                               warmup, nbytes, peer, ping, mode, out);
}

}  // extern "C"
