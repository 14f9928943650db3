"""scripts/ab.sh: the A/B of device code in one lease (prepare here, run on the device machine)."""
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(repo, *args):
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, env=env)


def test_prepare_copies_each_side_and_run_alternates_then_restores_new(tmp_path):
    """prepare OLD: _ab/old and _ab/new hold every code file that differs (a file absent on one
    side as a marker; bench/results/ and unchanged files left out). run 2 CMD: CMD sees new1,
    old1, new2, old2 in that order with that side's files in the tree (the absent file removed on
    the old side), and the tree ends on the new side."""
    repo = tmp_path / "r"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "ab.sh", repo / "scripts" / "ab.sh")
    (repo / "gpunet" / "device").mkdir(parents=True)
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "gpunet" / "device" / "a.cuh").write_text("v1\n")
    (repo / "gpunet" / "device" / "same.cuh").write_text("same\n")
    (repo / "bench" / "results" / "x.json").write_text("1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    (repo / "gpunet" / "device" / "a.cuh").write_text("v2\n")
    (repo / "gpunet" / "device" / "b.cuh").write_text("new file\n")
    (repo / "bench" / "results" / "x.json").write_text("2\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "two")

    p = subprocess.run(["bash", "scripts/ab.sh", "prepare", "HEAD~1"], cwd=repo,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    ab = repo / "_ab"
    assert (ab / "old" / "gpunet" / "device" / "a.cuh").read_text() == "v1\n"
    assert (ab / "new" / "gpunet" / "device" / "a.cuh").read_text() == "v2\n"
    assert (ab / "old" / "gpunet" / "device" / "b.cuh.ab-absent").exists()
    assert (ab / "new" / "gpunet" / "device" / "b.cuh").read_text() == "new file\n"
    assert not (ab / "old" / "gpunet" / "device" / "same.cuh").exists()
    assert not (ab / "old" / "bench").exists() and not (ab / "new" / "bench").exists()

    log = tmp_path / "log"
    cmd = ('echo "$AB_TAG $(cat gpunet/device/a.cuh) $(test -e gpunet/device/b.cuh && echo b || echo no-b)" >> %s'
           % log)
    p = subprocess.run(["bash", "scripts/ab.sh", "run", "2", "sh", "-c", cmd], cwd=repo,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    assert log.read_text().splitlines() == ["new1 v2 b", "old1 v1 no-b", "new2 v2 b", "old2 v1 no-b"]
    assert (repo / "gpunet" / "device" / "a.cuh").read_text() == "v2\n" and (repo / "gpunet" / "device" / "b.cuh").exists()

    # a failing run still ends on the new side and reports the failure
    p = subprocess.run(["bash", "scripts/ab.sh", "run", "1", "sh", "-c", "exit 3"], cwd=repo,
                       capture_output=True, text=True)
    assert p.returncode == 3 and "old1 exited 3" in p.stdout
    assert (repo / "gpunet" / "device" / "a.cuh").read_text() == "v2\n"
