// Test support, not the API.
// tests/test_weak_signal.py: signal-implies-payload of gpunet::put_signal_nbi to a p2p peer under
// the HOST arm's weak-memory model (host_simt.h). One writer thread stores the payload and the
// signal into the peer's heap (mapped here) through transport/p2p.cuh; every pop of its store
// buffer is chosen by the test (WeakConfig::script: hypothesis draws it), and after every pop
// (WeakConfig::on_pop) and once right after the call returns, an observer reads the peer's memory
// directly, as the peer would: whenever the signal word is non-zero (visible), every payload byte
// must already hold the source's byte. Built twice: as is (must never violate) and with
// -DGPUNET_TEST_P2P_NO_SIGNAL_RELEASE (p2p.cuh omits the release between payload and signal: the
// fence-removal variant, which must violate for some drain order the test finds).
// HOST arm only: the weak model exists nowhere else.
#include <gpunet/gpunet.cuh>

#if !defined(GPUNET_ARM_HOST)
#error "weak_signal.cu tests the HOST arm's weak-memory model"
#endif

namespace {

struct Observe {
  const uint8_t* dst;       // the payload's destination in the peer's heap (mapped here)
  const uint8_t* src;       // what must arrive there
  uint64_t nbytes;
  const uint64_t* sig;      // the signal word in the peer's heap (0 until signalled)
  uint64_t states;          // states inspected
  uint64_t signalled;       // ... in which the signal was visible
  uint64_t violations;      // ... in which it was visible and some payload byte was not
};

void observe(void* arg) {
  Observe* o = static_cast<Observe*>(arg);
  ++o->states;
  if (__atomic_load_n(o->sig, __ATOMIC_ACQUIRE) == 0) return;
  ++o->signalled;
  for (uint64_t i = 0; i < o->nbytes; ++i) {
    if (__atomic_load_n(o->dst + i, __ATOMIC_RELAXED) != o->src[i]) {
      ++o->violations;
      return;
    }
  }
}

GPUNET_GLOBAL void k_put_signal(const gpunet::DevCtx* ctx, void* dst_sym, const void* src,
                                uint64_t nbytes, uint64_t* sig_sym, uint64_t value, uint32_t op,
                                int32_t pe, Observe* obs, uint32_t* ok) {
  *ok = gpunet::put_signal_nbi(*ctx, dst_sym, src, nbytes, sig_sym, value, pe, op) ? 1 : 0;
  observe(obs);  // the state the call left, before any later pop (kernel exit drains the rest)
}

}  // namespace

extern "C" {

// One launch of one weak-mode thread: put_signal_nbi(dst_sym, src, nbytes, sig_sym, value, pe,
// op); `script` (script_len words) chooses the pops, then `seed`'s xorshift. out[0..2] = states,
// signalled, violations. Returns 0, or -1 if the launch threw.
int test_weak_put_signal(const gpunet::DevCtx* ctx, void* dst_sym, const void* src,
                         uint64_t nbytes, uint64_t* sig_sym, uint64_t value, uint32_t op,
                         int32_t pe, const uint8_t* peer_dst, const uint64_t* peer_sig,
                         const uint32_t* script, uint32_t script_len, uint64_t seed,
                         uint32_t* ok, uint64_t* out) {
  Observe obs{peer_dst, static_cast<const uint8_t*>(src), nbytes, peer_sig, 0, 0, 0};
  gpunet::host::LaunchOptions o;
  o.grid = 1;
  o.block = 1;
  o.weak.enabled = true;
  o.weak.seed = seed;
  o.weak.order = gpunet::host::DrainOrder::Random;
  o.weak.script = script;
  o.weak.script_len = script_len;
  o.weak.on_pop = observe;
  o.weak.on_pop_arg = &obs;
  try {
    gpunet::host::launch(o, k_put_signal, ctx, dst_sym, src, nbytes, sig_sym, value, op, pe, &obs,
                         ok);
  } catch (...) {
    return -1;
  }
  out[0] = obs.states;
  out[1] = obs.signalled;
  out[2] = obs.violations;
  return 0;
}

}  // extern "C"
