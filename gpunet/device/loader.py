"""Compile gpunet device sources into shared libraries and bind them with ctypes.

One entry point, :func:`build`, for the three arms of ``gpunet/device/include/gpunet/arch.cuh``:

- ``host``: g++ (C++17), ``-DGPUNET_ARCH_HOST``: the device code runs on CPU threads under the SIMT
  emulator of ``host_simt.h``. What CI uses.
- ``cuda``: nvcc, ``-arch=$GPUNET_CUDA_ARCH`` (default ``sm_90``).
- ``maca``: mxcc ``-x maca ... --maca-path=$MACA_PATH``, linked with mcruntime (FACTS.md). UNVERIFIED:
  no MACA toolchain has been available to run this command.

Sources expose ``extern "C"`` launchers (see ``gpunet::launch_kernel`` in arch.cuh). Libraries are cached
in ``$GPUNET_CACHE_DIR`` (default ``~/.cache/gpunet``) under a SHA-256 of everything that can change the
binary: the sources' contents, every header under ``gpunet/device/include`` and the extra include dirs, the
full command line and the compiler's version. Builds write a temporary file and rename it into place,
so parallel test processes never load a half-written library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from gpunet import config
from gpunet.errors import ConfigError, ToolchainError

__all__ = ["build", "include_dir", "kernels_dir", "cache_dir", "ARCHS"]

ARCHS = ("host", "cuda", "maca")

_HEADER_SUFFIXES = (".h", ".hpp", ".cuh", ".inc")
_DEVICE_DIR = Path(__file__).resolve().parent

# path of the library -> CDLL: a process loads each library once.
_loaded: dict[str, ctypes.CDLL] = {}
_lock = threading.Lock()
# Number of compiler runs in this process (tests check that a cached build does not compile).
compile_count = 0


def include_dir() -> Path:
    """``gpunet/device/include``: the directory to pass as ``-I`` so that ``#include <gpunet/arch.cuh>`` works."""
    return _DEVICE_DIR / "include"


def kernels_dir() -> Path:
    """``gpunet/device/kernels``: gpunet's own kernel sources."""
    return _DEVICE_DIR / "kernels"


def cache_dir() -> Path:
    """Where built libraries live: ``$GPUNET_CACHE_DIR``, else ``~/.cache/gpunet``."""
    return Path(config.get("GPUNET_CACHE_DIR"))


def _find_compiler(arch: str) -> str:
    """The compiler's path for `arch`, or ToolchainError saying what to install."""
    if arch == "host":
        env, hint = "GPUNET_HOST_CXX", "install g++ (Debian/Ubuntu: apt-get install g++)"
    elif arch == "cuda":
        env, hint = "GPUNET_NVCC", "install the CUDA toolkit (nvcc) and put it on PATH"
    else:
        env, hint = "GPUNET_MXCC", "install the MACA SDK (mxcc) and set MACA_PATH"
    chosen = config.get(env)
    path = shutil.which(chosen)
    if path is None and arch == "cuda" and not config.is_set(env):
        fallback = Path("/usr/local/cuda/bin/nvcc")
        path = str(fallback) if fallback.exists() else None
    if path is None and arch == "maca" and not config.is_set(env):
        fallback = Path(os.environ.get("MACA_PATH", "/opt/maca")) / "mxgpu_llvm" / "bin" / "mxcc"
        path = str(fallback) if fallback.exists() else None
    if path is None:
        raise ToolchainError(
            f"{arch} build needs the compiler {chosen!r}, which was not found: {hint}, "
            f"or point ${env} at it."
        )
    return path


def _compiler_version(compiler: str) -> str:
    try:
        res = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60)
    except OSError as exc:
        raise ToolchainError(f"cannot run {compiler} --version: {exc}") from exc
    return res.stdout + res.stderr


def _command(
    arch: str,
    compiler: str,
    sources: Sequence[Path],
    defines: Mapping[str, object],
    include_dirs: Sequence[Path],
    extra_flags: Sequence[str],
    output: str,
) -> list[str]:
    defs = [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in sorted(defines.items())]
    incs = [f"-I{d}" for d in include_dirs]
    srcs = [str(s) for s in sources]
    if arch == "host":
        # -x c++: kernels are .cu files, compiled as plain C++ on this arm.
        return [compiler, "-O2", "-std=c++17", "-fPIC", "-shared", "-pthread", "-DGPUNET_ARCH_HOST",
                *defs, *incs, *extra_flags, "-o", output, "-x", "c++", *srcs]
    if arch == "cuda":
        cuda_arch = config.get("GPUNET_CUDA_ARCH")
        return [compiler, "-std=c++17", "-O3", "-Xcompiler", "-fPIC", "-shared", f"-arch={cuda_arch}",
                *defs, *incs, *extra_flags, "-o", output, "-x", "cu", *srcs]
    # maca — UNVERIFIED (FACTS.md: "mxcc -x maca f.cpp --maca-path=$MACA_PATH", link mcruntime).
    maca_path = os.environ.get("MACA_PATH", "/opt/maca")
    return [compiler, "-std=c++17", "-O3", "-fPIC", "-shared", "-DGPUNET_ARCH_MACA",
            f"--maca-path={maca_path}", *defs, *incs, *extra_flags, "-o", output, "-x", "maca", *srcs,
            f"-L{maca_path}/lib", "-lmcruntime"]


