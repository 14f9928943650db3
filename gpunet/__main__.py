"""gpunet's command line: ``python -m gpunet demo`` (the main job), ``ep-demo``, ``selftest``,
``config``, ``doctor``, ``warmup`` or ``ep-shim``."""
import argparse
import sys


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpunet", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("selftest", help="two connected QPs on the soft NIC, every operation, a table")
    sub.add_parser("config", help="every GPUNET_* knob: type, default, the value in effect, doc")
    sub.add_parser("demo", help="N ranks on the soft NIC: ping-pong and bandwidth, both transports",
                   add_help=False)
    sub.add_parser("ep-demo", help="a small MoE layer over N ranks: EP dispatch -> expert MLPs "
                                   "-> combine, checked against one-process torch", add_help=False)
    sub.add_parser("doctor", help="can the stack work on this machine, and why not: platform, "
                                  "toolchains, NICs, loopback checks, measured coherence; a table "
                                  "and JSON", add_help=False)
    warm_p = sub.add_parser("warmup", help="compile numba's caches and the HOST-arm kernels once (a "
                                           "one-rank loopback per NIC transport), so the first run of "
                                           "several ranks does not compile them in every rank at once")
    warm_p.add_argument("--cuda", action="store_true",
                        help="also compile the CUDA arm's kernel libraries (nvcc, in parallel, no GPU "
                             "needed): the GPU machine's first tests and benchmarks then load them")
    sub.add_parser("ep-shim", help="print the folder to put on PYTHONPATH so that `import deep_ep` "
                                   "gives gpunet.ep in every process (a framework's workers too)")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "demo":
        from gpunet.demo import main as demo_main
        return demo_main(rest)
    if args.cmd == "ep-demo":
        from gpunet.ep.demo import main as ep_demo_main
        return ep_demo_main(rest)
    if args.cmd == "doctor":
        from gpunet.doctor import main as doctor_main
        return doctor_main(rest)
    if rest:
        p.error("unrecognized arguments: %s" % " ".join(rest))
    if args.cmd == "config":
        from gpunet.config import table
        print(table())
        return 0
    if args.cmd == "warmup":
        import time
        from gpunet.doctor import warm
        t0 = time.perf_counter()
        if args.cuda:
            from gpunet.doctor import prebuild_cuda
            secs = prebuild_cuda(then=warm)
            print("gpunet warm-up: CUDA libraries built (%s)" % ", ".join(
                "%s %.0f s" % kv for kv in secs.items()))
        else:
            warm()
        print("gpunet warm-up: ibgda and proxy loopbacks ok, compile caches ready (%.1f s)"
              % (time.perf_counter() - t0))
        return 0
    if args.cmd == "ep-shim":
        from gpunet.ep import shim_path
        print(shim_path())
        return 0
    if args.cmd == "selftest":
        from gpunet.selftest import run
        return run()
    return 2


if __name__ == "__main__":
    sys.exit(main())
