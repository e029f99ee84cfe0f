"""Bad or odd input found by trying the CLI as a new user: each is refused in one line naming
the key and where it came from (or, for `~`, taken as the user meant it), before anything runs."""

from __future__ import annotations

import argparse
import os
import shutil

import pytest

from shardwise import config
from shardwise.errors import ShardwiseError


def flags(*argv):
    p = argparse.ArgumentParser()
    config.add_flags(p)
    return config.flags_from_namespace(p.parse_args(list(argv)))


def write(tmp_path, text, name="run.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text and len(text) < 400, text
    return text


# -- `~` in a path is the home directory, as in a shell (not a directory named `~` in the current one) ---------

def test_a_tilde_in_path_keys_is_the_home_directory(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    path = write(tmp_path, "output_dir: ~/runs/a\nval_data: ~/val.jsonl\nchat_template: ~/t.jinja\n"
                           "data: [~/a.jsonl, {path: ~/b.jsonl, weight: 0.5}]\n")
    res = config.load_config(path, flags("--resume", "~/runs/a/checkpoints/step_00000002"))
    c = res.cfg
    assert c.output_dir == f"{home}/runs/a"
    assert c.val_data == f"{home}/val.jsonl" and c.chat_template == f"{home}/t.jinja"
    assert c.data == f"{home}/a.jsonl,{home}/b.jsonl:0.5"
    assert c.resume == f"{home}/runs/a/checkpoints/step_00000002"
    res = config.load_config(None, flags("--output-dir=~/x", "--data", "~/a.jsonl:3,demo:0.5", "--model", "~/m"))
    assert res.cfg.output_dir == f"{home}/x" and res.cfg.data == f"{home}/a.jsonl:3,demo:0.5"
    assert res.cfg.model == f"{home}/m"
    assert config.load_config(None, flags("--resume", "auto")).cfg.resume == "auto"


# -- a key given twice is a mistake, not "the last one wins" ----------------------------------------------------

def test_a_key_given_twice_in_the_yaml_is_refused_naming_both_lines(tmp_path):
    with pytest.raises(ShardwiseError) as e:
        config.load_config(write(tmp_path, "max_steps: 2\nlr: 0.1\nmax_steps: 3\n"))
    line = one_line(e)
    assert line.startswith(f"{tmp_path / 'run.yaml'}:3:") and "'max_steps'" in line and "line 1" in line
    with pytest.raises(ShardwiseError) as e:
        config.load_config(write(tmp_path, "strategy: fsdp\nfsdp:\n  prefetch: false\n  prefetch: true\n"))
    line = one_line(e)
    assert line.startswith(f"{tmp_path / 'run.yaml'}:4:") and "'fsdp.prefetch'" in line and "line 3" in line


# -- values that pass the type check but cannot run ------------------------------------------------------------

@pytest.mark.parametrize("item, what", [("{path: a.jsonl, weight: .nan}", "weight"),
                                        ("{path: a.jsonl, weight: -1}", "weight"),
                                        ("{path: a.jsonl, weight: 0}", "weight"),
                                        ("{path: a.jsonl, count: 0}", "count"),
                                        ("{path: a.jsonl, count: -3}", "count")])
def test_a_yaml_data_weight_or_count_out_of_range_names_the_source(tmp_path, item, what):
    with pytest.raises(ShardwiseError) as e:
        config.load_config(write(tmp_path, f"data: [b.jsonl, {item}]\n"))
    line = one_line(e)
    assert line.startswith(f"{tmp_path / 'run.yaml'}:1: data source 2") and what in line, line


@pytest.mark.parametrize("text", ["model: null\ndata: a.jsonl\n", "model: ''\ndata: a.jsonl\n",
                                  "model: '  '\ndata: a.jsonl\n"])
def test_an_empty_model_is_refused_at_its_line(tmp_path, text):
    with pytest.raises(ShardwiseError) as e:
        config.load_config(write(tmp_path, text))
    assert one_line(e).startswith(f"{tmp_path / 'run.yaml'}:1: model is empty")


@pytest.mark.parametrize("value", ["-1", "4294967296", "100000000000000000000000"])
def test_a_seed_out_of_range_is_refused(value):
    with pytest.raises(ShardwiseError, match=r"^flag --seed: seed must be in \[0, 4294967295\]"):
        config.load_config(None, flags("--seed", value))
    assert config.load_config(None, flags("--seed", "4294967295")).cfg.seed == 2**32 - 1


def test_a_collective_timeout_too_large_for_the_process_group_is_refused():
    with pytest.raises(ShardwiseError, match=r"^flag --collective-timeout: collective_timeout must be at most"):
        config.load_config(None, flags("--collective-timeout", "1e300"))
    assert config.load_config(None, flags("--collective-timeout", "86400")).cfg.collective_timeout == 86400


@pytest.mark.parametrize("targets", ["", " ", ",", " , "])
def test_empty_lora_targets_are_refused_with_lora(targets):
    with pytest.raises(ShardwiseError, match=r"^flag --lora-targets: lora.targets is empty"):
        config.load_config(None, flags("--tuner", "lora", "--lora-targets", targets))
    with pytest.raises(ShardwiseError, match=r"^flag --lora-targets: lora.targets is set but tuner is full"):
        config.load_config(None, flags("--lora-targets", targets))  # never dropped without a word


def test_a_missing_deepspeed_config_is_refused_before_launch(tmp_path):
    with pytest.raises(ShardwiseError) as e:
        config.load_config(None, flags("--strategy", "zero2", "--deepspeed-config", str(tmp_path / "nope.json")))
    assert one_line(e).startswith(f"flag --deepspeed-config: {tmp_path / 'nope.json'}: no such file")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(ShardwiseError) as e:
        config.load_config(None, flags("--strategy", "zero2", "--deepspeed-config", str(bad)))
    assert one_line(e).startswith(f"flag --deepspeed-config: {bad}: not a JSON object")
    good = tmp_path / "ds.json"
    good.write_text('{"gradient_clipping": "auto", "zero_optimization": {"overlap_comm": true}}')
    assert config.load_config(None, flags("--strategy", "zero2", "--deepspeed-config", str(good)))
    assert os.path.isfile(good)


# -- chat: a bad option is one line before the model is loaded -------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (("--device", "banana"), "--device banana: not a device; use cpu, cuda or cuda:N (or auto)"),
    (("--device", "meta"), "--device meta: not a device; use cpu, cuda or cuda:N (or auto)"),
    (("--temperature", "1", "--top-p", "-1"), "--top-p must be in (0, 1], got -1.0"),
    (("--temperature", "1", "--top-p", "0"), "--top-p must be in (0, 1], got 0.0"),
    (("--temperature", "1", "--top-p", "1.5"), "--top-p must be in (0, 1], got 1.5"),
    (("--temperature", "nan",), "--temperature must be a finite number >= 0, got nan"),
    (("--temperature", "inf",), "--temperature must be a finite number >= 0, got inf"),
    (("--seed", "100000000000000000000000"), "--seed must be in [0, 2^63), got 100000000000000000000000"),
])
def test_chat_refuses_bad_options_in_one_line(tiny_dir, capsys, args, message):
    from shardwise.cli import main

    rc = main(["chat", tiny_dir, "--prompt", "hi", "--max-new-tokens", "1", *args])
    out, err = capsys.readouterr()
    assert rc == 2 and err == f"shardwise: error: {message}\n" and out == "", (out, err)


