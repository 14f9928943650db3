"""gpunet's knobs in one table: every ``GPUNET_*`` environment variable and build define, with its
type, default and one line of doc. ``python -m gpunet config`` prints it with the values in effect.

Ground floor: this module imports nothing from gpunet (errors are raised as ValueError and the
callers wrap them), so every layer may read its knobs here. Environment variables are read when
asked for (``get``), not at import, so tests that change the environment see the change.
tests/test_config.py checks that every ``GPUNET_*`` name in the sources is in this table.
"""
import contextlib
import os
from typing import NamedTuple


class Knob(NamedTuple):
    name: str
    kind: str        # "env": read from the environment at run time; "define": a C++ build define
    type: str        # "choice" | "int" | "path" | "str" | "flag"
    default: object  # what applies when unset (None: detected / searched, see doc)
    choices: tuple   # allowed values of a "choice" knob
    doc: str


KNOBS = (
    # --- environment: platform and toolchain ---------------------------------------------------
    Knob("GPUNET_PLATFORM", "env", "choice", None, ("cpu", "cuda", "maca"),
         "skip platform detection (default: detected from torch and the runtimes present)"),
    Knob("GPUNET_PROFILE", "env", "choice", None, ("nvidia", "c500"),
         "coherence model of the soft NIC on the CPU or CUDA platform (default: nvidia; MACA is c500)"),
    Knob("GPUNET_SOFTNIC_ATOMIC_ENDIANNESS", "env", "choice", "host", ("host", "big"),
         "the soft NIC's 8-byte atomics (and so signal words): native order, or big-endian (IB wire)"),
    Knob("GPUNET_HEAP_MEMORY", "env", "choice", "auto", ("auto", "device"),
         "the symmetric heap's memory: auto (CUDA: device memory when a peer may be p2p, else "
         "host-mapped; CPU: the soft NIC's arena) or device (device memory for every world: on CUDA "
         "the soft NIC's engine then copies with the CUDA runtime, which stalls while the caller "
         "is in a .cpu() behind a kernel that waits for NIC data (bench/copy_engine_stall.py): "
         "wait with torch.cuda.synchronize() first; on "
         "the CPU the arena heap is registered with the soft NIC as device memory, so its engine "
         "moves every byte of it through the copy-engine hook: the CUDA device-heap paths' test "
         "bench)"),
    Knob("GPUNET_QP_POST_MODE", "env", "choice", "batched", ("batched", "serial"),
         "posting mode of every ibgda peer's QP (qp.cuh \"Posting modes\"): batched (any number "
         "of warps, one doorbell for several posts) or serial (the fewest round trips when one "
         "warp at a time posts to each peer; several still work but ring one after another)"),
    Knob("GPUNET_EP_KERNEL_BUILD", "env", "choice", "world", ("world", "all"),
         "gpunet.ep's kernels: world (a world whose peers are all p2p runs a build with the p2p "
         "transport only, half the code: devctx.cuh GPUNET_TRANSPORTS) or all (every world runs "
         "the build with every transport: the A/B of bench/ep_profile.py)"),
    Knob("GPUNET_EP_LL_DIRECT", "env", "choice", "0", ("0", "1"),
         "gpunet.ep's LL dispatch with a receive pool and every peer p2p on one GPU: 1 stores each "
         "row straight into its packed row on the destination after a count round (ll.cuh \"The "
         "direct dispatch\"; measured slower than the messages on the H100 as first built, "
         "bench/RESULTS.md thirty-second session), 0 sends messages the receiver unpacks"),
    Knob("GPUNET_EP_HT_PRELAUNCH", "env", "choice", "1", ("0", "1"),
         "gpunet.ep's high-throughput dispatch after the first of its kind: 1 launches the data "
         "phase right behind the notify into receive tensors sized from the last call's rows (it "
         "runs when they fit, else the host launches it again: ht.cuh run_ht; on a GPU only in "
         "worlds whose other ranks are all p2p), 0 launches it once the host has read the counts"),
    Knob("GPUNET_EP_HT_PULL", "env", "choice", "1", ("0", "1"),
         "gpunet.ep's high-throughput combine whose x (and topk_weights) lie in the receive pool (the "
         "dispatch's recv_x): 1 lets peers that can load from this rank's heap (p2p, not the c500 "
         "profile) read their rows in place (ht.cuh \"the in-place combine\"), 0 sends them through "
         "the rings"),
    Knob("GPUNET_EP_HT_SPLIT", "env", "choice", "1", ("0", "1"),
         "gpunet.ep's in-place high-throughput combine: 1 lets a channel's sender block, when every "
         "row it sends and its channel receives goes in place, reduce half the channel's tokens "
         "(ht.cuh \"the split in-place combine\"), 0 leaves the whole reduce to the receiver block"),
    Knob("GPUNET_WARP_SIZE", "env", "choice", None, ("32", "64"),
         "the HOST arm's warp size (default 32; GPUs use their own: 32 CUDA, 64 MACA)"),
    Knob("GPUNET_RUNTIME_LIB", "env", "path", None, (),
         "path of libcudart / libmcruntime to load (default: searched under CUDA_HOME, MACA_PATH, ...)"),
    Knob("GPUNET_CACHE_DIR", "env", "path", "~/.cache/gpunet", (),
         "where built device libraries are cached (keyed by a hash of sources, flags and compiler)"),
    Knob("GPUNET_HOST_CXX", "env", "str", "g++", (), "C++ compiler of the HOST arm"),
    Knob("GPUNET_NVCC", "env", "str", "nvcc", (), "CUDA compiler (falls back to /usr/local/cuda/bin/nvcc)"),
    Knob("GPUNET_MXCC", "env", "str", "mxcc", (), "MACA compiler (falls back to $MACA_PATH/mxgpu_llvm/bin)"),
    Knob("GPUNET_CUDA_ARCH", "env", "str", "sm_90", (), "nvcc -arch of the CUDA arm"),
    Knob("GPUNET_HOST_MAX_THREADS", "env", "int", 1024, (),
         "HOST arm: most OS threads one emulated launch may start (read by host_simt.h)"),
    Knob("GPUNET_SKIP_APT", "env", "flag", "0", ("0", "1"),
         "scripts/install.sh: 1 skips the apt step (no root, or packages already there)"),
    # --- build defines (pass with gpunet/device/loader.py build(defines=...)) --------------------------
    Knob("GPUNET_WARP_MIN_CHUNK", "define", "int", 256, (),
         "put_nbi_warp: smallest chunk one lane posts (a WQE per few bytes costs NIC work)"),
    Knob("GPUNET_TRANSPORTS", "define", "int", 14, (),
         "devctx.cuh: the transports a unit is built with, bit k for kind k (14: ibgda, proxy, "
         "p2p; 8: p2p only); a verb to a PE of a kind left out records SITE_PEER_KIND"),
    Knob("GPUNET_MACA_CLOCK_MHZ", "define", "int", 1500, (),
         "MACA arm: clock64() rate used to turn device timeouts into ticks (unverified)"),
    Knob("GPUNET_TEST_DELAY_POINTS", "define", "flag", None, (),
         "tests: spin pauses where real hardware may stall, to widen race windows"),
    Knob("GPUNET_TEST_RELAXED_PUBLISH", "define", "flag", None, (),
         "tests: a deliberately broken publish (the ordering tests must catch it)"),
    Knob("GPUNET_TEST_DROP_DOORBELL_FENCE", "define", "flag", None, (),
         "tests: the doorbell fence removed (the weak-memory tests must catch it)"),
    Knob("GPUNET_TEST_PLAIN_HANDOFF", "define", "flag", None, (),
         "tests: the doorbell turn left with a plain store, not the CAS (must be caught)"),
    Knob("GPUNET_TEST_NO_LAP_CHECK", "define", "flag", None, (),
         "tests: a late owner's leave takes a later lap's tag or marker (qp.cuh \"The late leave\"; must be caught)"),
    Knob("GPUNET_TEST_HT_NOTIFY_STALL_NS", "define", "int", None, (),
         "tests: the HT notify's block 0 stalls this long between reading the peers' headers and "
         "reading them again (ht.cuh ht_rhdr: a slow third source's window)"),
    Knob("GPUNET_TEST_HT_PULL_STALL_NS", "define", "int", None, (),
         "tests: the in-place HT combine's token side stalls this long after its loads and before its "
         "final credit (ht.cuh ht_recv_combine: the sender gives it up and revokes its rows)"),
    Knob("GPUNET_TEST_LL_EXIT_AFTER_COUNTS", "define", "flag", None, (),
         "tests: the HOST arm's direct LL dispatch exits the process after its count round, before "
         "any row (ll.cuh direct_counts: the receivers' rows to move down)"),
    Knob("GPUNET_POST_STAMP", "define", "str", None, (),
         "qp.cuh's phase-stamp hook (k): nothing unless an includer defines it (post_rate.cu)"),
    Knob("GPUNET_BENCH_PHASES", "define", "flag", None, (),
         "bench: post_rate.cu clocks each posting phase (bench/device_post.py --phases)"),
    Knob("GPUNET_TEST_P2P_NO_SIGNAL_RELEASE", "define", "flag", None, (),
         "tests: p2p put_signal without the release between payload and signal (must be caught)"),
    Knob("GPUNET_SYNTAX_CHECK_ONLY", "define", "flag", None, (),
         "tests: type-check the MACA arm with g++ against declared stand-ins"),
)