def _headers(dirs: Iterable[Path]) -> list[Path]:
    out: list[Path] = []
    for d in dirs:
        if d.is_dir():
            out.extend(sorted(p for p in d.rglob("*") if p.is_file() and p.suffix in _HEADER_SUFFIXES))
    return out


def build(
    sources: Sequence[str | os.PathLike],
    arch: str = "host",
    defines: Mapping[str, object] | None = None,
    include_dirs: Sequence[str | os.PathLike] | None = None,
    extra_flags: Sequence[str] | None = None,
) -> ctypes.CDLL:
    """Compile `sources` into one shared library for `arch` (cached) and load it.

    Args:
        sources: C++/CUDA source files (``.cu`` or ``.cpp``) with ``extern "C"`` launchers.
        arch: ``"host"`` (g++, SIMT emulator), ``"cuda"`` (nvcc) or ``"maca"`` (mxcc, unverified).
        defines: ``{"NAME": value}`` becomes ``-DNAME=value`` (``None`` as value: ``-DNAME``).
        include_dirs: extra ``-I`` directories (after ``gpunet/device/include``); their headers are hashed.
        extra_flags: passed to the compiler verbatim, before the sources.

    Returns:
        The ``ctypes.CDLL``; its attributes ``gpunet_path`` (the library file) and ``gpunet_compiled``
        (True if this call ran the compiler) say how it was obtained. Set argtypes before calling.

    Raises:
        ConfigError: unknown arch or a missing source file.
        ToolchainError: the compiler is missing (the message says what to install) or the compile
            failed (the message carries the compiler's stderr).
    """
    global compile_count
    if arch not in ARCHS:
        raise ConfigError(f"arch must be one of {ARCHS}, not {arch!r}")
    srcs = [Path(s).resolve() for s in sources]
    if not srcs:
        raise ConfigError("build() needs at least one source file")
    for s in srcs:
        if not s.is_file():
            raise ConfigError(f"device source not found: {s}")
    incs = [include_dir(), *(Path(d).resolve() for d in (include_dirs or ()))]
    defines = dict(defines or {})
    extra = list(extra_flags or ())

    compiler = _find_compiler(arch)
    version = _compiler_version(compiler)

    h = hashlib.sha256()
    h.update(arch.encode())
    h.update(version.encode())
    # The command with a fixed output name: flags, defines, include dirs, source paths' order.
    for part in _command(arch, compiler, srcs, defines, incs, extra, "OUT"):
        h.update(part.encode() + b"\0")
    for s in srcs:
        h.update(s.read_bytes() + b"\0")
    for hdr in _headers(incs):
        h.update(str(hdr).encode() + b"\0" + hdr.read_bytes() + b"\0")
    key = h.hexdigest()

    cdir = cache_dir()
    cdir.mkdir(parents=True, exist_ok=True)
    lib_path = cdir / f"{srcs[0].stem}-{arch}-{key[:24]}.so"

    with _lock:
        if str(lib_path) in _loaded:
            lib = _loaded[str(lib_path)]
            lib.gpunet_compiled = False
            return lib
        compiled = False
        if not lib_path.exists():
            fd, tmp = tempfile.mkstemp(dir=cdir, prefix=f".{lib_path.stem}.", suffix=".so.tmp")
            os.close(fd)
            try:
                cmd = _command(arch, compiler, srcs, defines, incs, extra, tmp)
                try:
                    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                except OSError as exc:
                    raise ToolchainError(f"cannot run {compiler}: {exc}") from exc
                compile_count += 1
                if res.returncode != 0:
                    raise ToolchainError(
                        f"{arch} compile failed ({Path(compiler).name}, exit {res.returncode}):\n"
                        f"$ {' '.join(cmd)}\n{res.stderr}{res.stdout}"
                    )
                os.replace(tmp, lib_path)  # atomic: another process sees the old state or the whole file
                compiled = True
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(lib_path))
        lib.gpunet_path = lib_path
        lib.gpunet_compiled = compiled
        _loaded[str(lib_path)] = lib
        return lib