# -- an output directory that cannot be made is one line before anything starts ------------------------------

@pytest.mark.parametrize("make, message", [
    (lambda t: t / "notes.txt" / "run", "is a file, not a directory: nothing can be created under it"),
    (lambda t: t / "notes.txt" / "a" / "b", "is a file, not a directory: nothing can be created under it"),
    (lambda t: t / ("x" * 300), "a name in it is longer than 255 bytes"),
])
def test_an_output_dir_that_cannot_be_created_is_one_line(tmp_path, capsys, make, message):
    from shardwise.cli import main

    (tmp_path / "notes.txt").write_text("the user's")
    out = make(tmp_path)
    rc = main(["train", "--output-dir", str(out), "--strategy", "single", "--nproc-per-node", "1", "--max-steps", "1"])
    stdout, err = capsys.readouterr()
    assert rc == 2 and err.startswith("shardwise: error: flag --output-dir: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"] and (tmp_path / "notes.txt").read_text() == "the user's"


@pytest.mark.parametrize("make, message", [
    (lambda t: t / "notes.txt" / "exp", "is a file, not a directory: nothing can be created under it; choose "
                                        "another --out"),
    (lambda t: t / ("x" * 300), "a name in it is longer than 255 bytes"),
])
def test_an_export_out_that_cannot_be_created_is_one_line(tmp_path, capsys, make, message):
    from shardwise.cli import main

    (tmp_path / "notes.txt").write_text("the user's")
    rc = main(["export", str(tmp_path / "no-checkpoint"), "--out", str(make(tmp_path))])
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith("shardwise: error: --out: ") and message in err, err
    assert err.count("\n") == 1 and sorted(os.listdir(tmp_path)) == ["notes.txt"]


