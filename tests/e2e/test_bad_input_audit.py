"""Bad input found by an adversarial audit of the CLI: each case is one line, exit 2, nothing of the user's deleted
and nothing written. The CLI runs in this process (`cli.main`): every refusal here comes before a worker starts."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from shardwise import cli, rundir
from shardwise.data.sources import read_records
from shardwise.errors import ShardwiseError
from tests.helpers import chat_records, write_jsonl

ONE = ("--strategy", "single", "--nproc-per-node", "1", "--max-steps", "1", "--micro-batch-size", "2")


def refused(capsys, argv, pattern):
    """`shardwise ARGV` exits 2 with one `shardwise: error:` line on stderr matching `pattern`."""
    rc = cli.main(list(argv))
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("shardwise: error: "), (rc, err)
    assert re.search(pattern, err[0]), err[0]
    return err[0]


def snapshot(d) -> dict:
    """Every file under `d` (the run's lock file aside: its PID changes) with its bytes."""
    out = {}
    for base, _, files in os.walk(d):
        for f in files:
            if f != rundir.LOCK:
                p = os.path.join(base, f)
                out[os.path.relpath(p, d)] = open(p, "rb").read()
    return out


def trained_run(d, tiny_dir):
    """A marked run directory that trained, whose final/ is a loadable model (the tiny one)."""
    d.mkdir(parents=True)
    rundir.mark(str(d))
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    shutil.copytree(tiny_dir, d / "final")
    (d / "checkpoints").mkdir()
    return d


def test_overwrite_never_deletes_the_model_or_data_the_run_reads(tmp_path, tiny_dir, capsys):
    """`--model OUT/final --output-dir OUT --overwrite` (train on from the run being replaced) cleared OUT's final/
    before the workers loaded it: the trained model was deleted and the run failed. Same for a data file kept in
    one of OUT's entries."""
    data = write_jsonl(str(tmp_path / "chat.jsonl"), chat_records(16))
    out = trained_run(tmp_path / "run", tiny_dir)
    before = snapshot(out)
    refused(capsys, ["train", "--model", str(out / "final"), "--data", data, "--output-dir", str(out), "--overwrite",
                     *ONE], r"--model: .*/run/final lies in final/ of the run directory .*/run, which this run deletes")
    assert snapshot(out) == before

    mine = write_jsonl(str(out / "checkpoints" / "mine.jsonl"), chat_records(16))
    before = snapshot(out)
    refused(capsys, ["train", "--model", "tiny", "--data", mine, "--output-dir", str(out), "--overwrite", *ONE],
            r"--data: .*mine\.jsonl lies in checkpoints/ of the run directory")
    assert snapshot(out) == before


def test_an_output_dir_inside_another_runs_entry_or_a_data_directory_is_refused(tmp_path, tiny_dir, capsys):
    """A run directory inside another run's checkpoints/ or final/ is deleted with them (that run's --overwrite or
    checkpoint rotation); one inside a --data directory is read as data by the next run over it (its own
    config.yaml then fails: 'final/config.json: ... not records'). Both are refused before anything is written."""
    other = trained_run(tmp_path / "other", tiny_dir)
    before = snapshot(other)
    for inside in (other / "checkpoints" / "new", other / "final"):
        refused(capsys, ["train", "--output-dir", str(inside), *ONE],
                r"--output-dir: .* lies in (checkpoints|final)/ of the run directory .*/other, which that run deletes")
    assert snapshot(other) == before and not (other / "checkpoints" / "new").exists()

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_jsonl(str(data_dir / "chat.jsonl"), chat_records(16))
    for flags in (("--data", str(data_dir)), ("--data", str(data_dir / "chat.jsonl"), "--val-data", str(data_dir))):
        refused(capsys, ["train", "--model", tiny_dir, *flags, "--output-dir", str(data_dir / "out"), *ONE],
                r"--output-dir: .*/data/out is inside the data directory .*/data \(flag --(val-)?data\)")
    assert sorted(os.listdir(data_dir)) == ["chat.jsonl"]


@pytest.mark.parametrize("text, pattern", [
    ('{"model_type": "llama",\n', r"config\.json:2: not valid JSON \(Expecting property name"),
    ("[1, 2]\n", r"config\.json: not a JSON object"),
])
def test_a_model_config_json_that_is_not_a_json_object_is_one_line(tmp_path, tiny_dir, capsys, text, pattern):
    """It was a JSONDecodeError traceback (exit 1) from the launcher's max-positions check."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "config.json").write_text(text)
    data = write_jsonl(str(tmp_path / "chat.jsonl"), chat_records(16))
    refused(capsys, ["train", "--model", str(model), "--data", data, "--output-dir", str(tmp_path / "out"), *ONE],
            r"^shardwise: error: flag --model: .*/model/" + pattern)
    assert not (tmp_path / "out").exists()


def test_bench_input_errors_are_one_line_before_anything_is_written(tmp_path, capsys):
    """A config error every strategy meets was a report of strategies that 'cannot run here' (exit 1), naming a copy
    of the user's YAML the bench wrote (REPORT/runs/NAME/bench-input.yaml, its lines shifted); an empty
    --strategies ran the default list."""
    cfg = tmp_path / "bench.yaml"
    cfg.write_text("model: tiny\nmax_steps: 3\nseq_len: 64\nbogus_key: 1\n")
    rep = tmp_path / "rep"
    refused(capsys, ["bench", str(cfg), "--strategies", "single,ddp", "--steps", "1", "--report-dir", str(rep)],
            rf"^shardwise: error: {re.escape(str(cfg))}:4: unknown key 'bogus_key'")
    refused(capsys, ["bench", "--seq-len", "0", "--strategies", "ddp,fsdp", "--steps", "1", "--report-dir", str(rep)],
            r"flag --seq-len: seq_len must be at least 8")
    for empty in ("", ","):
        refused(capsys, ["bench", "--strategies", empty, "--report-dir", str(rep)],
                r"--strategies: .* names no strategy")
    assert not rep.exists()


def test_a_chat_field_of_the_wrong_type_is_named_as_such(tmp_path):
    """`{"messages": "hi"}` was reported as "missing field 'messages'"."""
    sharegpt = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    for field, value, good in (("messages", "hi", chat_records(2)), ("conversations", {"from": "human"}, [sharegpt])):
        path = write_jsonl(str(tmp_path / f"{field}.jsonl"), [*good, {field: value}])
        with pytest.raises(ShardwiseError, match=rf"{field}\.jsonl:{len(good) + 1}: field '{field}' must be a list "
                                                 rf"of .*, got {type(value).__name__}"):
            read_records(path)


def test_a_chat_template_that_is_not_jinja_is_blamed_not_the_first_record(tmp_path, tiny_dir, capsys):
    """A syntax error in --chat-template FILE was reported as `chat.jsonl:1: the chat template cannot render this
    conversation ...; fix the record`: the record was fine."""
    template = tmp_path / "bad.jinja"
    template.write_text("{% for m in messages %}{{ m.content }\n")
    data = write_jsonl(str(tmp_path / "chat.jsonl"), chat_records(16))
    refused(capsys, ["train", "--model", tiny_dir, "--data", data, "--chat-template", str(template),
                     "--no-data-cache", "--output-dir", str(tmp_path / "out"), *ONE],
            r"^shardwise: error: flag --chat-template .*/bad\.jinja: line 1: not valid Jinja \(unexpected '}'\); fix "
            "the template")
    assert not (tmp_path / "out").exists()

    model = tmp_path / "model"  # the model's own template, broken: named as such
    shutil.copytree(tiny_dir, model)
    (model / "chat_template.jinja").write_text("{% if messages %}\n{{ messages[0].content }\n")
    refused(capsys, ["train", "--model", str(model), "--data", data, "--no-data-cache", "--output-dir",
                     str(tmp_path / "out"), *ONE],
            r"^shardwise: error: the model's own chat template \(chat_template\.jinja .*\): line 2: not valid Jinja")
    assert not (tmp_path / "out").exists()


def test_an_export_inside_a_runs_own_entries_is_refused(tmp_path, tiny_dir, capsys):
    """`export RUN/checkpoints/step_N --out RUN/checkpoints/step_N/merged` was written, and the run's next
    `--resume auto --keep-checkpoints 1` rotated step_N away with the user's export in it."""
    run = trained_run(tmp_path / "run", tiny_dir)
    (run / "checkpoints" / "step_00000004").mkdir()
    before = snapshot(run)
    for out in (run / "checkpoints" / "step_00000004" / "merged", run / "final" / "exported"):
        refused(capsys, ["export", str(run / "checkpoints" / "step_00000004"), "--out", str(out)],
                r"--out .*: lies in (checkpoints|final)/ of the run directory .*/run, which that run deletes")
    assert snapshot(run) == before
    assert not (run / "checkpoints" / "step_00000004" / "merged").exists()


def test_a_model_without_tokenizer_files_says_what_to_copy(tmp_path, tiny_dir, capsys):
    """It named transformers' exception only ("Couldn't instantiate the backend tokenizer from one of: ")."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    for f in os.listdir(model):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            os.remove(model / f)
    data = write_jsonl(str(tmp_path / "chat.jsonl"), chat_records(16))
    refused(capsys, ["train", "--model", str(model), "--data", data, "--output-dir", str(tmp_path / "out"), *ONE],
            r"--model .*/model: cannot load its tokenizer \(.*\); copy the tokenizer files .* into this directory")
    assert not (tmp_path / "out").exists()


def test_a_deepspeed_config_value_deepspeed_refuses_is_one_line(tmp_path):
    """A --deepspeed-config whose value DeepSpeed's own schema refuses failed in every rank with pydantic's
    traceback; it is now the launcher's one line naming the file, the key and the value (2 real gloo ranks)."""
    pytest.importorskip("deepspeed")
    from tests.helpers import run_cli

    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"reduce_bucket_size": "lots"}}')
    p = run_cli("train", "--model", "tiny", "--strategy", "zero2", "--nproc-per-node", "2", "--max-steps", "2",
                "--deepspeed-config", str(bad), "--output-dir", str(tmp_path / "run"), check=False, timeout=300)
    errors = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(errors) == 1, (p.returncode, p.stderr[-3000:])
    assert re.match(r"shardwise: error: .*ds\.json: DeepSpeed refuses zero_optimization\.reduce_bucket_size = 'lots' "
                    r"\(.*\); fix that key", errors[0]), errors[0]


