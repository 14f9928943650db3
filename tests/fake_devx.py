"""TEST DOUBLE, never used outside tests: a recording stand-in for the layer below the DevX NIC
(gpunet/host/devx.py PyverbsDevx: rdma-core through pyverbs) and for a CUDA platform, so that
tests/test_devx.py can drive DevxNic on a machine with no RDMA device and no GPU.

It is not a model of an mlx5 NIC. It records every call (``calls``), every PRM command with its
bytes (``commands``: (call, opcode, bytes)), every release in order (``closed``: (kind, id)), and
answers with canned values: device names, port attributes, GIDs, HCA capabilities (built with
gpunet/host/prm.py into a query_hca_cap_out), object numbers (CQN, QPN), and a QP state machine that
accepts only the RC moves (RESET -> INIT -> RTR -> RTS, any -> ERR, any -> RESET) so a command
sent in the wrong state fails as the firmware would. Options make it refuse what a real system
may refuse (DevX, a non-cached UAR, any UAR, UMEM at GPU addresses, dma-buf, the UAR's GPU
mapping). Nothing here was checked against a NIC.
"""
import ctypes
import errno as E
import itertools
import os

from gpunet.host import prm
from gpunet.host.devx import DevxCallError
from gpunet.host.platform import COHERENCE_POLICY, DmaBuf, ERR_NOT_PERMITTED, VendorRuntimeError
from gpunet.resource import Resource

GPU_BASE = 0x7A0000000000          # where the fake platform's device allocations start
UAR_BASE = 0x7B0000000000          # the fake UAR pages (never written: tests do not ring)

# RoCE GID table of the fake port: (type, 16 bytes). Index 3 is the IPv4-mapped RoCE v2 GID a
# DevxNic must pick (v2 before v1, IPv4-mapped first).
ROCE_GIDS = [
    ("IB/RoCE v1", bytes.fromhex("fe800000000000000202c9fffe000001")),
    ("RoCE v2", bytes.fromhex("fe800000000000000202c9fffe000001")),
    ("IB/RoCE v1", bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 1])),
    ("RoCE v2", bytes(10) + b"\xff\xff" + bytes([10, 0, 0, 1])),
]
MAC = bytes.fromhex("0202c9000001")


class FakeObj:
    """An rdma-core object stand-in: ``kind``, ``id``, attributes given; ``close()`` records
    (kind, id) in the fake's ``closed`` once."""

    def __init__(self, fake, kind, id_, **attrs):
        self._fake, self.kind, self.id = fake, kind, id_
        self.__dict__.update(attrs)
        self._open = True

    def close(self):
        if self._open:
            self._open = False
            self._fake.closed.append((self.kind, self.id))

    def __repr__(self):
        return "Fake%s(%s)" % (self.kind, self.id)


