"""Platform detection, environment overrides, memory kinds and the coherence policy table.

The CPU tests run everywhere. Tests marked ``cuda`` run only where torch sees a CUDA GPU (the
lead's H200 box): they exercise each memory kind, host registration and dma-buf export for real.
"""
import ctypes
import mmap
import os

import numpy as np
import pytest
import torch

from gpunet.errors import ConfigError, ToolchainError
from gpunet.host import platform as P

_ENV = ("GPUNET_PLATFORM", "GPUNET_PROFILE", "GPUNET_WARP_SIZE", "GPUNET_RUNTIME_LIB")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available() or bool(getattr(torch.version, "hip", None)),
                               reason="needs an NVIDIA GPU (torch.cuda); not on this machine")


@pytest.fixture(autouse=True)
def clean_platform(monkeypatch):
    """Each test starts from an undetected platform and no gpunet environment overrides."""
    for v in _ENV:
        monkeypatch.delenv(v, raising=False)
    P.reset_platform()
    yield
    P.reset_platform()


# -- detection and overrides -------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_detects_cpu_without_gpu():
    """Without a GPU the platform is cpu, profile nvidia, warp 32, and the choice is cached."""
    p = P.get_platform()
    assert (p.name, p.profile, p.warp_size) == ("cpu", "nvidia", 32)
    assert "is_available" in p.detected_by
    assert P.get_platform() is p


def test_cpu_profile_and_warp_overrides(monkeypatch):
    """GPUNET_PROFILE=c500 and GPUNET_WARP_SIZE=64 shape the CPU platform."""
    monkeypatch.setenv("GPUNET_PLATFORM", "cpu")
    monkeypatch.setenv("GPUNET_PROFILE", "c500")
    monkeypatch.setenv("GPUNET_WARP_SIZE", "64")
    p = P.get_platform()
    assert (p.name, p.profile, p.warp_size) == ("cpu", "c500", 64)
    assert p.policy("payload_src").kind == "finegrained"


@pytest.mark.parametrize("name,profile,warp", [("cuda", "nvidia", 32), ("maca", "c500", 64)])
def test_platform_override_sets_profile_and_warp(monkeypatch, name, profile, warp):
    """GPUNET_PLATFORM forces the platform; profile and warp size follow the hardware."""
    monkeypatch.setenv("GPUNET_PLATFORM", name)
    p = P.get_platform()
    assert (p.name, p.profile, p.warp_size, p.detected_by) == (name, profile, warp, "GPUNET_PLATFORM")


@pytest.mark.parametrize("var,value", [("GPUNET_PLATFORM", "rocm"), ("GPUNET_PROFILE", "amd"),
                                       ("GPUNET_WARP_SIZE", "48")])