_BY_NAME = {k.name: k for k in KNOBS}


def knob(name):
    """The table entry of ``name`` (KeyError if gpunet has no such knob)."""
    return _BY_NAME[name]


def get(name):
    """The value in effect for environment knob ``name``: the variable if set and non-empty
    (checked against its type: ValueError names the allowed values), else the default."""
    k = _BY_NAME[name]
    if k.kind != "env":
        raise KeyError("%s is a build define, not an environment variable" % name)
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return os.path.expanduser(k.default) if k.type == "path" and k.default else k.default
    val = raw.strip()
    if k.type == "choice" or k.type == "flag":
        val = val.lower()
        if k.choices and val not in k.choices:
            raise ValueError("%s=%r is not valid; use one of %s" % (name, raw, ", ".join(k.choices)))
    elif k.type == "int":
        try:
            val = int(val)
        except ValueError:
            raise ValueError("%s=%r is not an integer" % (name, raw)) from None
        if val <= 0:
            raise ValueError("%s=%r must be positive" % (name, raw))
    elif k.type == "path":
        val = os.path.expanduser(val)
    return val


def is_set(name):
    """True when environment knob ``name`` is set to a non-empty value."""
    return bool(os.environ.get(name, "").strip())


@contextlib.contextmanager
def environ(values):
    """Set the environment variables of ``values`` (a None value leaves that one as it is) for
    the ``with`` block, then restore every one of them as it was (unset again if it was unset)."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        os.environ.update({k: v for k, v in values.items() if v is not None})
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def table():
    """The table as text: name, kind, type, default, value in effect (env knobs), doc."""
    rows = []
    for k in KNOBS:
        if k.kind == "env":
            try:
                now = get(k.name)
            except ValueError as e:
                now = "INVALID (%s)" % e
            now = "%s%s" % (now, " (set)" if is_set(k.name) else "")
        else:
            now = "-"
        rows.append((k.name, k.kind, k.type, "unset" if k.default is None else str(k.default),
                     str(now), k.doc))
    widths = [max(len(r[i]) for r in rows + [("knob", "kind", "type", "default", "in effect", "")])
              for i in range(5)]
    head = ("knob", "kind", "type", "default", "in effect")
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths)) + "  doc"]
    for r in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
    return "\n".join(out)