def test_export_takes_a_tilde_as_the_home_directory(tmp_path, capsys, monkeypatch):
    from shardwise.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    rc = main(["export", "~/no-checkpoint", "--out", "~/exp"])
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith(f"shardwise: error: {tmp_path}/no-checkpoint does not exist"), err


# -- a resume never writes over a directory of the user's --------------------------------------------------------

@pytest.mark.parametrize("resume", ["auto", "elsewhere/checkpoints/step_00000002"])
def test_a_resume_into_a_users_own_directory_is_refused_and_nothing_is_touched(tmp_path, capsys, monkeypatch, resume):
    """--resume skipped the check for names shardwise did not mark: with no checkpoint there, the run started fresh
    and replaced the user's config.yaml, metrics.jsonl and final/."""
    from shardwise.cli import main

    monkeypatch.chdir(tmp_path)
    user = tmp_path / "mine"
    (user / "final").mkdir(parents=True)
    files = {"config.yaml": "my own config\n", "metrics.jsonl": '{"mine": 1}\n', "final/README": "my model\n"}
    for name, text in files.items():
        (user / name).write_text(text)
    rc = main(["train", "--output-dir", str(user), "--resume", resume, "--strategy", "single",
               "--nproc-per-node", "1", "--max-steps", "1"])
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith(f"shardwise: error: flag --output-dir: {user} holds config.yaml, metrics.jsonl, "
                                      "final that shardwise did not mark"), err
    assert err.count("\n") == 1
    assert sorted(str(p.relative_to(user)) for p in user.rglob("*")) == ["config.yaml", "final", "final/README",
                                                                         "metrics.jsonl"]
    assert all((user / name).read_text() == text for name, text in files.items())


def test_resume_auto_of_a_run_without_checkpoints_does_not_replace_it(tmp_path, capsys, monkeypatch):
    """A run that trained without --save-every, then `--resume auto` (what the 'holds another run' line suggests):
    there is nothing to resume, so the run started again and replaced the trained final/ and metrics.jsonl."""
    from shardwise import rundir
    from shardwise.cli import main

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    rundir.mark(str(run))
    (run / "final" / "model.safetensors").write_bytes(b"trained weights")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    argv = ["train", "--output-dir", str(run), "--resume", "auto", "--strategy", "single", "--nproc-per-node", "1",
            "--max-steps", "1"]
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith(f"shardwise: error: flag --resume: {run} holds a run that trained but no "
                                      "checkpoint to resume"), err
    assert "--overwrite" in err and err.count("\n") == 1
    assert (run / "final" / "model.safetensors").read_bytes() == b"trained weights"
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'


# -- a flag argparse refuses is one line too, not 50 lines of usage above it ------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["train", "--max-stepz", "3"], "unrecognized arguments: --max-stepz (did you mean --max-steps?)"),
    (["train", "--strategy"], "argument --strategy: expected one argument"),
    (["trian"], "argument COMMAND: invalid choice: 'trian'"),
    (["plan", "--gpuz", "2"], "unrecognized arguments: --gpuz (did you mean --gpus?); see `shardwise plan --help`"),
    # the suggestion is one of the command's own flags (train's --max-steps is not bench's)
    (["bench", "--max-steps", "2"], "--max-steps (did you mean --steps?); see `shardwise bench --help`"),
    (["--bogus"], "unrecognized arguments: --bogus; see `shardwise --help`"),
    (["export", "x"], "the following arguments are required: --out"),
])
def test_an_argparse_error_is_one_line(capsys, argv, message):
    from shardwise.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("shardwise: error: ") and message in err and "--help" in err, err