class FakeDevx:
    """Stands in for host/devx.PyverbsDevx (same methods). See the module docstring."""

    def __init__(self, devices=("mlx5_0",), *, devx=True, link_layer="IB", lid=7, active_mtu=5,
                 endianness=prm.ATOMIC_REQ_8B_ENDIANNESS_HOST, host_endianness_supported=1,
                 atomic=1, atomic_operations=0x3, atomic_size_qp=0x8, log_max_qp_sz=15,
                 log_max_cq_sz=22, log_max_msg=30, log_max_ra_req_qp=4, log_max_ra_res_qp=4,
                 cq_oi=1, roce=1, qp_ts_format=1, refuse_nc_uar=False, refuse_uar=False,
                 refuse_gpu_umem=False, mac=MAC):
        self.device_names = list(devices)
        self.devx, self.link_layer, self.lid, self.active_mtu = devx, link_layer, lid, active_mtu
        self.general = dict(log_max_qp_sz=log_max_qp_sz, log_max_cq_sz=log_max_cq_sz,
                            log_max_msg=log_max_msg, log_max_ra_req_qp=log_max_ra_req_qp,
                            log_max_ra_res_qp=log_max_ra_res_qp, atomic=atomic, cq_oi=cq_oi,
                            roce=roce, port_type=int(link_layer == "Ethernet"),
                            uar_4k=1, log_bf_reg_size=8)
        self.atomic = dict(atomic_req_8B_endianness_mode=endianness,
                           supported_atomic_req_8B_endianness_mode_1=host_endianness_supported,
                           atomic_operations=atomic_operations, atomic_size_qp=atomic_size_qp)
        self.roce_caps = dict(qp_ts_format=qp_ts_format)
        self.refuse_nc_uar, self.refuse_uar = refuse_nc_uar, refuse_uar
        self.refuse_gpu_umem, self.mac = refuse_gpu_umem, mac
        self.calls, self.commands, self.closed = [], [], []
        self.umems = {}                  # umem_id -> (addr, size)
        self.qp_state = {}               # qpn -> MLX5_QPC_STATE_*
        self._ids = itertools.count(1)
        self._cqn = itertools.count(0x40)
        self._qpn = itertools.count(0x200)

    # --- device ---------------------------------------------------------------------------
    def devices(self):
        self.calls.append(("devices",))
        return list(self.device_names)

    def open(self, name):
        self.calls.append(("open", name))
        if not self.devx:
            raise DevxCallError("mlx5dv_open_device(%s, DEVX)" % name, E.EOPNOTSUPP)
        return FakeObj(self, "ctx", name)

    def query_port(self, port):
        self.calls.append(("query_port", port))
        return {"state": 4, "lid": self.lid if self.link_layer == "IB" else 0,
                "active_mtu": self.active_mtu, "link_layer": self.link_layer,
                "gid_tbl_len": len(ROCE_GIDS)}

    def gid(self, port, index):
        return ROCE_GIDS[index][1] if self.link_layer == "Ethernet" else bytes(16)

    def gid_type(self, port, index):
        return ROCE_GIDS[index][0]

    def port_mac(self, port, gid_index):
        return self.mac

    def alloc_pd(self):
        self.calls.append(("alloc_pd",))
        return FakeObj(self, "pd", next(self._ids)), 0x11

    def alloc_uar(self, nc):
        self.calls.append(("alloc_uar", "NC" if nc else "BF"))
        if self.refuse_uar or (nc and self.refuse_nc_uar):
            raise DevxCallError("mlx5dv_devx_alloc_uar(%s)" % ("NC" if nc else "BF"), E.EINVAL)
        i = next(self._ids)
        base = UAR_BASE + i * 0x1000
        return FakeObj(self, "uar", i, page_id=0x20 + i, base_addr=base, reg_addr=base + 0x800)

    def umem_reg(self, addr, size, access):
        self.calls.append(("umem_reg", addr, size, access))
        if self.refuse_gpu_umem and GPU_BASE <= addr < UAR_BASE:
            raise DevxCallError("mlx5dv_devx_umem_reg(0x%x, %d)" % (addr, size), E.EFAULT)
        i = next(self._ids)
        self.umems[i] = (addr, size)
        return FakeObj(self, "umem", i, umem_id=i, umem_addr=addr)

    def query_eqn(self, vector):
        self.calls.append(("query_eqn", vector))
        return 5

    # --- PRM commands -----------------------------------------------------------------------
    @staticmethod
    def _opcode(inbuf):
        return prm.get(inbuf, "query_hca_cap_in", "opcode")      # every *_in starts with it

    def _out(self, opcode, outlen):
        assert outlen == prm.out_size(opcode), (hex(opcode), outlen)
        return prm.alloc(prm.OUT_STRUCT[opcode])

    def general_cmd(self, inbuf, outlen):
        op = self._opcode(inbuf)
        self.commands.append(("general_cmd", op, bytes(inbuf)))
        assert op == prm.MLX5_CMD_OP_QUERY_HCA_CAP, hex(op)
        out = self._out(op, outlen)
        cap = prm.get(inbuf, "query_hca_cap_in", "op_mod") >> 1
        struct, vals = {prm.MLX5_SET_HCA_CAP_OP_MOD_GENERAL_DEVICE: ("cmd_hca_cap", self.general),
                        prm.MLX5_SET_HCA_CAP_OP_MOD_ATOMIC: ("atomic_caps", self.atomic),
                        prm.MLX5_SET_HCA_CAP_OP_MOD_ROCE: ("roce_cap", self.roce_caps)}[cap]
        for f, v in vals.items():
            prm.set(out, "query_hca_cap_out", "capability.%s.%s" % (struct, f), v)
        return bytes(out)

    def obj_create(self, inbuf, outlen):
        op = self._opcode(inbuf)
        self.commands.append(("obj_create", op, bytes(inbuf)))
        out = self._out(op, outlen)
        if op == prm.MLX5_CMD_OP_CREATE_CQ:
            n = next(self._cqn)
            prm.set(out, "create_cq_out", "cqn", n)
            return FakeObj(self, "cq", n), bytes(out)
        if op == prm.MLX5_CMD_OP_CREATE_QP:
            n = next(self._qpn)
            prm.set(out, "create_qp_out", "qpn", n)
            self.qp_state[n] = prm.MLX5_QPC_STATE_RST
            return FakeObj(self, "qp", n), bytes(out)
        raise AssertionError("unexpected create opcode %#x" % op)

    _MOVES = {prm.MLX5_CMD_OP_RST2INIT_QP: (prm.MLX5_QPC_STATE_RST, prm.MLX5_QPC_STATE_INIT),
              prm.MLX5_CMD_OP_INIT2RTR_QP: (prm.MLX5_QPC_STATE_INIT, prm.MLX5_QPC_STATE_RTR),
              prm.MLX5_CMD_OP_RTR2RTS_QP: (prm.MLX5_QPC_STATE_RTR, prm.MLX5_QPC_STATE_RTS),
              prm.MLX5_CMD_OP_2ERR_QP: (None, prm.MLX5_QPC_STATE_ERR),
              prm.MLX5_CMD_OP_2RST_QP: (None, prm.MLX5_QPC_STATE_RST)}

    def obj_modify(self, obj, inbuf, outlen):
        op = self._opcode(inbuf)
        self.commands.append(("obj_modify", op, bytes(inbuf)))
        assert obj.kind == "qp" and obj._open, obj
        frm, to = self._MOVES[op]
        qpn = prm.get(inbuf, prm.MODIFY_QP[op], "qpn")
        assert qpn == obj.id, (qpn, obj.id)
        if frm is not None and self.qp_state[qpn] != frm:
            raise DevxCallError("mlx5dv_devx_obj_modify", E.EREMOTEIO,
                                "bad resource state (QP %#x is in state %d)"
                                % (qpn, self.qp_state[qpn]))
        self.qp_state[qpn] = to
        return bytes(self._out(op, outlen))

    def obj_query(self, obj, inbuf, outlen):
        op = self._opcode(inbuf)
        self.commands.append(("obj_query", op, bytes(inbuf)))
        assert op == prm.MLX5_CMD_OP_QUERY_QP and obj._open
        out = self._out(op, outlen)
        prm.set(out, "query_qp_out", "qpc.state", self.qp_state[obj.id])
        return bytes(out)

    # --- memory registration ------------------------------------------------------------------
    def reg_mr(self, pd, addr, length, access):
        self.calls.append(("reg_mr", addr, length, access))
        i = next(self._ids)
        return FakeObj(self, "mr", i, lkey=0x1000 + i, rkey=0x2000 + i)

    def reg_dmabuf_mr(self, pd, offset, length, iova, fd, access):
        self.calls.append(("reg_dmabuf_mr", offset, length, iova, fd, access))
        i = next(self._ids)
        return FakeObj(self, "mr", i, lkey=0x3000 + i, rkey=0x4000 + i)

    # --- helpers for tests ----------------------------------------------------------------------
    def sent(self, opcode):
        """The input bytes of every command of ``opcode`` sent so far, in order."""
        return [b for _, op, b in self.commands if op == opcode]


