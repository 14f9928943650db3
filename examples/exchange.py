"""A user kernel exchanging data between ranks with gpunet's device API (examples/exchange.cu).

    torchrun --nproc-per-node 2 examples/exchange.py        # 2 ranks (any number works)
    python3 examples/exchange.py --ranks 2                    # the same, spawned from here
    python3 examples/exchange.py                              # 1 rank: it sends to itself

The pieces a user needs, in order: ``gpunet.build_extension`` builds the .cu for this platform's
arm with gpunet's headers; ``ctx.device_context()`` gives the DevCtx pointer, the warp size and
the stream to launch with; the kernel's own extern "C" wrapper launches it; ``ctx.check()``
raises what the kernel recorded (a gpunet.TimeoutError naming the wait, a CompletionError, ...).
On the CPU platform the kernel runs on the HOST arm against the soft NIC; on CUDA on the GPU.
"""
import argparse
import ctypes
import os

import torch

import gpunet

HERE = os.path.dirname(os.path.abspath(__file__))


def load():
    """The example's library for this platform, with its argument types."""
    lib = gpunet.build_extension([os.path.join(HERE, "exchange.cu")])
    f = lib.example_exchange
    u64, vp = ctypes.c_uint64, ctypes.c_void_p
    f.argtypes = [vp, vp, vp, u64, vp, u64, ctypes.c_int, ctypes.c_uint32, vp]
    f.restype = ctypes.c_int
    return lib


def exchange(ctx, n=4096, rounds=3):
    """``rounds`` rounds of the kernel on Context ``ctx``: each rank sends ``n`` floats to the
    next rank and checks what the previous one sent. Returns the number of floats checked."""
    lib = load()
    h = ctx.device_context()
    peer, prev = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
    src = ctx.alloc((n,), torch.float32)
    dst = ctx.alloc((n,), torch.float32)
    sig = ctx.alloc((1,), torch.int64)
    base = torch.arange(n, dtype=torch.float32, device=src.device)
    checked = 0
    try:
        for k in range(1, rounds + 1):
            src.copy_(base + 1000 * ctx.rank + k)
            ctx.barrier()              # every rank's dst is read: the next round may overwrite it
            rc = lib.example_exchange(h.ptr, dst.data_ptr(), src.data_ptr(), n, sig.data_ptr(),
                                      k, peer, h.warp_size, h.stream or None)
            if rc != 0:
                raise gpunet.GpunetError("example_exchange: launch failed (%d)" % rc)
            ctx.check("example_exchange")
            want = base + 1000 * prev + k
            if not torch.equal(dst, want):
                bad = int((dst != want).nonzero()[0, 0])
                raise AssertionError("rank %d round %d: dst[%d] = %r, expected %r (from rank %d)"
                                     % (ctx.rank, k, bad, float(dst[bad]), float(want[bad]), prev))
            checked += n
        ctx.barrier()
    finally:
        for t in (sig, dst, src):
            ctx.free(t)
    return checked


def _rank(rank, world, args):
    with gpunet.init(transport=args.transport) as ctx:
        return exchange(ctx, args.n, args.rounds)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=0, help="spawn this many ranks (default: "
                    "torchrun's, or one)")
    ap.add_argument("--transport", default="auto", choices=["auto", "ibgda", "proxy", "p2p"])
    ap.add_argument("-n", type=int, default=4096, help="floats per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if args.ranks:
        from gpunet.demo import run_ranks

        run_ranks(_rank, args.ranks, args)
        print("exchange: %d ranks OK" % args.ranks)
        return 0
    with gpunet.init(transport=args.transport) as ctx:
        checked = exchange(ctx, args.n, args.rounds)
        print("exchange: rank %d of %d OK (%d floats checked)" % (ctx.rank, ctx.world_size,
                                                                   checked))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