# -- text that is not text: a lone surrogate (a JSON "\udcff" escape, a non-UTF-8 byte in argv) ------------------

@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user", "content": "q\\udcff"}, {"role": "assistant", "content": "a"}]}',
     r"message 1 holds an unpaired surrogate \(\\udcff at character 2\)"),
    ('{"text": "a \\ud800 b"}', r"field 'text' holds an unpaired surrogate \(\\ud800 at character 3\)"),
    ('{"instruction": "q", "output": "a", "history": [["x\\udc80", "y"]]}',
     r"field 'history' holds an unpaired surrogate \(\\udc80 at character 2\)"),
    ('{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "system": "\\udfff"}',
     r"field 'system' holds an unpaired surrogate"),
])
def test_a_record_with_a_lone_surrogate_is_a_bad_record_with_its_line(tmp_path, line, message):
    """Valid JSON, invalid Unicode (seen in scraped data): the tokenizer raised a TypeError traceback, no line."""
    from shardwise.data.sources import read_records

    good = '{"text": "fine"}' if '"text"' in line else line.replace("\\ud", "d").replace("\\udc", "dc")
    path = tmp_path / "d.jsonl"
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(ShardwiseError, match=rf"^{path}:2: {message}"):
        read_records(str(path))
    records, stats = read_records(str(path), skip_bad=True)
    assert len(records) == 1 and stats.skipped == 1


@pytest.mark.parametrize("key, flag", [("system", "--system"), ("columns", "--columns")])
def test_a_flag_value_that_is_not_text_is_one_line(key, flag):
    with pytest.raises(ShardwiseError, match=rf"^flag {flag}: '{key}' is not valid text: byte 0xff"):
        config.load_config(None, flags(flag, "a\udcffb"))


def test_a_path_that_is_not_utf8_is_still_a_path(tmp_path, capsys):
    """A Latin-1 file name reaches Python as surrogate escapes; it opens, so it is not refused as text."""
    from shardwise import rundir

    name = os.fsdecode(b"caf\xe9")
    assert config.load_config(None, flags("--output-dir", str(tmp_path / name))).cfg.output_dir.endswith(name)
    rundir.check_creatable(str(tmp_path / name / "run"))