class FakeAllocation(Resource):
    """A platform Allocation stand-in (``ptr``, ``kind``, ``nbytes``; ``close()`` frees, once;
    a Resource like the real one, so owners can adopt it)."""

    def __init__(self, plat, kind, nbytes, ptr):
        self.plat, self.kind, self.nbytes, self.ptr = plat, kind, nbytes, ptr

    def _release(self):
        self.plat.freed.append(self.ptr)


class FakeCudaPlatform:
    """Stands in for host/platform.Platform("cuda") without a GPU: device allocations are host
    bytearrays at fake addresses (``mem``), memcpy copies between them and host addresses,
    host_register records (or refuses with error 800, ``refuse_io``), dma-buf export hands out an
    fd of /dev/null (or refuses, ``refuse_dmabuf``)."""

    name = "cuda"

    def __init__(self, profile="nvidia", refuse_io=False, refuse_dmabuf=False):
        self.profile, self.refuse_io, self.refuse_dmabuf = profile, refuse_io, refuse_dmabuf
        self.mem, self.freed, self.registered, self.unregistered = {}, [], [], []
        self.dmabufs = []
        self._next = GPU_BASE

    def policy(self, role):
        return COHERENCE_POLICY[self.profile][role]

    def alloc(self, kind, nbytes, device=None):
        ptr, self._next = self._next, self._next + ((nbytes + 0xFFFF) & ~0xFFFF)
        self.mem[ptr] = bytearray(nbytes)
        return FakeAllocation(self, kind, nbytes, ptr)

    def _find(self, addr, n):
        for base, b in self.mem.items():
            if base <= addr and addr + n <= base + len(b):
                return b, addr - base
        return None, None

    def memcpy(self, dst, src, nbytes):
        d, doff = self._find(dst, nbytes)
        s, soff = self._find(src, nbytes)
        data = bytes(s[soff:soff + nbytes]) if s is not None else ctypes.string_at(src, nbytes)
        if d is not None:
            d[doff:doff + nbytes] = data
        else:
            ctypes.memmove(dst, data, nbytes)

    def host_register(self, addr, nbytes, io_memory=False, device=None):
        self.registered.append((addr, nbytes, io_memory))
        if self.refuse_io and io_memory:
            raise VendorRuntimeError("cudaHostRegister(0x%x, %d, flags=0x7) for an I/O (BAR) range "
                                     "failed with error 800 (operation not permitted)"
                                     % (addr, nbytes), call="cudaHostRegister",
                                     code=ERR_NOT_PERMITTED, library="libcudart.so")
        return addr + 0x10000000000

    def host_unregister(self, addr):
        self.unregistered.append(addr)

    def dmabuf_fd(self, addr, nbytes):
        if self.refuse_dmabuf:
            raise VendorRuntimeError("cuMemGetHandleForAddressRange failed with error 801",
                                     call="cuMemGetHandleForAddressRange", code=801)
        fd = os.open(os.devnull, os.O_RDONLY)
        base = addr & ~0xFFF
        self.dmabufs.append((fd, addr, nbytes))
        return DmaBuf(fd, addr - base, ((addr + nbytes + 0xFFF) & ~0xFFF) - base)


def fake_nic(**kw):
    """A DevxNic over a FakeDevx: keyword arguments starting ``fake_`` go to FakeDevx (without
    the prefix), the rest to DevxNic. Returns (nic, fake)."""
    from gpunet.host.devx import DevxNic
    from gpunet.host.platform import Platform

    fkw = {k[5:]: kw.pop(k) for k in list(kw) if k.startswith("fake_")}
    fake = FakeDevx(**fkw)
    kw.setdefault("platform", Platform("cpu", detected_by="tests/fake_devx.py"))
    kw.setdefault("arena_bytes", 4 << 20)
    return DevxNic(backend=fake, **kw), fake


__all__ = ["FakeDevx", "FakeCudaPlatform", "FakeObj", "fake_nic", "ROCE_GIDS", "MAC", "GPU_BASE"]
