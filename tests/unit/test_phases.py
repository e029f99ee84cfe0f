import os
import time

from shardwise import phases


def test_durations_are_the_gaps_between_marks_and_skip_missing_ones():
    marks = {"process_start": 100.0, "prepare_start": 100.5, "prepared": 102.0, "worker_start": 102.25}
    d = phases.durations(marks)
    assert d == {"imports": 0.5, "prepare": 1.5, "worker_start": 0.25}
    marks.update(setup_start=103.0, initialized=103.0, model_loaded=104.0, wrapped=104.5, ready=104.5,
                 first_step=105.0, trained=110.0, saved=111.0, exited=111.5)
    d = phases.durations(marks)
    assert d["time_to_first_step"] == 5.0 and d["total"] == 11.5 and d["exit"] == 0.5
    assert "total 11.50s" in phases.line(d) and phases.line(d).startswith("phases: imports 0.50s")


def test_process_start_is_in_the_past():
    assert phases.process_start() <= time.time()


def test_a_finished_process_kills_inductors_compile_workers_rather_than_wait_for_them():
    """torch's atexit handler waits for inductor's compile workers to stop (6-10 s on the H200 after a short run);
    a finished run's process kills them first, and the handler then has nothing to wait for and says nothing."""
    import subprocess
    import sys

    script = """
import sys, time, psutil
import torch._inductor.config as config
config.compile_threads = 2
from torch._inductor.async_compile import AsyncCompile
AsyncCompile.warm_pool()  # what torch.compile's first compile starts
workers = [c for c in psutil.Process().children(recursive=True) if "compile_worker" in " ".join(c.cmdline()[:3])]
assert workers, "no compile worker started"
from shardwise.phases import exit_without_teardown, stop_compile_workers
stop_compile_workers()
alive = [w.pid for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]
print("ALIVE", alive, flush=True)
exit_without_teardown(0)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ALIVE []" in r.stdout, r.stdout
    assert "Traceback" not in r.stderr and "pool shutdown" not in r.stderr, r.stderr[-3000:]


def test_a_finished_workers_teardown_cannot_hold_it_past_the_deadline():
    """phases.exit_deadline: a process whose run is complete leaves with 0 once the deadline passes, even while its
    main thread is stuck (here: sleeping as a hung barrier would wait), and says so on stderr."""
    import subprocess
    import sys

    script = ("import time\nfrom shardwise.phases import exit_deadline\nexit_deadline(1.0, 'rank 1')\n"
              "time.sleep(120)\nraise SystemExit(3)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and time.monotonic() - t0 < 30, (r.returncode, r.stderr)
    assert r.stderr.strip() == ("shardwise: rank 1: the finished run's process was still in its teardown after 1 s; "
                                "leaving (everything of the run is written)")


def test_a_teardown_holding_the_gil_still_ends_by_the_c_watchdog():
    """The deadline's timer is a Python thread; a teardown stuck in C code that holds the GIL (here: a regular
    expression that backtracks for hours, as a destructor joining a hung thread would hold it) never lets it run.
    faulthandler's watchdog needs no GIL: it prints the stuck stack and ends the process with 1."""
    import subprocess
    import sys

    script = ("import re\nfrom shardwise.phases import exit_deadline\nexit_deadline(0.5, 'rank 1', backstop_s=1.0)\n"
              "re.match(r'(a+)+$', 'a' * 64 + 'b')\nraise SystemExit(3)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and time.monotonic() - t0 < 30, (r.returncode, r.stderr)
    assert "Timeout (0:00:01.500000)!" in r.stderr and 'File "<string>", line 4' in r.stderr, r.stderr
    assert "leaving (everything of the run is written)" not in r.stderr  # the Python timer never ran


def _unset_for_this_test(monkeypatch, name: str) -> None:
    """monkeypatch.delenv of a variable that is not set records nothing to undo: set it first, so that whatever
    sets it during the test (the code under test, torch) is undone afterwards."""
    monkeypatch.setenv(name, "unset by the test")
    monkeypatch.delenv(name)


def test_compile_caches_live_under_the_shardwise_cache_dir(tmp_path, monkeypatch):
    """torch's default ($TMPDIR/torchinductor_$USER) is emptied by a reboot: the compiled blocks are kept under
    $SHARDWISE_CACHE_DIR/compile/<host> instead, where torch itself looks (its own cache_dir()), unless the user
    chose a place. What is cached there runs in the training process: a folder that others can write (or a link,
    or a file) leaves torch's default, and the folders are made private."""
    import socket
    import stat

    from torch._inductor.runtime.cache_dir_utils import cache_dir as torch_cache_dir

    from shardwise.hardware import use_compile_cache

    _unset_for_this_test(monkeypatch, "TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))
    want = str(tmp_path / "cache" / "compile" / socket.gethostname())
    assert use_compile_cache() == want and torch_cache_dir() == want
    assert stat.S_IMODE(os.stat(tmp_path / "cache" / "compile").st_mode) == 0o700
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == str(tmp_path / "mine") and torch_cache_dir() == str(tmp_path / "mine")

    def refused(cache):
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(cache))
        return use_compile_cache() is None and "TORCHINDUCTOR_CACHE_DIR" not in os.environ

    (tmp_path / "file").write_text("not a directory")
    assert refused(tmp_path / "file") and (tmp_path / "file").read_text() == "not a directory"
    shared = tmp_path / "shared"
    (shared / "compile").mkdir(parents=True)
    os.chmod(shared / "compile", 0o777)  # a folder anyone may write to
    assert refused(shared)
    os.chmod(shared / "compile", 0o700)
    assert use_compile_cache() == str(shared / "compile" / socket.gethostname())
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "compile").symlink_to(shared / "compile")
    assert refused(linked)