def test_an_ms_swift_deepspeed_json_trains_under_zero3(tmp_path):
    """ms-swift's zero3.json ("auto" for batch sizes, clipping, precision and bucket sizes) was a TypeError traceback
    in every rank; "auto" is now filled in as the HF Trainer fills it, and the run's header says what was filled (2
    real gloo ranks, real DeepSpeed)."""
    pytest.importorskip("deepspeed")
    import json

    from tests.helpers import run_cli
    from tests.unit.test_strategies import HF_OPTIMIZER, HF_SCHEDULER, HF_STYLE

    ds = tmp_path / "zero3.json"  # with the HF examples' all-"auto" optimizer and scheduler sections (they were refused)
    ds.write_text(json.dumps(dict(HF_STYLE, optimizer=HF_OPTIMIZER, scheduler=HF_SCHEDULER), indent=4))
    # as ms-swift and the HF Trainer are called: `--deepspeed FILE`, the strategy from the file's ZeRO stage
    p = run_cli("train", "--model", "tiny", "--nproc-per-node", "2", "--max-steps", "2",
                "--deepspeed", str(ds), "--output-dir", str(tmp_path / "run"), check=False, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["strategy"] == "zero3"
    # the tiny model's hidden size is 128: hidden^2, 0.9 hidden^2, 10 hidden
    assert (f'shardwise: DeepSpeed config: {ds} over the generated one ("auto" filled from hidden size: '
            "reduce_bucket_size 16384, stage3_prefetch_bucket_size 14745, stage3_param_persistence_threshold 1280; "
            'its optimizer and scheduler sections, every parameter "auto", dropped: shardwise\'s AdamW and schedule '
            "run with --lr, --weight-decay, --warmup-steps, then a cosine decay to --min-lr-ratio 0.1 (1 holds the "
            "rate, as WarmupLR does))") in p.stdout, p.stdout[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


def test_a_partial_offload_json_forcing_deepspeeds_cpu_adam_trains_with_ours(tmp_path):
    """LLaMA-Factory's partial-offload file sets zero_force_ds_cpu_optimizer true: DeepSpeed refused shardwise's
    AdamW in every rank (a ZeRORuntimeException traceback). The key is dropped, and the header says so (2 real gloo
    ranks, real DeepSpeed, the optimizer offloaded)."""
    pytest.importorskip("deepspeed")
    import json

    from tests.helpers import run_cli
    from tests.unit.test_strategies import HF_STYLE

    obj = json.loads(json.dumps(HF_STYLE))
    obj["zero_force_ds_cpu_optimizer"] = 1  # any truthy value: DeepSpeed asks only `if ...` (1 got past `is True`)
    obj["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    del obj["zero_optimization"]["offload_param"]
    ds = tmp_path / "partial_offload.json"
    ds.write_text(json.dumps(obj, indent=2))
    p = run_cli("train", "--model", "tiny", "--strategy", "zero3", "--deepspeed-offload-optimizer",
                "--nproc-per-node", "2", "--max-steps", "2", "--deepspeed-config", str(ds),
                "--output-dir", str(tmp_path / "run"), check=False, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "zero_force_ds_cpu_optimizer 1 dropped: shardwise's AdamW runs the offloaded step" in p.stdout, \
        p.stdout[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2


def test_a_deepspeed_json_section_of_the_wrong_type_is_one_line_before_anything_starts(tmp_path, capsys):
    """`"zero_optimization": "yes"` was a TypeError inside DeepSpeed in every rank."""
    ds = tmp_path / "ds.json"
    ds.write_text('{\n  "zero_optimization": "yes"\n}\n')
    refused(capsys, ["train", "--strategy", "zero2", "--nproc-per-node", "2", "--max-steps", "1",
                     "--deepspeed-config", str(ds), "--output-dir", str(tmp_path / "run")],
            re.escape(f'{ds}:2: zero_optimization: DeepSpeed reads this as a JSON object ({{"key": value, ...}}), '
                      'got "yes"; fix that key'))
    assert not (tmp_path / "run").exists()


def test_a_deepspeed_refusal_names_the_key_with_its_section_and_stays_short():
    """DeepSpeed validates each section alone: a field's location lacks its section, and a check over the whole
    section has no field at all (its input is the section's whole model, 2 KB). Both against DeepSpeed's own
    schema, as `deepspeed.initialize` raises them."""
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    from shardwise.strategies.deepspeed import refused_line

    cfg = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "disk"}}}
    with pytest.raises(ValidationError) as e:
        DeepSpeedZeroConfig(**cfg["zero_optimization"])
    line = refused_line("ds.json", cfg, e.value)
    assert line.startswith("ds.json: DeepSpeed refuses zero_optimization.offload_optimizer.device = 'disk' ("), line
    cfg = {"zero_optimization": {"stage": 3, "compute_grad_norm": False}}
    with pytest.raises(ValidationError) as e:
        DeepSpeedZeroConfig(**cfg["zero_optimization"])
    line = refused_line("ds.json", cfg, e.value)
    assert line.startswith("ds.json: DeepSpeed refuses zero_optimization: ") and line.endswith("; fix that section")
    assert "compute_grad_norm" in line and len(line) < 400, line


def test_the_data_directory_check_follows_what_the_data_reader_reads(tmp_path, capsys):
    """A dot-directory under a data directory and the inside of a saved `datasets` directory are never read as data
    (data/sources.data_files): a run directory there is accepted. A run found misplaced when it resumes is told
    to move, not to start elsewhere."""
    from shardwise import config
    from shardwise.launch import preflight

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    write_jsonl(str(data_dir / "chat.jsonl"), chat_records(16))
    for out in (data_dir / ".runs" / "r1", data_dir / "sub" / ".hidden" / "r2"):
        res = config.load_config(None, {"data": (str(data_dir), "--data"), "output_dir": (str(out), "--output-dir")})
        assert preflight.check_output_dir(res.cfg, res) is False  # nothing to clear, nothing refused
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(chat_records(4)).save_to_disk(str(saved))
    res = config.load_config(None, {"data": (str(saved), "--data"), "output_dir": (str(saved / "out"), "--output-dir")})
    assert preflight.check_output_dir(res.cfg, res) is False
    capsys.readouterr()  # the datasets library's progress bars

    run = data_dir / "runs" / "r1"
    run.mkdir(parents=True)
    rundir.mark(str(run))
    refused(capsys, ["train", "--data", str(data_dir), "--output-dir", str(run), "--resume", "auto", *ONE],
            r"is inside the data directory .*; move the run directory out of it, then resume it from there$")
