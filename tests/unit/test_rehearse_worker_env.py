"""The rehearsal's worker runs in its own temporary folder: a relative PYTHONPATH (`PYTHONPATH=src`, as a checkout
is often run) must still name the same folders there, or the worker cannot import shardwise."""

from __future__ import annotations

import os

from shardwise.plan.rehearse import worker_env


def test_relative_pythonpath_entries_are_made_absolute_against_the_planners_folder():
    path = os.pathsep.join(["src", "/opt/site", ".", "", "../lib"])
    env = worker_env({"PYTHONPATH": path, "HOME": "/root"}, "/work/repo")
    assert env["PYTHONPATH"].split(os.pathsep) == ["/work/repo/src", "/opt/site", "/work/repo/.", "/work/repo/../lib"]
    assert env["HOME"] == "/root"


def test_no_pythonpath_is_left_as_it_is():
    assert worker_env({"HOME": "/root"}, "/work/repo") == {"HOME": "/root"}
    assert worker_env({"PYTHONPATH": ""}, "/work/repo") == {"PYTHONPATH": ""}