def test_bad_environment_values_raise_config_error(monkeypatch, var, value):
    """An invalid override raises ConfigError naming the variable and the valid values."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=var):
        P.get_platform()


def test_unsafe_overrides_on_gpu_platforms_are_refused(monkeypatch):
    """profile nvidia on MACA, or a warp size contradicting the hardware, raise ConfigError."""
    monkeypatch.setenv("GPUNET_PLATFORM", "maca")
    monkeypatch.setenv("GPUNET_PROFILE", "nvidia")
    with pytest.raises(ConfigError, match="unsafe on MACA"):
        P.get_platform()
    P.reset_platform()
    monkeypatch.setenv("GPUNET_PLATFORM", "cuda")
    monkeypatch.delenv("GPUNET_PROFILE")
    monkeypatch.setenv("GPUNET_WARP_SIZE", "64")
    with pytest.raises(ConfigError, match="contradicts"):
        P.get_platform()


# -- the coherence policy table ----------------------------------------------------------------

@pytest.mark.parametrize("profile", P.PROFILES)
def test_policy_table_is_complete(profile):
    """Every role has a valid kind and a non-empty reason under every profile, and nothing else."""
    table = P.COHERENCE_POLICY[profile]
    assert set(table) == set(P.ROLES)
    for role in P.ROLES:
        kind, reason = table[role]
        assert kind in P.KINDS, (profile, role, kind)
        assert isinstance(reason, str) and len(reason.strip()) > 40, (profile, role)


def test_c500_policy_puts_rings_in_host_and_nic_payload_in_finegrained():
    """c500: SQ/CQ/DBR/proxy FIFO in host memory (Mooncake), NIC-touched data finegrained,
    compute in device memory (finegrained reads cost ~57% more)."""
    c500 = P.COHERENCE_POLICY["c500"]
    for role in ("sq", "cq", "dbrec", "proxy_fifo"):
        assert c500[role].kind == "host", role
    for role in ("payload_src", "payload_dst", "signal"):
        assert c500[role].kind == "finegrained", role
    assert c500["compute"].kind == "device" and "57%" in c500["compute"].reason
    assert "Mooncake" in c500["sq"].reason and "stale" in c500["payload_src"].reason


def test_nvidia_policy_keeps_payload_in_device_memory():
    """nvidia: payload and signals in device memory (coherent), rings host-mapped by choice."""
    nv = P.COHERENCE_POLICY["nvidia"]
    for role in ("payload_src", "payload_dst", "signal", "compute"):
        assert nv[role].kind == "device", role
    for role in ("sq", "cq", "dbrec"):
        assert nv[role].kind == "host" and "choice" in nv[role].reason, role


def test_policy_accessor_uses_platform_profile(monkeypatch):
    """policy(role) follows the current platform's profile; unknown roles raise ConfigError."""
    monkeypatch.setenv("GPUNET_PLATFORM", "cpu")
    assert P.policy("payload_src") == P.COHERENCE_POLICY["nvidia"]["payload_src"]
    monkeypatch.setenv("GPUNET_PROFILE", "c500")
    P.reset_platform()
    assert P.policy("payload_src").kind == "finegrained"
    with pytest.raises(ConfigError, match="unknown buffer role"):
        P.policy("doorbell_typo")
    with pytest.raises(ConfigError, match="profile"):
        P.policy("sq", profile="h100")


# -- memory on the CPU platform ----------------------------------------------------------------

@pytest.mark.parametrize("kind", P.KINDS)
def test_cpu_alloc_every_kind_is_shared_zeroed_memory(monkeypatch, kind):
    """On the CPU each kind is a zeroed, page-aligned shared mapping with ptr == host_ptr."""
    monkeypatch.setenv("GPUNET_PLATFORM", "cpu")
    p = P.get_platform()
    with p.alloc(kind, 10000) as a:
        assert a.kind == kind and a.ptr == a.host_ptr and a.ptr % mmap.PAGESIZE == 0
        v = a.view()
        assert v.shape == (10000,) and not v.any()
        v[:] = np.arange(10000) % 251
        out = np.empty(10000, np.uint8)
        p.memcpy(out.ctypes.data, a.ptr, 10000)
        assert (out == v).all()
        assert p.host_register(a.ptr, 4096) == a.ptr
        p.host_unregister(a.ptr)
        del v
    assert a.closed
    a.close()  # idempotent
    with pytest.raises(ConfigError, match="not allocated"):
        p.free(a.ptr)


def test_cpu_alloc_rejects_bad_arguments_and_has_no_dmabuf(monkeypatch):
    """Unknown kinds, non-positive sizes and dma-buf export on the CPU raise ConfigError."""
    monkeypatch.setenv("GPUNET_PLATFORM", "cpu")
    p = P.get_platform()
    with pytest.raises(ConfigError, match="unknown memory kind"):
        p.alloc("uncached", 64)
    with pytest.raises(ConfigError, match="positive"):
        p.alloc("host", 0)
    with pytest.raises(ConfigError, match="dma-buf"):
        p.dmabuf_fd(0x1000, 4096)


# -- vendor runtimes ---------------------------------------------------------------------------

def test_missing_maca_runtime_raises_toolchain_error_naming_it(monkeypatch, tmp_path):
    """MACA forced on a machine without MACA: alloc raises ToolchainError naming libmcruntime.so."""
    monkeypatch.setenv("GPUNET_PLATFORM", "maca")
    monkeypatch.setenv("MACA_PATH", str(tmp_path))
    p = P.get_platform()
    if P._mapped_libraries("libmcruntime") or os.path.exists("/opt/maca/lib/libmcruntime.so"):
        pytest.skip("a MACA runtime is installed here")
    with pytest.raises(ToolchainError, match=r"libmcruntime\.so.*GPUNET_PLATFORM=cpu"):
        p.alloc("finegrained", 4096)


