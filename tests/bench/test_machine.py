"""A benchmark's machine line and result file name the code that ran: the checkout's commit, marked when changed."""

import subprocess
from pathlib import Path

from pagedserve.bench.machine import code_revision, machine_info


def _git(folder: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=folder, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_the_revision_is_the_checkouts_commit_and_a_changed_tracked_file_marks_it(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    (tmp_path / "untracked.txt").write_text("results\n")  # e.g. a new result file: not a change to the code
    assert code_revision(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert code_revision(tmp_path) == head + "+changes"


def test_outside_a_checkout_the_revision_is_unknown(tmp_path):
    assert code_revision(tmp_path) == "unknown"


def test_machine_info_carries_pagedserves_revision():
    here = Path(__file__).parent
    assert machine_info()["revision"].removesuffix("+changes") == _git(here, "rev-parse", "HEAD")
