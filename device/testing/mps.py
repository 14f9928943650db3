"""Test and benchmark support, not the API: a private CUDA MPS daemon for rank processes that share
one GPU.

Several processes on one GPU are time-sliced by the driver unless an MPS daemon runs (FACTS.md: a
CUDA IPC ping-pong took 4.5 ms a round trip without it, 0.73 us with it). MPS is a user-space
daemon; it changes no GPU setting. :func:`private_mps` starts one with fresh pipe and log folders,
yields the two variables every process of the run must see, and stops it ('quit') at the end,
whatever happens. bench/p2p.py uses it.
"""
import contextlib
import os
import shutil
import subprocess
import tempfile

from gpunet.errors import GpunetError

CONTROL = "nvidia-cuda-mps-control"


def _control(env, text=None, *args):
    return subprocess.run([CONTROL, *args], input=text, env=env, capture_output=True, text=True,
                          timeout=60)


@contextlib.contextmanager
def private_mps():
    """Start a private MPS daemon; yield {"CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"}
    (also exported in this process, so spawned ranks inherit them); stop it on exit. Raises
    GpunetError with nvidia-cuda-mps-control's words when it cannot start or does not answer."""
    dirs = {"CUDA_MPS_PIPE_DIRECTORY": tempfile.mkdtemp(prefix="gpunet-mps-pipe-"),
            "CUDA_MPS_LOG_DIRECTORY": tempfile.mkdtemp(prefix="gpunet-mps-log-")}
    saved = {k: os.environ.get(k) for k in dirs}
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
        os.environ.update(dirs)
        yield dict(dirs)
    finally:
        try:
            if started:
                _control(env, "quit\n")
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            for d in dirs.values():
                shutil.rmtree(d, ignore_errors=True)
