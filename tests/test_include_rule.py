"""The layering of the device headers, checked on the sources (no compiler needed).

- Code above the verbs (gpunet/device/kernels/*.cu, the test kernels gpunet/device/testing/kernels/*.cu, the EP
  headers under gpunet/device/include/gpunet/ep/, the user-kernel examples under examples/) includes
  gpunet.cuh and nothing below it, so the transports can change beneath it. Kernels that test or
  measure a lower layer on purpose are listed in BELOW_ON_PURPOSE with the reason.
- Every transport (gpunet/device/include/gpunet/transport/*.cuh) includes status.cuh (the failure
  vocabulary) itself and no other transport; the mechanisms under them (qp.cuh, proxy.cuh) do not
  include each other; status.cuh stands on arch.cuh alone; gpunet.cuh includes every transport.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INCLUDE_ROOT = ROOT / "gpunet" / "device" / "include"
GPUNET = INCLUDE_ROOT / "gpunet"
KERNELS = ROOT / "gpunet" / "device" / "kernels"
TEST_KERNELS = ROOT / "gpunet" / "device" / "testing" / "kernels"
TRANSPORTS = GPUNET / "transport"
EP = GPUNET / "ep"
EXAMPLES = ROOT / "examples"

# Kernels that use a layer below the verbs on purpose, and why.
BELOW_ON_PURPOSE = {
    TEST_KERNELS / "proxy.cu": "tests and measures proxy.cuh's FIFO protocol (push, push_warp, quiet)",
    TEST_KERNELS / "post_rate.cu": "measures qp.cuh's posting protocol (post_warp / post_warp_k) itself",
    TEST_KERNELS / "arch.cu": "tests arch.cuh's primitives and the weak-memory model",
}

_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)


def _strip_comments(text):
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def gpunet_includes(path, text=None):
    """The gpunet headers a file includes directly, as paths relative to gpunet/device/include/gpunet
    (system and other headers are not gpunet's business here)."""
    text = path.read_text() if text is None else text
    out = []
    for quote, name in _INCLUDE.findall(_strip_comments(text)):
        candidates = [INCLUDE_ROOT / name]
        if quote == '"':
            candidates.insert(0, path.parent / name)
        for c in candidates:
            c = c.resolve()
            if c.is_file() and GPUNET in c.parents:
                out.append(c.relative_to(GPUNET).as_posix())
                break
    return out


def above_violations(path, text=None):
    """The gpunet headers ``path`` includes that code above the verbs may not include."""
    allowed = {"gpunet.cuh"}
    return [h for h in gpunet_includes(path, text) if h not in allowed and not h.startswith("ep/")]


def _above_files():
    kernels = sorted(p for d in (KERNELS, TEST_KERNELS) for p in d.glob("*.cu")
                     if p not in BELOW_ON_PURPOSE)
    ep = sorted(EP.rglob("*.cuh")) if EP.is_dir() else []
    examples = sorted(EXAMPLES.glob("*.cu")) if EXAMPLES.is_dir() else []
    return kernels + ep + examples


@pytest.mark.parametrize("path", _above_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_code_above_the_verbs_includes_gpunet_cuh_only(path):
    """Every kernel source (except the listed lower-layer ones), every EP header and every example
    kernel includes no gpunet header but gpunet.cuh (EP headers may include each other)."""
    assert above_violations(path) == [], (
        "%s includes %s below the verbs: include <gpunet/gpunet.cuh> and use its verbs (or add "
        "the file to BELOW_ON_PURPOSE with the reason)" % (path.name, above_violations(path)))


def test_the_rule_sees_a_violation():
    """The checker is not vacuous: a kernel including qp.cuh or a transport is flagged, the same
    include of gpunet.cuh is not."""
    fake = KERNELS / "fake.cu"
    assert above_violations(fake, '#include <gpunet/qp.cuh>\n') == ["qp.cuh"]
    assert above_violations(fake, '#include "gpunet/transport/ibgda.cuh"\n') == ["transport/ibgda.cuh"]
    assert above_violations(fake, '// #include <gpunet/qp.cuh>\n#include <gpunet/gpunet.cuh>\n') == []
    assert above_violations(EP / "x.cuh", '#include "../proxy.cuh"\n') == ["proxy.cuh"]


def test_listed_exceptions_exist_and_need_it():
    """Every BELOW_ON_PURPOSE entry is a kernel that exists and really includes a lower header
    (an entry that no longer needs the exception must leave the list)."""
    for path in BELOW_ON_PURPOSE:
        assert path.is_file(), path
        assert above_violations(path), "%s includes nothing below the verbs: drop it from the list" % path


def test_transports_include_status_and_no_other_transport():
    """Each transport header includes status.cuh itself and no header under transport/ (shared
    code goes below them: status.cuh, devctx.cuh, their mechanism header)."""
    transports = sorted(TRANSPORTS.glob("*.cuh"))
    assert {p.name for p in transports} >= {"ibgda.cuh", "proxy.cuh"}
    for p in transports:
        inc = gpunet_includes(p)
        assert "status.cuh" in inc, p.name
        assert not [h for h in inc if h.startswith("transport/")], (p.name, inc)


def test_mechanisms_and_status_stand_alone():
    """qp.cuh and proxy.cuh do not include each other (nor any transport or gpunet.cuh);
    status.cuh includes arch.cuh only."""
    for name, other in (("qp.cuh", "proxy.cuh"), ("proxy.cuh", "qp.cuh")):
        inc = gpunet_includes(GPUNET / name)
        assert other not in inc and "gpunet.cuh" not in inc, (name, inc)
        assert not [h for h in inc if h.startswith("transport/")], (name, inc)
    assert gpunet_includes(GPUNET / "status.cuh") == ["arch.cuh"]


def test_gpunet_cuh_includes_every_transport():
    """gpunet.cuh's dispatch can only reach transports it includes: it includes all of them."""
    inc = set(gpunet_includes(GPUNET / "gpunet.cuh"))
    for p in TRANSPORTS.glob("*.cuh"):
        assert "transport/" + p.name in inc, p.name
