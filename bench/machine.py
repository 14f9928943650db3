"""What every benchmark records about the machine it ran on (one helper for all bench/ scripts)."""
import datetime
import os
import platform
import subprocess


def machine(gpu=False):
    """CPU model, cores, load, Python / numpy / numba / torch versions, date; with ``gpu``, the
    GPU name, driver and CUDA version as nvidia-smi and torch report them."""
    import numba
    import numpy as np

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    out = {"node": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
           "loadavg_1min": round(os.getloadavg()[0], 2), "python": platform.python_version(),
           "numpy": np.__version__, "numba": numba.__version__, "platform": platform.platform(),
           "date": datetime.date.today().isoformat()}
    try:
        import torch
        out["torch"] = torch.__version__
        out["cuda"] = torch.version.cuda
    except ImportError:
        pass
    if gpu:
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            if r.returncode == 0 and r.stdout.strip():
                name, drv = [s.strip() for s in r.stdout.strip().splitlines()[0].split(",", 1)]
                out["gpu"], out["driver"] = name, drv
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    return out
