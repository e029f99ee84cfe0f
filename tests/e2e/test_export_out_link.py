"""`shardwise export --out LINK`: a symbolic link in --out's place (to an empty directory, or to nothing) used to
be followed through the whole export and end in NotADirectoryError; it is refused in one line before anything is
loaded, and nothing is written through it."""

from __future__ import annotations

import os

import pytest

from tests.e2e.test_export_inputs import lora_run, one_line_error  # noqa: F401 - lora_run: the fixture
from tests.helpers import run_cli


@pytest.mark.parametrize("target", ["empty-dir", "nothing"])
def test_export_refuses_an_out_that_is_a_link_before_loading(lora_run, tmp_path, target):  # noqa: F811
    elsewhere = tmp_path / "elsewhere"
    if target == "empty-dir":
        elsewhere.mkdir()
    link = tmp_path / "out"
    os.symlink(elsewhere, link)
    line = one_line_error(run_cli("export", str(lora_run), "--out", str(link), check=False))
    assert line == (f"shardwise: error: --out {link}: a symbolic link (to {elsewhere}), which export does not "
                    "write through; give the directory itself or a new path"), line
    assert os.path.islink(link) and os.readlink(link) == str(elsewhere)  # the user's link as it was
    assert (os.listdir(elsewhere) == []) if target == "empty-dir" else not os.path.lexists(elsewhere)
    assert sorted(os.listdir(tmp_path)) == sorted(["out"] + (["elsewhere"] if target == "empty-dir" else []))


def test_the_link_is_refused_before_the_checkpoint_is_read(tmp_path):
    """The --out check comes first: a missing checkpoint is not even looked at (nothing is loaded for an export that
    could not be written)."""
    os.symlink(tmp_path / "nowhere", tmp_path / "out")
    line = one_line_error(run_cli("export", str(tmp_path / "no-such-checkpoint"), "--out", str(tmp_path / "out"),
                                  check=False))
    assert "a symbolic link" in line and "no-such-checkpoint" not in line, line
