"""Test and benchmark support, not the API: a private CUDA MPS daemon for rank processes that share
one GPU.

Several processes on one GPU are time-sliced by the driver unless an MPS daemon runs (FACTS.md: a
CUDA IPC ping-pong took 4.5 ms a round trip without it, 0.73 us with it). MPS is a user-space
daemon; it changes no GPU setting. :func:`private_mps` starts one with fresh pipe and log folders,
yields the two variables every process of the run must see, and stops it ('quit') at the end,
whatever happens. bench/p2p.py and tests/test_p2p_cuda.py use it; a shell script runs a command
under one with ``python3 -m gpunet.device.testing.mps -- COMMAND ...`` (exit status: the
command's).
"""
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile

from gpunet import config
from gpunet.errors import GpunetError

CONTROL = "nvidia-cuda-mps-control"


def _control(env, text=None, *args):
    return subprocess.run([CONTROL, *args], input=text, env=env, capture_output=True, text=True,
                          timeout=60)


@contextlib.contextmanager
def private_mps(export=True):
    """Start a private MPS daemon; yield {"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"}
    (with ``export``, also set in this process's environment until the end, so spawned ranks
    inherit them; else the caller passes them on); stop it on exit. Raises GpunetError with
    nvidia-cuda-mps-control's words when it cannot start or does not answer."""
    dirs = {"CUDA_MPS_PIPE_DIRECTORY": tempfile.mkdtemp(prefix="gpunet-mps-pipe-"),
            "CUDA_MPS_LOG_DIRECTORY": tempfile.mkdtemp(prefix="gpunet-mps-log-")}
    env = dict(os.environ, **dirs)
    started = False
    try:
        try:
            r = _control(env, None, "-d")
        except (OSError, subprocess.SubprocessError) as e:
            raise GpunetError("the MPS daemon did not start: %s -d: %s" % (CONTROL, e)) from e
        if r.returncode != 0:
            raise GpunetError("the MPS daemon did not start: %s -d exited %d: %s %s"
                              % (CONTROL, r.returncode, r.stdout, r.stderr))
        started = True
        up = _control(env, "get_server_list\n")
        if up.returncode != 0:
            raise GpunetError("the MPS daemon does not answer (get_server_list exited %d: %s %s)"
                              % (up.returncode, up.stdout, up.stderr))
        with config.environ(dirs if export else {}):
            yield dict(dirs)
    finally:
        try:
            if started:
                _control(env, "quit\n")
        finally:
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)


def main(argv):
    """``-- COMMAND ...``: run COMMAND under a private daemon; returns its exit status."""
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python3 -m gpunet.device.testing.mps -- COMMAND ...", file=sys.stderr)
        return 2
    try:
        with private_mps():
            return subprocess.run(argv).returncode
    except GpunetError as e:
        print(str(e), file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