def test_forced_runtime_path_missing_raises_toolchain_error(monkeypatch):
    """GPUNET_RUNTIME_LIB pointing nowhere: ToolchainError names libcudart.so and the path."""
    monkeypatch.setenv("GPUNET_PLATFORM", "cuda")
    monkeypatch.setenv("GPUNET_RUNTIME_LIB", "/nonexistent/libcudart.so.99")
    with pytest.raises(ToolchainError, match=r"libcudart\.so.*/nonexistent/libcudart\.so\.99"):
        P.get_platform().alloc("device", 4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_runtime_without_gpu_reports_the_error_code(monkeypatch):
    """A CUDA runtime but no GPU: alloc / host_register raise VendorRuntimeError with the code."""
    monkeypatch.setenv("GPUNET_PLATFORM", "cuda")
    p = P.get_platform()
    try:
        p.runtime()
    except ToolchainError:
        pytest.skip("no libcudart on this machine")
    with pytest.raises(P.VendorRuntimeError) as ei:
        p.alloc("device", 4096)
    assert ei.value.call == "cudaMalloc" and ei.value.code not in (None, 0)
    buf = mmap.mmap(-1, 4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    with pytest.raises(P.VendorRuntimeError) as ei:
        p.host_register(addr, 4096, io_memory=True)
    assert ei.value.call == "cudaHostRegister" and "I/O" in str(ei.value)


# -- on a CUDA GPU (skipped here) --------------------------------------------------------------

@cuda_only
@pytest.mark.parametrize("kind", P.KINDS)
def test_cuda_alloc_each_kind_round_trips_bytes(kind):
    """Each kind allocates on the GPU, and bytes copied in come back out unchanged."""
    p = P.get_platform()
    assert p.name == "cuda"
    n = 1 << 20
    src = (np.arange(n) % 253).astype(np.uint8)
    dst = np.zeros(n, np.uint8)
    with p.alloc(kind, n) as a:
        p.memcpy(a.ptr, src.ctypes.data, n)
        p.memcpy(dst.ctypes.data, a.ptr, n)
        assert (dst == src).all()
        if kind == "host":
            assert (a.view() == src).all()   # the CPU sees what went in through the GPU address
        _kernel_fill(a.ptr, n, 0x3C)         # a GPU kernel stores through the device pointer
        p.memcpy(dst.ctypes.data, a.ptr, n)
        assert (dst == 0x3C).all()
        if kind == "host":
            assert (a.view() == 0x3C).all()  # ... and the CPU sees the kernel's stores


class _CAI:
    """A raw device pointer as a __cuda_array_interface__ object, so torch can wrap it."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3}


def _kernel_fill(ptr, n, value):
    torch.as_tensor(_CAI(ptr, n), device="cuda").fill_(value)
    torch.cuda.synchronize()


@cuda_only
def test_cuda_host_register_maps_host_memory():
    """cudaHostRegister(Mapped) of page-aligned host memory: the device pointer reaches the same
    bytes, both by copy and by a kernel's stores."""
    p = P.get_platform()
    n = 1 << 16
    buf = mmap.mmap(-1, n)
    arr = np.frombuffer(buf, np.uint8)
    arr[:] = 0x5A
    dptr = p.host_register(arr.ctypes.data, n)
    try:
        out = np.zeros(n, np.uint8)
        p.memcpy(out.ctypes.data, dptr, n)
        assert (out == 0x5A).all()
        _kernel_fill(dptr, n, 0x77)
        assert (arr == 0x77).all()
    finally:
        p.host_unregister(arr.ctypes.data)


@cuda_only
def test_cuda_dmabuf_export_of_device_memory():
    """cuMemGetHandleForAddressRange exports device memory as a dma-buf fd (or says why not)."""
    p = P.get_platform()
    with p.alloc("device", 1 << 21) as a:
        try:
            d = p.dmabuf_fd(a.ptr + 100, 4096)
        except P.VendorRuntimeError as e:
            pytest.skip(f"dma-buf export not supported by this driver: {e}")
        try:
            assert d.fd >= 0 and d.offset == (a.ptr + 100) % mmap.PAGESIZE
            assert d.length % mmap.PAGESIZE == 0 and d.length >= 4096 + d.offset
        finally:
            os.close(d.fd)
