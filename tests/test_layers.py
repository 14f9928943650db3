"""gpunet's modules import one way: the layer rule, checked on the import graph of the sources.

Each source file of gpunet/, host/ and device/ is a module (installed as gpunet.*, gpunet.host.*
and gpunet.device.*); every import in it, at module level or inside a function, is an edge. The
layers, bottom up:

0. floor: gpunet.errors, gpunet.config, gpunet._floor (addresses, aligned buffers, deadlines),
   gpunet.resource (the lifecycle base). errors, config and _floor import nothing from gpunet;
   resource imports errors only.
1. wire: gpunet.host.rawmem (raw-address numba access), gpunet.mlx5 (the wire format),
   gpunet.host.prm (the PRM command layouts).
2. device: the rest of device/ (the device-ABI mirrors, the descriptors filled from NIC objects
   through their attributes, the loader, the kernel bindings).
3. host: the rest of host/ (NICs, proxy, platform, bootstrap): CPU agents that serve device code
   may read its ABI (gpunet/device/abi.py), never the other way round.
4. top: the rest of gpunet/ (Context, transports, heap, launcher, API, ep, CLI) wires them.

A module imports only modules of its own layer or of lower ones: device/ never imports host/.
Besides: only gpunet/host/nic.py (the factory ``open_nic``) names a NIC implementation (gpunet/host/softnic.py,
gpunet/host/devx.py with gpunet/host/verbs.py), nothing outside gpunet.device.testing (test and benchmark support) imports it,
and the module-level imports form no cycle (a cycle there makes import order matter).
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "gpunet"
FLOOR = {"gpunet.errors", "gpunet.config", "gpunet._floor", "gpunet.resource"}
BARE_FLOOR = {"gpunet.errors", "gpunet.config", "gpunet._floor"}     # import nothing from gpunet
WIRE = {"gpunet.host.rawmem", "gpunet.mlx5", "gpunet.host.prm"}
NIC_IMPLEMENTATIONS = {"gpunet.host.softnic", "gpunet.host.verbs", "gpunet.host.devx"}
NIC_FACTORY = "gpunet.host.nic"
TESTING = "gpunet.device.testing"
RANK = {"floor": 0, "wire": 1, "device": 2, "host": 3, "top": 4}


def _modules():
    """{module name: path} for every .py file of the package (gpunet/, its host/ and device/)."""
    mods = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _is_package(name):
    return MODULES[name].name == "__init__.py"


def _resolve(name):
    """The module of ours that an import of ``name`` loads (its longest known prefix), or None."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in MODULES:
            return cand
        parts.pop()
    return None


def _imports(name, module_level_only=False):
    """The modules of ours that module ``name`` imports."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    pkg = name if _is_package(name) else name.rpartition(".")[0]
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                out.add(_resolve(a.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                sub = "%s.%s" % (base, a.name)
                out.add(sub if sub in MODULES else _resolve(base))
    out.discard(None)
    out.discard(name)
    return out


def layer(name):
    if name in FLOOR:
        return "floor"
    if name in WIRE:
        return "wire"
    if name == "gpunet.host" or name.startswith("gpunet.host."):
        return "host"
    if name == "gpunet.device" or name.startswith("gpunet.device."):
        return "device"
    return "top"


def allowed(src, dst):
    """May module ``src`` import module ``dst``? (the rule in the module docstring)"""
    a, b = layer(src), layer(dst)
    if a == b:
        return True
    return RANK[b] < RANK[a]


def test_the_sources_are_found():
    """The graph covers the three trees (a wrong root would make every check below vacuous)."""
    for must in ("gpunet.context", "gpunet.host.softnic", "gpunet.device.abi", "gpunet._floor",
                 "gpunet.device.descriptors", "gpunet.host.nic", "gpunet.transports"):
        assert must in MODULES, must
    assert len(MODULES) > 25


def test_the_rule_itself_rejects_upward_and_sideways_imports():
    """The rule as a function: device -> host, floor -> anything above, wire -> host are refused;
    top -> host / device / floor, host -> device and host -> wire are allowed."""
    assert allowed("gpunet.host.proxy", "gpunet.device.abi")
    assert not allowed("gpunet.device.descriptors", "gpunet.host.softnic")
    assert not allowed("gpunet.device.testing.loopback", "gpunet.host.platform")
    assert not allowed("gpunet._floor", "gpunet.mlx5")
    assert not allowed("gpunet.mlx5", "gpunet.host.wq")
    assert not allowed("gpunet.host.softnic", "gpunet.context")
    assert allowed("gpunet.context", "gpunet.host.nic") and allowed("gpunet.context", "gpunet.device.abi")
    assert allowed("gpunet.host.proxy", "gpunet.host.rawmem") and allowed("gpunet.mlx5", "gpunet.errors")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_import_goes_down_or_sideways_within_a_side(name):
    """Every import of ``name`` (module level or in a function) obeys the layer rule: none from
    device/ into host/, none from a lower layer into a higher one."""
    bad = sorted(d for d in _imports(name) if not allowed(name, d))
    assert not bad, "%s (%s) imports %s" % (
        name, layer(name), ", ".join("%s (%s)" % (d, layer(d)) for d in bad))


@pytest.mark.parametrize("name", sorted(BARE_FLOOR))
def test_the_bare_floor_imports_nothing_from_gpunet(name):
    """errors, config and _floor import no gpunet module at all (tinygrad's helpers rule)."""
    assert _imports(name) == set()


def test_only_the_factory_names_a_nic_implementation():
    """Above gpunet/host/nic.py nothing names the soft NIC or the verbs NIC: they are opened through
    open_nic (a second implementation is added there alone)."""
    users = sorted(m for m in MODULES for d in _imports(m)
                   if d in NIC_IMPLEMENTATIONS and m not in NIC_IMPLEMENTATIONS | {NIC_FACTORY})
    assert users == [], users


def _in_testing(name):
    return name == TESTING or name.startswith(TESTING + ".")


def test_nothing_in_the_package_imports_the_testing_support():
    """gpunet.device.testing is test and benchmark support: no module outside it imports it, so
    the library runs without it (and its modules are found, or this check would be vacuous)."""
    assert {TESTING, TESTING + ".loopback", TESTING + ".schedule"} <= set(MODULES)
    users = sorted("%s -> %s" % (m, d) for m in MODULES if not _in_testing(m)
                   for d in _imports(m) if _in_testing(d))
    assert users == [], users


def test_module_level_imports_form_no_cycle():
    """The graph of module-level imports is acyclic (a function-level import is how a module
    defers a heavy or higher dependency; at module level a cycle makes import order matter)."""
    graph = {m: _imports(m, module_level_only=True) for m in MODULES}
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
