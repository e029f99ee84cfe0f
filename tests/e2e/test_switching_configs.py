"""The README's LLaMA-Factory YAML and ms-swift command line, run as they stand through the CLI.

Both name the model `Qwen/Qwen2.5-0.5B-Instruct`: a Hugging Face cache is built here in the hub's own layout
(models--ORG--NAME/refs/main -> snapshots/HASH/, each file a symlink into blobs/) holding the tiny model under that
id, found through HF_HOME for one run and HF_HUB_CACHE for the other. Their data is a `data/` directory in
LLaMA-Factory's shape (identity.json, alpaca_en_demo.json, dataset_info.json), written here. The only flags added
are `--nproc-per-node 1` (one process on the test machine) and, for ms-swift's 508 records, `--max-steps 2`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex

import pytest

from tests.e2e.test_cli import one_line_error
from tests.helpers import ROOT, ConcurrentRuns, read_metrics, run_cli

REPO_ID = "Qwen/Qwen2.5-0.5B-Instruct"


def readme_blocks() -> tuple[str, list[str]]:
    """(the YAML, the command line's argv) of the README's 'Coming from LLaMA-Factory or ms-swift'."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text.split("### Coming from LLaMA-Factory or ms-swift", 1)[1]  # its first yaml and bash blocks
    yaml_block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    bash_block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    argv = shlex.split(bash_block.replace("\\\n", " "))
    assert argv[:2] == ["shardwise", "train"], argv
    return yaml_block, argv[2:]


def hub_cache(root, repo_id: str, model_dir: str) -> str:
    """A Hugging Face hub cache at `root` holding `model_dir`'s files as the snapshot of `repo_id`'s main."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for name in os.listdir(model_dir):
        data = open(os.path.join(model_dir, name), "rb").read()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snap / name)
    return str(snap)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_dir):
    work = tmp_path_factory.mktemp("switching")
    home = work / "hf_home"
    snapshot = hub_cache(home / "hub", REPO_ID, tiny_dir)
    data = work / "data"
    data.mkdir()
    words = "apple river stone cloud green quiet music bread lamp road tree salt".split()
    alpaca = [{"instruction": f"Write {a} and {b}.", "input": "", "output": f"{a} {b}."}
              for a in words[:6] for b in words[6:10]]
    (data / "alpaca_en_demo.json").write_text(json.dumps(alpaca, indent=2))
    identity = [{"instruction": q, "input": "", "output": "I am {{name}}, an AI assistant developed by {{author}}."}
                for q in ("hi", "Who are you?", "What is your name?", "Introduce yourself.", "hello",
                          "Are you ChatGPT?", "Who made you?", "Tell me about yourself.")]
    (data / "identity.json").write_text(json.dumps(identity, indent=2))
    (data / "dataset_info.json").write_text(json.dumps({
        "identity": {"file_name": "identity.json"}, "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"},
        "alpaca_en": {"hf_hub_url": "llamafactory/alpaca_en", "ms_hub_url": "llamafactory/alpaca_en"}}, indent=2))
    yaml_text, swift_argv = readme_blocks()
    (work / "qwen_lora_sft.yaml").write_text(yaml_text)
    runs = ConcurrentRuns()
    # HF_HOME alone (its hub/), unless this environment sets HF_HUB_CACHE, which would win
    only_home = {"HF_HOME": str(home), **({"HF_HUB_CACHE": str(home / "hub")} if "HF_HUB_CACHE" in os.environ else {})}
    runs.add("llamafactory", "train", "qwen_lora_sft.yaml", "--nproc-per-node", "1", cwd=str(work), env=only_home)
    runs.add("swift", "train", *swift_argv, "--nproc-per-node", "1", "--max-steps", "2", cwd=str(work),
             env={"HF_HUB_CACHE": str(home / "hub"), "HF_HOME": str(work / "elsewhere")})
    return runs, work, snapshot


def test_the_readme_llama_factory_yaml_trains_as_it_is(setup):
    runs, work, snapshot = setup
    p = runs.get("llamafactory")
    out = work / "saves" / "qwen2.5-0.5b" / "lora" / "sft"
    lines = p.stdout.splitlines()
    assert f"shardwise: model {REPO_ID}: the Hugging Face cache's snapshot {snapshot}" in lines
    assert any(ln.startswith("shardwise: ignored, as they change nothing here: "
                             "do_train (train trains), overwrite_cache") for ln in lines), p.stdout
    assert ("shardwise: data: 32 records from data/identity.json, data/alpaca_en_demo.json; 32 sequences"
            in p.stdout), p.stdout
    assert "mix: identity 8 of 8, alpaca_en_demo 24 of 24 examples" in p.stdout
    resolved = (out / "config.yaml").read_text()
    for line in ("tuner: lora", "seq_len: 2048", "chat_template: qwen", "mixed_precision: bf16",
                 "lr_schedule: cosine", "warmup_ratio: 0.1", "max_samples: 1000", "micro_batch_size: 1",
                 "grad_accum: 8", f"model: {snapshot}", "data: identity,alpaca_en_demo",
                 f"dataset_dir: {work / 'data'}", "epochs: 3", "report_to: none"):
        assert line in resolved.splitlines(), (line, resolved)
    rec = read_metrics(str(out))
    # 32 records / (1 x 8) = 4 steps an epoch, 3 epochs; warmup_ratio 0.1 of 12 steps is 2 steps (rounded up)
    assert [r["step"] for r in rec if "loss" in r][-1] == 12
    assert json.loads((out / "summary.json").read_text())["steps"] == 12
    assert (out / "final" / "adapter_config.json").is_file()


def test_the_readme_ms_swift_command_line_trains_as_it_is(setup):
    runs, work, snapshot = setup
    p = runs.get("swift")
    lines = p.stdout.splitlines()
    assert f"shardwise: model {REPO_ID}: the Hugging Face cache's snapshot {snapshot}" in lines
    assert ("shardwise: flag --eval_steps (= --eval-every): no validation set (val_size / --val-split), so no "
            "evaluation, as the HF Trainer does") in lines
    assert any(ln.startswith("shardwise: ignored, as they change nothing here: ") and "dataloader_num_workers" in ln
               and "model_author" in ln and "model_name" in ln for ln in lines), p.stdout
    assert "mix: data/alpaca_en_demo.json#500 500 of 24 (repeated), data/identity.json 8 of 8 examples" in p.stdout
    resolved = (work / "output" / "config.yaml").read_text().splitlines()
    for line in ("tuner: lora", "gradient_checkpointing: true", "mixed_precision: bf16", "grad_accum: 16",
                 "warmup_ratio: 0.05", "keep_checkpoints: 2", "system: You are a helpful assistant.",
                 "lora:", "  alpha: 32.0", "  targets: all-linear"):
        assert line in resolved, (line, resolved)
    assert json.loads((work / "output" / "summary.json").read_text())["steps"] == 2


def test_a_hub_id_not_in_the_cache_names_the_download_command(tmp_path):
    p = run_cli("train", "--model", "Org/Missing-Model", "--data", "x.json", check=False,
                env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    one_line_error(p, rf"flag --model: Org/Missing-Model is no local directory and is not in the Hugging Face "
                      rf"cache \({re.escape(str(tmp_path / 'hub'))}\); download it with `hf download "
                      r"Org/Missing-Model`")


def test_a_stage_shardwise_does_not_train_is_one_line(tmp_path):
    (tmp_path / "ppo.yaml").write_text("model_name_or_path: tiny\nstage: ppo\ndataset: demo\n")
    one_line_error(run_cli("train", str(tmp_path / "ppo.yaml"), check=False),
                   r"ppo\.yaml:2: stage 'ppo': shardwise trains LLaMA-Factory's stages sft \(supervised fine-tuning\) "
                   r"and dpo \(preference pairs\) only; write stage: sft or stage: dpo \(task\)")


def test_plan_reads_the_readme_yaml_and_its_cached_model(setup):
    _, work, snapshot = setup
    p = run_cli("plan", "qwen_lora_sft.yaml", "--gpus", "2", cwd=str(work),
                env={"HF_HUB_CACHE": str(work / "hf_home" / "hub")})
    assert f"{snapshot}/config.json" in p.stdout and "4 layers, hidden 128" in p.stdout, p.stdout