def test_chat_text_that_is_not_text_is_replaced(tiny_dir, capsys):
    from shardwise.cli import main

    rc = main(["chat", tiny_dir, "--prompt", "hi \udcff", "--system", "\udcff", "--max-new-tokens", "1",
               "--chat-template", "chatml"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("template, start, message", [
    # not Jinja at all: refused where the template is chosen, with its file and line
    ("{% if %}", "shardwise: error: --chat-template ", "t.jinja: line 1: not valid Jinja (Expected an expression"),
    ("{{ raise_exception('only system and user turns, alternating') }}", "shardwise: error: chat ",
     "cannot render this conversation (only system and user turns, alternating)"),
])
def test_chat_with_a_template_that_cannot_render_is_one_line(tiny_dir, tmp_path, capsys, template, start, message):
    from shardwise.cli import main

    path = tmp_path / "t.jinja"
    path.write_text(template)
    rc = main(["chat", tiny_dir, "--prompt", "hi", "--max-new-tokens", "1", "--chat-template", str(path)])
    out, err = capsys.readouterr()
    line = err.splitlines()[-1]
    assert rc == 2 and line.startswith(start) and message in line, err
    assert "Traceback" not in err


@pytest.mark.parametrize("final, message", [
    (True, "this run saved no checkpoint (it ran without --save-every); its final/ is already a Hugging Face "
           "directory"),
    (False, "this run saved no checkpoint (it ran without --save-every) and no final model"),
])
def test_export_of_a_run_without_checkpoints_says_what_there_is(tmp_path, capsys, final, message):
    from shardwise import rundir
    from shardwise.cli import main

    run = tmp_path / "run"
    run.mkdir()
    rundir.mark(str(run))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    if final:
        (run / "final").mkdir()
        (run / "final" / "config.json").write_text("{}")
    rc = main(["export", str(run), "--out", str(tmp_path / "exp")])
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith(f"shardwise: error: {run}: {message}") and err.count("\n") == 1, err
    assert not (tmp_path / "exp").exists()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root to run as another user")
def test_an_output_dir_this_user_cannot_write_is_one_line():
    """As an unprivileged user (root writes anywhere): a directory of someone else's, existing or as a parent."""
    import pathlib
    import subprocess
    import sys
    import tempfile

    top = tempfile.mkdtemp(prefix="shardwise-theirs-")  # pytest's tmp_path is not reachable by another user
    os.chmod(top, 0o755)
    theirs = pathlib.Path(top) / "theirs"
    theirs.mkdir(mode=0o755)
    src = os.path.dirname(os.path.dirname(os.path.abspath(config.__file__)))
    for out in (theirs, theirs / "sub" / "run"):
        p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-m",
                            "shardwise", "train", "--output-dir", str(out), "--strategy", "single", "--max-steps", "1"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": src, "HOME": "/nonexistent"},
                           cwd="/", timeout=120)
        assert p.returncode == 2 and p.stderr == (f"shardwise: error: flag --output-dir: {theirs} is not writable by "
                                                  f"this user, so {out} cannot be written; choose another "
                                                  "--output-dir\n"), p.stderr
    assert os.listdir(theirs) == []
    shutil.rmtree(top)


# -- the run's config.yaml repeats the run from any directory ------------------------------------------------------

def test_the_written_config_names_absolute_paths(tmp_path, monkeypatch):
    """'repeat with: shardwise train RUN/config.yaml' is printed with an absolute path, but the file held the paths
    as typed (relative to where the run was started), so the repeat failed anywhere else."""
    proj, elsewhere = tmp_path / "proj", tmp_path / "elsewhere"
    (proj / "data").mkdir(parents=True)
    elsewhere.mkdir()
    (proj / "tmpl.jinja").write_text("{{ messages }}")
    (proj / "ds.json").write_text("{}")
    monkeypatch.chdir(proj)
    res = config.load_config(None, flags("--data", "data/a.jsonl:0.5,demo:0.5,data/b.jsonl:30,c.parquet",
                                         "--val-data", "data/v.jsonl", "--chat-template", "tmpl.jinja",
                                         "--strategy", "zero2", "--deepspeed-config", "ds.json",
                                         "--model", "models/m"))
    text = config.to_yaml(res.cfg)
    monkeypatch.chdir(elsewhere)
    back = config.load_config(write(elsewhere, text, "config.yaml")).cfg
    assert back.data == f"{proj}/data/a.jsonl:0.5,demo:0.5,{proj}/data/b.jsonl:30,{proj}/c.parquet"
    assert back.val_data == f"{proj}/data/v.jsonl" and back.chat_template == f"{proj}/tmpl.jinja"
    assert back.model == f"{proj}/models/m" and back.deepspeed.config == f"{proj}/ds.json"
    import yaml

    shipped = config.to_yaml(config.load_config(None, flags("--chat-template", "chatml", "--data", "demo")).cfg)
    assert yaml.safe_load(shipped)["chat_template"] == "chatml" and yaml.safe_load(shipped)["data"] == "demo"
    assert yaml.safe_load(shipped)["model"] == "tiny" and yaml.safe_load(shipped)["val_data"] == ""


def test_a_template_that_renders_no_assistant_text_is_not_blamed_on_seq_len(tiny_dir):
    """A chat template that leaves the turns out: every example had no loss token, and the line said 'raise
    --seq-len' (which never helps)."""
    from shardwise.data.encode import ChatOptions, encode
    from shardwise.data.formats import Record
    from shardwise.models.load import load_tokenizer

    tok = load_tokenizer(tiny_dir)
    tok.chat_template = "static text only"
    recs = [Record("chat", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "d.jsonl:1")]
    with pytest.raises(ShardwiseError) as e:
        encode(recs, tok, 64, False, ChatOptions())
    line = one_line(e)
    assert "d.jsonl:1" in line and "chat template" in line and "--seq-len" not in line, line


def test_the_run_lock_never_writes_through_a_link(tmp_path):
    """A `.shardwise-lock` that is a symbolic link (planted, or copied with a directory) is refused in one line; the
    file it points to keeps its content (the lock writes the launcher's PID into its file)."""
    from shardwise import rundir

    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(victim, run / rundir.LOCK)
    with pytest.raises(ShardwiseError, match=r"^output_dir: .*\.shardwise-lock is a symbolic link") as e:
        rundir.RunLock(str(run)).acquire()
    assert "\n" not in str(e.value)
    assert victim.read_text() == "keep me\n"
    os.unlink(run / rundir.LOCK)
    lock = rundir.RunLock(str(run))
    lock.acquire()  # the plain file: taken, with this PID
    try:
        assert rundir.holder(str(run)) == os.getpid()
    finally:
        lock.release()


def test_a_missing_validation_file_is_blamed_on_val_data(tmp_path):
    from shardwise.launch.prep import validation_records

    res = config.load_config(None, {"val_data": (str(tmp_path / "nope.jsonl"), "--val-data")})
    with pytest.raises(ShardwiseError) as e:
        validation_records(res.cfg, res, [])
    assert str(e.value) == (f"--val-data {tmp_path / 'nope.jsonl'}: no such file or directory; give a data file, "
                            "a directory of them")


def test_a_cache_dir_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    """$SHARDWISE_CACHE_DIR holds the tiny model, the tokenized data and doctor.json: a file there (or on its path)
    was a FileExistsError traceback from whichever command wrote first."""
    from shardwise.cli import main

    f = tmp_path / "cache"
    f.write_text("mine\n")
    for path, why in ((f, "is a file, not a directory; point it at a directory"),
                      (f / "sub", "is a file, not a directory: nothing can be created under it")):
        monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(path))
        assert main(["plan", "--model", "7B", "--gpus", "1", "--gpu-memory", "80"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and err.startswith(f"shardwise: error: SHARDWISE_CACHE_DIR={path}")
        assert why in err, err
    assert f.read_text() == "mine\n"


def test_lora_targets_the_model_lacks_are_refused_before_anything_is_written():
    """Checked on the meta-device model of launch.preflight.check_model (it ran in each worker, after the run directory was
    written)."""
    from shardwise.launch.preflight import check_model

    res = config.load_config(None, {"tuner": ("lora", "--tuner"), "lora.targets": ("q_proj,nosuch", "--lora-targets")})
    with pytest.raises(ShardwiseError) as e:
        check_model(res.cfg, res)
    assert str(e.value).startswith("--lora-targets: no linear module named nosuch in the model; its linear "
                                   "modules are "), str(e.value)
    ok = config.load_config(None, {"tuner": ("lora", "--tuner"), "lora.targets": ("q_proj,v_proj", "--lora-targets")})
    assert check_model(ok.cfg, ok)  # the model directory


@pytest.mark.parametrize("text", ["[]", "\ufeff[ \n ]\n"])
def test_an_empty_json_array_file_says_so(tmp_path, text):
    from shardwise.data.sources import read_records

    f = tmp_path / "empty.json"
    f.write_text(text, encoding="utf-8")
    with pytest.raises(ShardwiseError) as e:
        read_records(str(f))
    assert str(e.value) == f"{f}: an empty JSON array ([]): no records; give records in it, or leave the file out"


@pytest.mark.parametrize("text", ["[1, 2]", '["a", "b"]', "[[1]]"])
def test_a_json_array_of_non_records_says_so(tmp_path, text):
    from shardwise.data.sources import read_records

    f = tmp_path / "rows.json"
    f.write_text(text)
    with pytest.raises(ShardwiseError, match=r"a JSON array whose first item is not an object"):
        read_records(str(f))


def test_a_lora_rank_above_the_adapted_linears_is_refused_with_the_models_numbers():
    """The tiny model's k/v projections are 128 -> 64: rank 64 is the most they take (a rank of 1e11 ran out of
    memory in every worker)."""
    from shardwise.launch.preflight import check_model

    res = config.load_config(None, {"tuner": ("lora", "--tuner"), "lora.r": ("65", "--lora-r")})
    with pytest.raises(ShardwiseError) as e:
        check_model(res.cfg, res)
    assert str(e.value) == ("--lora-r: lora.r 65 is larger than the smallest adapted linear allows (k_proj: 128 -> "
                            "64); a rank above min(in, out) adds parameters, not rank: choose --lora-r 64 or less")
    only_q = config.load_config(None, {"tuner": ("lora", "--tuner"), "lora.r": ("65", "--lora-r"),
                                       "lora.targets": ("q_proj", "--lora-targets")})
    assert check_model(only_q.cfg, only_q)  # q_proj is 128 -> 128


def test_padding_free_on_for_an_unlisted_family_is_refused_before_anything_is_written(tiny_dir, tmp_path, capsys):
    """The model family is read from config.json by the launcher's model check (it was refused only in the workers,
    after the run directory was written)."""
    import json

    from shardwise.cli import main

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    out = tmp_path / "run"
    rc = main(["train", "--model", str(model), "--data", "demo", "--padding-free", "on", "--output-dir", str(out), "--strategy",
               "single", "--nproc-per-node", "1", "--max-steps", "1"])
    stdout, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("shardwise: error: flag --padding-free: a flattened micro-batch keeps its rows apart"), err
    assert "not the model's 'gpt2' (model_type in its config.json); use --padding-free auto or off" in err
    assert not out.exists()


def test_more_ranks_than_cores_gets_a_note():
    """torchrun starts 64 ranks on 2 cores without a word; the run directory line is followed by a note."""
    from shardwise.launch.common import oversubscribed

    cores = len(os.sched_getaffinity(0))
    assert oversubscribed(cores) is None and oversubscribed(1) is None
    assert oversubscribed(cores + 1) == (f"note: {cores + 1} ranks on this node's {cores} CPU core(s): they share "
                                         f"cores, so each step is slower than with --nproc-per-node {cores} or fewer")


@pytest.mark.parametrize("name, says", [
    ("rows.parquet", "not a Parquet file (it does not start with PAR1)"),
    ("rows.arrow", "not an Arrow file (it does not start with ARROW1 (or an Arrow stream's 0xFFFFFFFF))"),
])
def test_a_parquet_or_arrow_file_without_its_format_is_named_as_such(tmp_path, name, says):
    """Random bytes named .parquet were read as JSON lines ("line 1: not valid UTF-8 ... --skip-bad-records")."""
    from shardwise.data.sources import read_records

    f = tmp_path / name
    f.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(ShardwiseError) as e:
        read_records(str(f))
    assert str(e.value) == f"{f}: {says}; re-export it, or rename it if it holds JSON lines"


@pytest.mark.parametrize("text", ["", "# settings to come\n\n", "{}\n"])
def test_an_empty_config_file_is_refused_not_the_demo(tmp_path, text):
    """An empty CONFIG (only comments, or {}) trained the built-in tiny model on the demo data without a word; with
    a flag naming the model or the data it is a file of settings still to come, and the flags are the run."""
    f = write(tmp_path, text)
    with pytest.raises(ShardwiseError) as e:
        config.load_config(str(f), {})
    assert one_line(e) == (f"{f}: the config file is empty (no key in it) and no --model or --data is given; give "
                           "the run's keys (docs/config.md), or leave the file out and use flags")
    from shardwise.cli import main

    # bench names the demo data itself where none is given: not the user's naming of a run
    assert main(["bench", str(f), "--strategies", "single", "--steps", "1", "--warmup", "0",
                 "--nproc-per-node", "1", "--runs-dir", str(tmp_path / "bench")]) == 2
    assert not (tmp_path / "bench").exists()
    from tests.helpers import write_jsonl

    data = write_jsonl(str(tmp_path / "d.jsonl"), [{"text": "hello"}])
    res = config.load_config(str(f), {"data": (data, "flag --data"), "max_steps": (3, "flag --max-steps")})
    assert res.cfg.data == data and res.cfg.max_steps == 3


def test_a_json_array_with_a_syntax_error_names_its_line(tmp_path):
    """pyarrow's parser reported "at position 16750"; the line is what an editor goes to."""
    import json

    from shardwise.data.sources import read_records

    rows = [json.dumps({"text": f"row {i}"}) for i in range(5)]
    f = tmp_path / "rows.json"
    f.write_text("[\n" + ",\n".join(rows) + ",\n]\n")  # a trailing comma: the value it promises is missing on line 7
    with pytest.raises(ShardwiseError) as e:
        read_records(str(f))
    assert str(e.value) == f"{f}:7: not valid JSON (Expecting value at column 1); fix the file there"
