"""gpunet's command line: ``python -m gpunet selftest``."""
import argparse
import sys


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpunet", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("selftest", help="two connected QPs on the soft NIC, every operation, a table")
    args = p.parse_args(argv)
    if args.cmd == "selftest":
        from gpunet.selftest import run
        return run()
    return 2


if __name__ == "__main__":
    sys.exit(main())
