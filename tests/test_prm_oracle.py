"""gpunet.host.prm against oracles that are not our own reading of the PRM.

1. The Linux kernel's own ``include/linux/mlx5/mlx5_ifc.h`` (Debian package
   ``linux-headers-<version>-common``, installed by scripts/install.sh). A C program generated from
   prm.FIELDS — one printf per entry — is compiled by gcc against that header: in its
   ``struct mlx5_ifc_<name>_bits`` pseudo-structs every bit is one ``u8``, so ``offsetof`` prints
   a field's bit offset and ``sizeof`` its bit width. Every FIELDS entry, every SIZES entry, the
   type of every NESTED field and every constant prm takes from mlx5_ifc.h are compared; the
   constants from device.h / driver.h / qp.h beside it are read from their enum lines.
2. rdma-core's ``tests/mlx5_prm_structs.py`` (shipped by Debian's python3-pyverbs under
   /usr/share/doc/rdma-core/tests/): the DevX UMEM fields the kernel leaves reserved
   (prm.RDMA_CORE_ONLY) take their layout from it. Its scapy classes are evaluated with a stand-in
   for the few scapy field kinds they use (each only reports its bit width); no scapy needed.

A missing header or file is a failure, not a skip: without it there is no oracle, and the DevX
commands would rest on our reading alone.
"""
import glob
import gzip
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from gpunet.host import prm

PRELUDE = Path(__file__).parent / "oracle" / "prm_oracle_prelude.h"
HEADER_GLOB = "/usr/src/linux-headers-*/include/linux/mlx5/mlx5_ifc.h"   # Debian: *-common
HEADER_PACKAGE_HINT = ("the Debian package linux-headers-<version>-common (pick one with "
                       "apt-cache search --names-only '^linux-headers-.*-common$', e.g. "
                       "linux-headers-6.12.117+deb12-common; scripts/install.sh installs it)")
RDMA_CORE_STRUCTS = ["/usr/share/doc/rdma-core/tests/mlx5_prm_structs.py.gz",
                     "/usr/share/doc/rdma-core/tests/mlx5_prm_structs.py",
                     "/usr/local/share/gpunet/rdma-core-tests/mlx5_prm_structs.py.gz"]


def _version_key(path):
    return [int(n) for n in re.findall(r"\d+", path)]


def kernel_include_dir():
    """The ``include`` folder of the newest linux-headers-*-common with mlx5_ifc.h
    (GPUNET_MLX5_IFC_INCLUDE overrides); fails the test, naming the package, when there is none."""
    forced = os.environ.get("GPUNET_MLX5_IFC_INCLUDE")
    if forced:
        if not os.path.exists(os.path.join(forced, "linux/mlx5/mlx5_ifc.h")):
            pytest.fail("GPUNET_MLX5_IFC_INCLUDE=%s has no linux/mlx5/mlx5_ifc.h" % forced)
        return forced
    found = sorted(glob.glob(HEADER_GLOB), key=_version_key)
    if not found:
        pytest.fail("the kernel's linux/mlx5/mlx5_ifc.h is not installed (looked for %s): install "
                    "%s. The PRM command layouts of gpunet.host.prm are checked against it."
                    % (HEADER_GLOB, HEADER_PACKAGE_HINT))
    return str(Path(found[-1]).parents[2])


def _ctype(struct):
    return ("union" if struct in prm.UNIONS else "struct") + " mlx5_ifc_%s_bits" % struct


