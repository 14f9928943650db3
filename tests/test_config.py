"""gpunet/config.py: one table of knobs, read in one place, printed by ``python -m gpunet config``."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gpunet import config
from gpunet.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
# GPUNET_* names in the sources that are code, not knobs: portability macros of arch.cuh, the arm
# selectors the build sets itself, and internal helper macros.
CODE_MACROS = {"GPUNET_DEVICE", "GPUNET_GLOBAL", "GPUNET_HOST_DEVICE", "GPUNET_ARCH_HOST",
               "GPUNET_ARCH_CUDA", "GPUNET_ARCH_MACA", "GPUNET_ARM_HOST", "GPUNET_ARM_CUDA",
               "GPUNET_ARM_MACA", "GPUNET_DELAY_POINT", "GPUNET_MLX5_HAVE_ARCH",
               "GPUNET_ARCH_HAS_E4M3X2", "GPUNET_ARCH_HAS_BULK_COPY", "GPUNET_EP_HT_BOUNDS"}


def _names_in_sources():
    names = set()
    for d in ("gpunet", "bench", "scripts"):
        for p in (ROOT / d).rglob("*"):
            if p.suffix in (".py", ".cuh", ".h", ".cu", ".sh", ".cpp") and p.name != "config.py":
                names |= set(re.findall(r"\bGPUNET_[A-Z0-9_]*[A-Z0-9]\b", p.read_text(errors="replace")))
    return names


def test_every_gpunet_name_in_the_sources_is_a_knob_or_a_code_macro():
    """A GPUNET_* variable or define used anywhere in the shipped sources, scripts or benches is
    listed in config.KNOBS (with type, default and doc), unless it is a known code macro."""
    missing = _names_in_sources() - {k.name for k in config.KNOBS} - CODE_MACROS
    assert not missing, "add these to gpunet/config.py's table: %s" % sorted(missing)


def test_every_knob_has_a_doc_and_a_known_kind():
    for k in config.KNOBS:
        assert k.kind in ("env", "define") and k.type in ("choice", "int", "path", "str", "flag")
        assert k.doc and len(k.doc) > 10, k.name
        assert k.type != "choice" or k.choices, k.name


def test_env_values_are_checked_against_the_table(monkeypatch):
    """A choice outside its set and a non-integer int raise ValueError naming the knob; unset and
    empty give the default; values are normalised (case, blanks)."""
    monkeypatch.setenv("GPUNET_PLATFORM", " CPU ")
    assert config.get("GPUNET_PLATFORM") == "cpu"
    monkeypatch.setenv("GPUNET_PLATFORM", "tpu")
    with pytest.raises(ValueError, match="GPUNET_PLATFORM"):
        config.get("GPUNET_PLATFORM")
    monkeypatch.setenv("GPUNET_HOST_MAX_THREADS", "many")
    with pytest.raises(ValueError, match="GPUNET_HOST_MAX_THREADS"):
        config.get("GPUNET_HOST_MAX_THREADS")
    monkeypatch.setenv("GPUNET_HOST_MAX_THREADS", "")
    assert config.get("GPUNET_HOST_MAX_THREADS") == 1024
    monkeypatch.delenv("GPUNET_CUDA_ARCH", raising=False)
    assert config.get("GPUNET_CUDA_ARCH") == "sm_90"
    with pytest.raises(KeyError):
        config.get("GPUNET_WARP_MIN_CHUNK")       # a build define, not an environment variable


def test_platform_reads_its_knobs_through_the_table(monkeypatch):
    """The platform layer turns a bad value into a ConfigError that says what is allowed."""
    from gpunet.host import platform as P
    monkeypatch.setenv("GPUNET_PLATFORM", "tpu")
    P.reset_platform()
    try:
        with pytest.raises(ConfigError, match="cpu, cuda, maca"):
            P.get_platform()
    finally:
        monkeypatch.delenv("GPUNET_PLATFORM")
        P.reset_platform()


def test_cli_prints_the_table():
    r = subprocess.run([sys.executable, "-m", "gpunet", "config"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    for k in config.KNOBS:
        assert k.name in r.stdout


def test_environ_sets_for_the_block_and_restores_even_after_an_error(monkeypatch):
    """config.environ: inside, the given values (None: left as it was); after, each variable as
    before the block (an unset one unset again), also when the block raised."""
    monkeypatch.setenv("GPUNET_TEST_A", "old")
    monkeypatch.delenv("GPUNET_TEST_B", raising=False)
    monkeypatch.setenv("GPUNET_TEST_C", "kept")
    with pytest.raises(RuntimeError):
        with config.environ({"GPUNET_TEST_A": "new", "GPUNET_TEST_B": "set", "GPUNET_TEST_C": None}):
            assert (os.environ["GPUNET_TEST_A"], os.environ["GPUNET_TEST_B"]) == ("new", "set")
            assert os.environ["GPUNET_TEST_C"] == "kept"
            raise RuntimeError("the block failed")
    assert os.environ["GPUNET_TEST_A"] == "old"
    assert "GPUNET_TEST_B" not in os.environ
    assert os.environ["GPUNET_TEST_C"] == "kept"