def test_the_launcher_points_the_workers_compile_cache_only_where_blocks_compile(tmp_path, monkeypatch):
    """Set in the launcher before any worker starts (they inherit its environment), for runs that compile."""
    import socket

    from shardwise import config
    from shardwise.launch.prep import _begin

    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))
    for compile_key, want in (("off", None), ("on", str(tmp_path / "cache" / "compile" / socket.gethostname()))):
        _unset_for_this_test(monkeypatch, "TORCHINDUCTOR_CACHE_DIR")
        res = config.load_config(None, {"compile": (compile_key, "--compile"),
                                        "output_dir": (str(tmp_path / f"run-{compile_key}"), "--output-dir")})
        _, lock, _ = _begin(res)
        if lock is not None:
            lock.release()
        assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == want



GC_SCRIPT = r"""
import gc, json, weakref
from shardwise import phases

class Node:
    pass

def churn(n):
    # long-lived objects (the heap grows, as imports grow it) and cycles dropped at once (freed by young passes)
    keep, freed = [], []
    for i in range(n):
        keep.append({"i": i, "l": [i]})
        a, b = Node(), Node()
        a.b, b.a = b, a
        freed.append(weakref.ref(a))
        del a, b
    return keep, freed

before = gc.get_threshold()
phases.hold_full_gc()
held = gc.get_threshold()
full0, young0 = gc.get_stats()[2]["collections"], gc.get_stats()[0]["collections"]
keep, freed = churn(300000)
gc.collect(1)  # what the young passes do on their own: the last cycles are in generation 0 or 1
full1, young1 = gc.get_stats()[2]["collections"], gc.get_stats()[0]["collections"]
phases.release_full_gc()
phases.release_full_gc()  # a second release changes nothing
print(json.dumps({"before": before, "held": held, "after": gc.get_threshold(), "full": full1 - full0,
                  "young": young1 - young0, "cycles_left": sum(r() is not None for r in freed),
                  "frozen": gc.get_freeze_count(), "kept": len(keep)}))
"""


def test_holding_full_collections_skips_them_but_still_frees_young_cycles_and_release_restores():
    """phases.hold_full_gc (the launcher's and the workers' start): no full pass while the heap grows, the young
    generations still free dropped cycles; release_full_gc freezes what is alive and restores the thresholds."""
    import json
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-c", GC_SCRIPT], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["held"][:2] == r["before"][:2] and r["held"][2] > 10 ** 6  # only the oldest generation's threshold
    assert r["full"] == 0 and r["young"] > 100  # no full pass during a growth that, unheld, triggers several
    # dropped cycles were still freed by the young passes, all but the few a pass caught alive (promoted before they
    # were dropped: those wait for a full pass, and the release freezes them)
    assert r["cycles_left"] < 300000 // 1000
    assert r["after"] == r["before"] and r["frozen"] >= r["kept"]


def test_unheld_the_same_growth_triggers_full_collections():
    """The control for the test above: without the hold, the same script's growth makes CPython run full passes."""
    import json
    import subprocess
    import sys

    script = GC_SCRIPT.replace("phases.hold_full_gc()", "pass")
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["full"] > 0
