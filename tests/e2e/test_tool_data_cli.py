"""Tool-call data through the real CLI: a glaive-style ShareGPT JSON array (LLaMA-Factory's shape) and an OpenAI
tool-calling JSONL file (its questions as multi-part content), mixed, trained for 2 steps on the tiny model with a
shipped template; and, each in one line, a template with no tool format, an image part and a file of preference pairs
refused. The files are written here in those projects' shapes."""

import json

import pytest

from tests.e2e.test_cli import one_line_error
from tests.helpers import ConcurrentRuns, write_jsonl

ADD = {"name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_dir):
    d = tmp_path_factory.mktemp("toolcli")
    glaive = [{"conversations": [{"from": "human", "value": f"{a}+{b}?"},
                                 {"from": "function_call", "value": json.dumps({"name": "add",
                                                                                "arguments": {"a": a, "b": b}})},
                                 {"from": "observation", "value": str(a + b)},
                                 {"from": "gpt", "value": f"It is {a + b}."}],
               "tools": json.dumps([ADD])} for a, b in [(1, 2), (3, 4), (5, 6), (7, 1)]]
    (d / "glaive.json").write_text(json.dumps(glaive, indent=1))
    openai = [{"messages": [{"role": "user", "content": [{"type": "text", "text": f"{a}+"},
                                                         {"type": "text", "text": f"{b}?"}]},
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"id": f"c{a}", "type": "function",
                                 "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}]},
                            {"role": "tool", "tool_call_id": f"c{a}", "content": str(a + b)},
                            {"role": "assistant", "content": f"It is {a + b}."}],
               "tools": [{"type": "function", "function": ADD}]} for a, b in [(2, 2), (4, 1), (9, 0)]]
    write_jsonl(str(d / "openai.jsonl"), openai)
    data = f"{d / 'glaive.json'},{d / 'openai.jsonl'}"
    common = ("train", "--model", tiny_dir, "--data", data, "--strategy", "single", "--nproc-per-node", "1",
              "--micro-batch-size", "2", "--seq-len", "1024", "--max-steps", "2")
    runs = ConcurrentRuns()
    runs.add("qwen", *common, "--chat-template", "qwen", "--output-dir", str(d / "qwen"))
    runs.add("gemma", *common, "--chat-template", "gemma", "--output-dir", str(d / "gemma"), check=False)
    write_jsonl(str(d / "image.jsonl"), [{"messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                     {"type": "image_url", "image_url": {"url": "cat.png"}}]},
        {"role": "assistant", "content": "A cat."}]}])
    (d / "dpo.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "Pick one."}],
                                             "chosen": {"from": "gpt", "value": "7"},
                                             "rejected": {"from": "gpt", "value": "no"}}]))
    rest = [a for a in common if a not in ("--data", data)]
    runs.add("image", *rest, "--data", str(d / "image.jsonl"), "--output-dir", str(d / "image"), check=False)
    runs.add("dpo", *rest, "--data", str(d / "dpo.json"), "--output-dir", str(d / "dpo"), check=False)
    return runs, d


def test_glaive_and_openai_tool_data_train(setup, tiny_dir):
    from shardwise.data.encode import encode
    from shardwise.data.sources import read_records
    from shardwise.data.templates import use_chat_template
    from shardwise.models.load import load_tokenizer

    runs, d = setup
    p = runs.get("qwen")
    g, o = d / "glaive.json", d / "openai.jsonl"
    tok = load_tokenizer(tiny_dir)
    use_chat_template(tok, "qwen")
    st = encode(read_records(str(g))[0] + read_records(str(o))[0], tok, 1024, packing=False).stats
    assert (f"shardwise: data: 7 records from {g}, {o}; 7 sequences, {st['tokens']:,} tokens, "
            f"{st['loss_tokens']:,} loss tokens; 0 truncated to seq_len 1024; mix: {g} 4 of 4, {o} 3 of 3 "
            "examples") in p.stdout.splitlines(), p.stdout
    assert json.loads((d / "qwen" / "summary.json").read_text())["steps"] == 2


def test_a_template_without_a_tool_format_is_refused(setup):
    runs, d = setup
    one_line_error(runs.get("gemma"), r"glaive\.json:row 1: this record has tool calls, but the chat template "
                                      r"'gemma' cannot render them \(gemma has no tool-call format\); pass "
                                      r"--chat-template chatml, qwen, llama3 or mistral")
    assert not (d / "gemma").exists()


def test_image_parts_and_preference_pairs_are_refused(setup):
    runs, d = setup
    one_line_error(runs.get("image"), r"image\.jsonl:1: message 1 has an 'image_url' part: this is text-only "
                                      r"fine-tuning \(no image, audio or video inputs\)")
    one_line_error(runs.get("dpo"), r"dpo\.json:row 1: this is a preference pair \('chosen' and 'rejected' answers\), "
                                    r"data for DPO-style training, which supervised fine-tuning \(--task sft\) does "
                                    r"not take; pass --task dpo to train on the pairs")
    assert not (d / "image").exists() and not (d / "dpo").exists()
