"""The GPU gate's warm-up (scripts/gpu-check.sh runs it first): the library's CUDA kernels
(gpunet.doctor.CUDA_KERNELS) and the test and benchmark kernels the gate builds, compiled in
parallel processes into the kernel cache (gpunet.doctor.prebuild_cuda), so the gate's tests and
benchmarks load them instead of compiling them one after another on a fresh machine's clock. (The
HOST-arm caches are warmed by tests/conftest.py's ``gpunet warmup``.)

    python3 scripts/gpu_warm.py
"""
import sys
import time

from gpunet import doctor
from gpunet.device import loader, testing

# the test and benchmark kernels the GPU gate builds for CUDA (tests/test_*cuda*.py, bench/)
TESTING_KERNELS = ("schedule.cu", "p2p_bench.cu", "proxy.cu")


def sources():
    """Every build the gate's warm-up compiles: the library's .cu files, their variants ((path,
    defines) pairs: doctor.cuda_variants()), then the testing ones."""
    return ([loader.kernels_dir() / k for k in doctor.CUDA_KERNELS] +
            [(loader.kernels_dir() / k, d) for k, d in doctor.cuda_variants()] +
            [testing.kernels_dir() / k for k in TESTING_KERNELS])


def main():
    t0 = time.perf_counter()
    secs = doctor.prebuild_cuda(sources())
    print("gpunet warm-up: CUDA libraries built (%s) in %.1f s"
          % (", ".join("%s %.0f s" % kv for kv in secs.items()), time.perf_counter() - t0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