def oracle_source():
    """The C program: one printf per FIELDS entry (its kernel offset and width; for an
    RDMA_CORE_ONLY entry, the kernel reserved field it must lie in), per SIZES entry, per NESTED
    type check and per mlx5_ifc.h constant."""
    lines = ['#include "%s"' % PRELUDE, "#include <linux/mlx5/mlx5_ifc.h>", "",
             "int main(void) {"]
    for (struct, field) in prm.FIELDS:
        name = prm.RDMA_CORE_ONLY.get((struct, field), field)
        tag = "R" if (struct, field) in prm.RDMA_CORE_ONLY else "F"
        t = _ctype(struct)
        lines.append('  printf("%s %s %s %%zu %%zu\\n", offsetof(%s, %s), sizeof(((%s *)0)->%s));'
                     % (tag, struct, field, t, name, t, name))
    for struct in prm.SIZES:
        lines.append('  printf("S %s %%zu\\n", sizeof(%s));' % (struct, _ctype(struct)))
    for (struct, field), inner in prm.NESTED.items():
        lines.append('  printf("N %s %s %%d\\n", __builtin_types_compatible_p('
                     '__typeof__(((%s *)0)->%s), %s));'
                     % (struct, field, _ctype(struct), field, _ctype(inner)))
    for name in prm.CONSTANT_HEADERS["mlx5_ifc.h"]:
        lines.append('  printf("C %s %%lld\\n", (long long)%s);' % (name, name))
    lines += ["  return 0;", "}", ""]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def kernel_layout(tmp_path_factory):
    """{("F"|"R", struct, field): (offset, width), ("S", struct): bits, ("N", struct, field):
    same type?, ("C", name): value}, as gcc computes them from the kernel header."""
    inc = kernel_include_dir()
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if cc is None:
        pytest.fail("no C compiler: the PRM oracle needs gcc (Debian package gcc)")
    d = tmp_path_factory.mktemp("prm_oracle")
    src, exe = d / "prm_oracle.c", d / "prm_oracle"
    src.write_text(oracle_source())
    r = subprocess.run([cc, "-std=gnu11", "-O0", "-w", "-I", inc, "-o", str(exe), str(src)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail("compiling the PRM oracle against %s/linux/mlx5/mlx5_ifc.h failed (a field "
                    "prm names that the header lacks shows up as 'has no member'):\n%s"
                    % (inc, r.stderr[-6000:]))
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    layout = {}
    for line in out.splitlines():
        p = line.split()
        if p[0] in ("F", "R"):
            layout[(p[0], p[1], p[2])] = (int(p[3]), int(p[4]))
        elif p[0] == "S":
            layout[("S", p[1])] = int(p[2])
        elif p[0] == "N":
            layout[("N", p[1], p[2])] = p[3] == "1"
        else:
            layout[("C", p[1])] = int(p[2])
    return layout


def test_every_field_matches_the_kernel_header(kernel_layout):
    """Every FIELDS entry the kernel header defines has the header's bit offset and width."""
    bad = []
    for (struct, field), want in prm.FIELDS.items():
        if (struct, field) in prm.RDMA_CORE_ONLY:
            continue
        got = kernel_layout[("F", struct, field)]
        if got != want:
            bad.append("%s.%s: prm (%#x, %#x), mlx5_ifc.h (%#x, %#x)" % (struct, field, *want,
                                                                          *got))
    assert not bad, "FIELDS differ from the kernel header:\n" + "\n".join(bad)
    assert sum(1 for k in kernel_layout if k[0] == "F") == len(prm.FIELDS) - len(prm.RDMA_CORE_ONLY)


def test_every_size_matches_the_kernel_header(kernel_layout):
    """Every SIZES entry is the pseudo-struct's sizeof, and every field lies inside its struct."""
    bad = ["%s: prm %#x, mlx5_ifc.h %#x" % (s, bits, kernel_layout[("S", s)])
           for s, bits in prm.SIZES.items() if kernel_layout[("S", s)] != bits]
    assert not bad, "SIZES differ from the kernel header:\n" + "\n".join(bad)
    outside = ["%s.%s" % k for k, (off, w) in prm.FIELDS.items() if off + w > prm.SIZES[k[0]]]
    assert not outside, "fields beyond their struct's size: %s" % outside


def test_nested_fields_have_the_kernel_type(kernel_layout):
    """Every NESTED field is, in the kernel header, a member of exactly the struct prm says."""
    bad = ["%s.%s is not a %s" % (s, f, inner) for (s, f), inner in prm.NESTED.items()
           if not kernel_layout[("N", s, f)]]
    assert not bad, "\n".join(bad)


def test_rdma_core_only_fields_lie_in_kernel_reserved_bits(kernel_layout):
    """Each DevX-only field lies wholly inside the kernel reserved field RDMA_CORE_ONLY names,
    so it overlaps no field the kernel defines there."""
    for (struct, field), reserved in prm.RDMA_CORE_ONLY.items():
        r_off, r_width = kernel_layout[("R", struct, field)]
        assert reserved.startswith("reserved_at_") and int(reserved[12:], 16) == r_off
        off, width = prm.FIELDS[(struct, field)]
        assert r_off <= off and off + width <= r_off + r_width, (
            "%s.%s (%#x, %#x) is not inside the kernel's %s (%#x, %#x)"
            % (struct, field, off, width, reserved, r_off, r_width))


def test_mlx5_ifc_constants_match_the_kernel_header(kernel_layout):
    """Every constant prm takes from mlx5_ifc.h (opcodes, qpc/cqc values, HCA cap types) has the
    header's value."""
    names = prm.CONSTANT_HEADERS["mlx5_ifc.h"]
    assert "MLX5_CMD_OP_CREATE_QP" in names and len(names) > 20
    bad = ["%s: prm %#x, mlx5_ifc.h %#x" % (n, getattr(prm, n), kernel_layout[("C", n)])
           for n in names if kernel_layout[("C", n)] != getattr(prm, n)]
    assert not bad, "\n".join(bad)


_ENUM_LINE = re.compile(r"^\s*([A-Z0-9_]+)\s*=\s*([0-9xXa-fA-F]+(?:\s*<<\s*[0-9]+)?)\s*,?\s*$")


def _enum_values(path):
    """{name: value} of the enum lines ``NAME = literal`` / ``NAME = a << b`` in a header."""
    values = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("/*")[0]
        m = _ENUM_LINE.match(line)
        if m:
            expr = [int(x, 0) for x in m.group(2).split("<<")]
            values[m.group(1)] = expr[0] << expr[1] if len(expr) == 2 else expr[0]
    return values


@pytest.mark.parametrize("header", ["device.h", "driver.h", "qp.h"])
def test_other_header_constants_match(header):
    """The constants prm takes from device.h / driver.h / qp.h (beside mlx5_ifc.h) have the
    values of those headers' enum lines."""
    path = Path(kernel_include_dir()) / "linux" / "mlx5" / header
    values = _enum_values(path)
    names = prm.CONSTANT_HEADERS[header]
    assert names
    missing = [n for n in names if n not in values]
    assert not missing, "%s defines no enum line for %s" % (path, missing)
    bad = ["%s: prm %#x, %s %#x" % (n, getattr(prm, n), header, values[n])
           for n in names if values[n] != getattr(prm, n)]
    assert not bad, "\n".join(bad)


# --- rdma-core's scapy PRM structs ------------------------------------------------------------
class _Field:
    """A stand-in for a scapy field: its name and bit width (None: a kind we cannot size)."""

    def __init__(self, name, bits):
        self.name, self.bits = name, bits


def _fake_scapy():
    """Modules scapy.packet / scapy.fields / scapy.layers.inet6 with the field kinds
    mlx5_prm_structs.py uses, each reduced to (name, bit width)."""
    class Packet:
        fields_desc = []

        def __init__(self, *a, **k):
            pass

    def fixed(bits):
        return lambda name, *a, **k: _Field(name, bits)

    def packet_field(name, default, cls, **k):
        f = _Field(name, None)
        f.cls = cls
        return f

    def field_list(name, default, field, **k):
        return _Field(name, len(default) * field.bits)

    def packet_list(name, default, cls, **k):
        f = _Field(name, None)
        f.cls, f.count = cls, len(default)
        return f

    def unsized(fld, *a, **k):
        return _Field(getattr(fld, "name", "?"), None)

    fields = types.ModuleType("scapy.fields")
    for n, bits in [("ByteField", 8), ("ShortField", 16), ("IntField", 32), ("LongField", 64),
                    ("IPField", 32), ("MACField", 48)]:
        setattr(fields, n, fixed(bits))
    fields.BitField = lambda name, default, size, **k: _Field(name, size)
    fields.StrFixedLenField = lambda name, default, length, **k: _Field(name, 8 * length)
    fields.PacketField = packet_field
    fields.PacketListField = packet_list
    fields.FieldListField = field_list
    fields.ConditionalField = fields.PadField = unsized
    fields.MultipleTypeField = lambda *a, **k: _Field("?", None)
    packet = types.ModuleType("scapy.packet")
    packet.Packet = Packet
    inet6 = types.ModuleType("scapy.layers.inet6")
    inet6.IP6Field = fixed(128)
    mods = {"scapy": types.ModuleType("scapy"), "scapy.packet": packet, "scapy.fields": fields,
            "scapy.layers": types.ModuleType("scapy.layers"), "scapy.layers.inet6": inet6}
    return mods


def _class_bits(cls):
    total = 0
    for f in cls.fields_desc:
        total += _field_bits(f)
    return total


def _field_bits(f):
    if getattr(f, "cls", None) is not None:
        return _class_bits(f.cls) * getattr(f, "count", 1)
    if f.bits is None:
        raise ValueError("cannot size rdma-core field %r" % f.name)
    return f.bits


def _layout_of(cls):
    """({field name: (bit offset, bit width)}, total bits or None) of a class's leading fields,
    up to the first one we cannot size (the offsets after it would be guesses; total None)."""
    out, off = {}, 0
    for f in cls.fields_desc:
        try:
            w = _field_bits(f)
        except ValueError:
            return out, None
        out[f.name] = (off, w)
        off += w
    return out, off


@pytest.fixture(scope="module")
def rdma_core(monkeypatch_module):
    """The classes of rdma-core's mlx5_prm_structs.py, evaluated over the scapy stand-in."""
    path = next((p for p in RDMA_CORE_STRUCTS if os.path.exists(p)), None)
    if path is None:
        pytest.fail("rdma-core's tests/mlx5_prm_structs.py is not installed (looked for %s): "
                    "install the Debian package python3-pyverbs (scripts/install.sh does, and "
                    "extracts the file when the image excludes /usr/share/doc)."
                    % ", ".join(RDMA_CORE_STRUCTS))
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        source = fh.read()
    for name, mod in _fake_scapy().items():
        monkeypatch_module.setitem(sys.modules, name, mod)
    ns = {"__name__": "rdma_core_mlx5_prm_structs"}
    exec(compile(source, path, "exec"), ns)   # class definitions only: the module's whole body
    return ns


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


# prm struct -> (rdma-core class, {prm field name: rdma-core field name} where they differ).
RDMA_CORE_CLASSES = {
    "cqc": ("SwCqc", {}),
    "create_cq_in": ("CreateCqIn", {"cq_umem_offset": "e_mtt_pointer_or_cq_umem_offset"}),
    "create_cq_out": ("CreateCqOut", {}),
    "ads": ("SwAds", {"dei_cfi": "dei_cfi_reserved_from_prm_041"}),
    "qpc": ("SwQpc", {}),
    "create_qp_in": ("CreateQpIn", {"wq_umem_offset": "e_mtt_pointer_or_wq_umem_offset"}),
    "create_qp_out": ("CreateQpOut", {}),
    "query_qp_in": ("QueryQpIn", {}),
    "query_hca_cap_in": ("QueryHcaCapIn", {}),
    "cmd_hca_cap": ("CmdHcaCap", {}),
}


def test_rdma_core_only_fields_match_rdma_core(rdma_core):
    """Every RDMA_CORE_ONLY field has the bit offset and width of rdma-core's struct."""
    for (struct, field) in prm.RDMA_CORE_ONLY:
        cls_name, renames = RDMA_CORE_CLASSES[struct]
        layout, _ = _layout_of(rdma_core[cls_name])
        name = renames.get(field, field)
        assert name in layout, "rdma-core's %s has no %s" % (cls_name, name)
        assert layout[name] == prm.FIELDS[(struct, field)], (struct, field, layout[name])


def test_shared_fields_agree_with_rdma_core(rdma_core):
    """Cross-check: every field of these structs that rdma-core's struct also names, and every
    struct size it fully describes, is the same there as in prm (so the kernel and rdma-core
    agree on what the DevX commands use)."""
    compared, bad = 0, []
    for struct, (cls_name, renames) in RDMA_CORE_CLASSES.items():
        layout, total = _layout_of(rdma_core[cls_name])
        if total is not None and total != prm.SIZES[struct]:
            bad.append("%s: prm %#x bits, rdma-core %s %#x" % (struct, prm.SIZES[struct],
                                                               cls_name, total))
        for (s, field), want in prm.FIELDS.items():
            name = renames.get(field, field)
            if s != struct or name not in layout or (s, field) in prm.NESTED:
                continue
            compared += 1
            if layout[name] != want:
                bad.append("%s.%s: prm (%#x, %#x), rdma-core %s.%s (%#x, %#x)"
                           % (struct, field, *want, cls_name, name, *layout[name]))
    assert not bad, "\n".join(bad)
    assert compared >= 100, compared
