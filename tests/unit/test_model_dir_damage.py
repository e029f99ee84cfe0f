"""A damaged model or adapter directory is one line naming the directory, the file (and key) and what to do, before
anything is written: a tokenizer of another model (it crashed the workers with "IndexError: index out of range in
self"), no tokenizer files (transformers built an empty tokenizer, and the data was blamed), a config.json value
transformers refuses (found only in the workers, or blamed on the tokenizer), broken tokenizer JSON, and for `chat`
an adapter on another base or with a config value of the wrong type. Real tiny models, built here."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from shardwise import cli
from shardwise.errors import ShardwiseError
from shardwise.models.load import check_shapes, check_weights, load_tokenizer
from tests.helpers import chat_records, write_jsonl

ONE = ("--strategy", "single", "--nproc-per-node", "1", "--max-steps", "1", "--micro-batch-size", "2")


def copy(tiny_dir, tmp_path, name="m"):
    d = tmp_path / name
    shutil.copytree(tiny_dir, d)
    return d


def edit_json(path, fn):
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def shift_vocab(d, by=400):
    """The tokenizer's own (non-special) ids moved up by `by`: a tokenizer of a larger model, as the audit built."""
    def shift(t):
        special = {a["content"] for a in t["added_tokens"]}
        t["model"]["vocab"] = {k: (i if k in special else i + by) for k, i in t["model"]["vocab"].items()}
    edit_json(d / "tokenizer.json", shift)


def add_token_past_the_embedding(d, content="<|extra|>"):
    """An added token at id vocab_size (512): what transformers' Qwen2 tokenizer does with <|endoftext|>."""
    edit_json(d / "tokenizer.json", lambda t: t["added_tokens"].append(
        {"id": 512, "content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}))


def refused(capsys, argv, pattern):
    rc = cli.main(list(argv))
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("shardwise: error: "), (rc, err)
    assert re.search(pattern, err[0]), err[0]


# -- the tokenizer against the model's vocabulary ------------------------------------------------------------------

def test_a_tokenizer_of_another_model_is_refused_before_the_run_directory_is_written(tmp_path, tiny_dir, capsys):
    m = copy(tiny_dir, tmp_path)
    shift_vocab(m)
    with pytest.raises(ShardwiseError, match=r"its tokenizer's vocabulary has ids up to 911 \(\d+ tokens\) but "
                                             r"config\.json vocab_size is 512 .*the tokenizer is from another model"):
        load_tokenizer(str(m))
    data = write_jsonl(str(tmp_path / "chat.jsonl"), chat_records(16))
    refused(capsys, ["train", "--model", str(m), "--data", data, "--output-dir", str(tmp_path / "out"), *ONE],
            r"^shardwise: error: --model .*/m: its tokenizer's vocabulary has ids up to 911")
    assert not (tmp_path / "out").exists()


def test_added_tokens_past_the_embedding_load_and_only_data_holding_one_is_refused(tmp_path, tiny_dir):
    """len(tokenizer) > vocab_size is not refused (a real Qwen2 tokenizer has it and trains); a token id the model
    cannot embed in the tokenized data is, naming the record."""
    from shardwise.data.encode import encode
    from shardwise.data.formats import Record

    m = copy(tiny_dir, tmp_path)
    add_token_past_the_embedding(m)
    tok = load_tokenizer(str(m))
    assert len(tok) == 513
    assert len(encode([Record("text", "hello world", "a.jsonl:1")], tok, 64, packing=False)) == 1
    with pytest.raises(ShardwiseError, match=r"^--model .*/m: its tokenizer gives token id 512 in a\.jsonl:2 but "
                                             r"config\.json vocab_size is 512 \(the model embeds ids 0-511\)"):
        encode([Record("text", "hello world", "a.jsonl:1"), Record("text", "hi <|extra|> there", "a.jsonl:2")],
               tok, 64, packing=False)


def test_a_pad_token_past_the_embedding_is_refused(tmp_path, tiny_dir):
    """Padding puts the pad id in the inputs: past the embedding it crashed the first padded batch."""
    from shardwise.data.encode import encode
    from shardwise.data.formats import Record

    m = copy(tiny_dir, tmp_path)
    add_token_past_the_embedding(m, "<|padx|>")
    edit_json(m / "tokenizer_config.json", lambda c: c.update(pad_token="<|padx|>"))
    tok = load_tokenizer(str(m))
    with pytest.raises(ShardwiseError, match=r"its pad token '<\|padx\|>' has id 512 but config\.json vocab_size is "
                                             r"512: .* set pad_token in tokenizer_config\.json to a token below 512"):
        encode([Record("text", "hello world", "a.jsonl:1")], tok, 64, packing=False)


# -- tokenizer files ------------------------------------------------------------------------------------------------

def qwen2_typed(tiny_dir, tmp_path):
    """model_type qwen2: transformers builds an empty Qwen2Tokenizer where the tokenizer files are missing."""
    m = copy(tiny_dir, tmp_path)
    edit_json(m / "config.json", lambda c: c.update(model_type="qwen2"))
    return m


def test_no_tokenizer_files_is_one_line_not_an_empty_tokenizer(tmp_path, tiny_dir):
    m = qwen2_typed(tiny_dir, tmp_path)
    (m / "tokenizer.json").unlink()
    (m / "tokenizer_config.json").unlink()
    with pytest.raises(ShardwiseError, match=r"^--model .*/m: cannot load its tokenizer \(no tokenizer files: none of "
                                             r"tokenizer\.json, tokenizer_config\.json, .*\); copy the tokenizer files"):
        load_tokenizer(str(m))


def test_tokenizer_files_without_a_vocabulary_are_one_line(tmp_path, tiny_dir):
    m = qwen2_typed(tiny_dir, tmp_path)
    (m / "tokenizer.json").unlink()  # tokenizer_config.json alone
    with pytest.raises(ShardwiseError, match=r"^--model .*/m: its tokenizer has no vocabulary \(\d+ token\(s\); text "
                                             r"encodes to nothing\): the tokenizer files are incomplete; copy"):
        load_tokenizer(str(m))


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_broken_tokenizer_json_file_is_named_with_its_line(tmp_path, tiny_dir, name):
    m = copy(tiny_dir, tmp_path)
    text = (m / name).read_text()
    (m / name).write_text(text[: len(text) // 2])
    with pytest.raises(ShardwiseError, match=rf"^--model .*/m: {re.escape(name)}:\d+: not valid JSON \(.+\); fix the "
                                             "file, or copy it from the model"):
        load_tokenizer(str(m))


# -- config.json values -----------------------------------------------------------------------------------------

def check_model_of(m):
    from shardwise import config
    from shardwise.launch.preflight import check_model

    res = config.load_config(None, {"model": (str(m), "--model")})
    return check_model(res.cfg, res)


@pytest.mark.parametrize("change, pattern", [
    (lambda c: c.update(hidden_act="swish2"),
     r'^--model .*/m: config\.json hidden_act "swish2" is not a value transformers [\d.]+ knows \(one of .*silu.*\); '
     r"fix it in config\.json"),
    (lambda c: c.update(model_type="qwen9"),
     r'^--model .*/m: config\.json model_type "qwen9" is not a model family transformers [\d.]+ knows; fix model_type'),
    (lambda c: c["rope_parameters"].update(rope_type="bogus"),
     r'^--model .*/m: config\.json rope_parameters\.rope_type "bogus" is not a value transformers [\d.]+ knows '
     r"\(one of default, .*yarn"),
    (lambda c: c.update(hidden_size="128"),
     r'^--model: .*/m/config\.json: hidden_size is "128" \(a string\); it must be a positive integer'),
    (lambda c: c.update(max_position_embeddings="2048"),  # compared with seq_len: a TypeError traceback
     r'^--model: .*/m/config\.json: max_position_embeddings is "2048" \(a string\); it must be a positive integer'),
])
def test_a_config_value_transformers_refuses_is_found_by_the_launchers_model_check(
        tmp_path, tiny_dir, monkeypatch, change, pattern):
    """launch.preflight.check_model (before the run directory is written) names config.json and the key; it used to find
    these only in the workers, or blame the tokenizer."""
    monkeypatch.setenv("SHARDWISE_CACHE_DIR", str(tmp_path / "cache"))
    m = copy(tiny_dir, tmp_path)
    edit_json(m / "config.json", change)
    with pytest.raises(ShardwiseError, match=pattern):
        check_model_of(m)
    with pytest.raises(ShardwiseError, match=pattern):  # a refusal is not remembered by the checks' cache
        check_model_of(m)


def test_a_config_field_of_the_wrong_type_is_blamed_on_config_json_not_the_tokenizer(tmp_path, tiny_dir):
    """chat (and the workers) reach transformers' own validation: the key is named there too."""
    m = copy(tiny_dir, tmp_path)
    edit_json(m / "config.json", lambda c: c.update(hidden_size="128"))
    pattern = r'^--model .*/m: config\.json hidden_size "128": TypeError: .*expected int, got str'
    with pytest.raises(ShardwiseError, match=pattern):
        check_shapes(str(m), check_weights(str(m)))
    with pytest.raises(ShardwiseError, match=pattern):
        load_tokenizer(str(m))


# -- chat: adapters and prompts -----------------------------------------------------------------------------------

def small_model(path, tok_from, hidden=64):
    """A Llama model of another width (the same tokenizer), as a base an adapter was not trained on."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardwise.models.save import save_pretrained

    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    save_pretrained(LlamaForCausalLM(cfg), str(path))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tok_from}/{f}", path / f)
    return path


@pytest.fixture(scope="module")
def adapter(tiny_dir, tmp_path_factory):
    """A LoRA adapter of the tiny model, saved with its tokenizer as a LoRA run's final/ is."""
    from peft import LoraConfig, get_peft_model

    from shardwise.models.load import load_model
    from shardwise.models.lora import quiet_peft

    d = tmp_path_factory.mktemp("adapter") / "final"
    with quiet_peft():
        model = get_peft_model(load_model(tiny_dir, torch.float32),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    model.save_pretrained(str(d))
    load_tokenizer(tiny_dir).save_pretrained(str(d))
    return d


def test_an_adapter_config_value_of_the_wrong_type_is_one_line(tmp_path, tiny_dir, adapter):
    from shardwise.chat import load

    a = tmp_path / "a"
    shutil.copytree(adapter, a)
    edit_json(a / "adapter_config.json", lambda c: c.update(r="sixteen"))
    with pytest.raises(ShardwiseError, match=r'^chat .*/a: adapter_config\.json r is "sixteen"; it must be a positive '
                                             r"integer .*: fix it, or copy the file from the run that made the adapter"):
        load(tiny_dir, str(a), torch.device("cpu"))


def test_an_adapter_on_another_base_names_both_directories_and_the_flag(tmp_path, tiny_dir, adapter):
    from shardwise.chat import load

    assert load(tiny_dir, str(adapter), torch.device("cpu"))[0] is not None  # its own base: loads
    narrow = small_model(tmp_path / "narrow", tiny_dir)
    with pytest.raises(ShardwiseError, match=r"^chat .*/final: adapter_model\.safetensors adapts model\.layers\.0\."
                                             r"self_attn\.\w_proj with 128 (in|out) features but the base model "
                                             r".*/narrow has 64 there; the adapter was trained on another base model: "
                                             r"pass --base with the model it was trained from"):
        load(str(narrow), str(adapter), torch.device("cpu"))


def test_an_adapters_tokenizer_against_a_base_of_another_vocabulary_names_the_flag(tmp_path, tiny_dir, adapter):
    from shardwise.chat import load
    from shardwise.models.load import load_model
    from shardwise.models.save import save_pretrained

    small = load_model(tiny_dir, torch.float32)
    small.resize_token_embeddings(256)
    base = tmp_path / "vocab256"
    save_pretrained(small, str(base))
    with pytest.raises(ShardwiseError, match=r"^chat .*/final: its tokenizer's vocabulary has ids up to 511 .* but "
                                             r".*/vocab256/config\.json vocab_size is 256 .*the adapter was trained on "
                                             r"another base model; pass --base"):
        load(str(base), str(adapter), torch.device("cpu"))


def test_a_base_whose_weights_do_not_match_its_config_is_blamed_not_the_adapter(tmp_path, tiny_dir, adapter):
    """It was 'chat ADAPTER: cannot load (RuntimeError: ... For details look at the above report!)'."""
    from shardwise.chat import load

    base = copy(tiny_dir, tmp_path, "base")
    edit_json(base / "config.json", lambda c: c.update(vocab_size=256))
    with pytest.raises(ShardwiseError, match=r"^chat .*/base: weight (lm_head|model\.embed_tokens)\.weight has "
                                             r"shape \[512, 128\] but config\.json describes \[256, 128\]"):
        load(str(base), str(adapter), torch.device("cpu"))


def test_a_prompt_token_the_model_cannot_embed_is_one_line_not_an_index_error(tmp_path, tiny_dir):
    from shardwise.chat import answer, load

    m = copy(tiny_dir, tmp_path)
    add_token_past_the_embedding(m)
    model, tok = load(str(m), None, torch.device("cpu"))
    assert answer(model, tok, [{"role": "user", "content": "hello"}], 1) is not None  # no such token: answers
    with pytest.raises(ShardwiseError, match=r"the prompt has token id 512 but the model embeds ids 0-511 .*copy its "
                                             r"tokenizer files from the model the weights come from"):
        answer(model, tok, [{"role": "user", "content": "hello <|extra|>"}], 1)


def test_chat_on_a_model_without_tokenizer_files_is_one_line(tmp_path, tiny_dir, capsys):
    """It was a 92-line traceback from inside the model (an empty tokenizer gave an empty prompt)."""
    m = qwen2_typed(tiny_dir, tmp_path)
    (m / "tokenizer.json").unlink()
    (m / "tokenizer_config.json").unlink()
    refused(capsys, ["chat", str(m), "--prompt", "hi"], r"^shardwise: error: chat .*/m: cannot load its tokenizer "
                                                        r"\(no tokenizer files")


def test_a_model_transformers_has_no_sdpa_for_is_not_blamed_on_its_weights(tmp_path, tiny_dir):
    """A real tiny Bloom (transformers refuses SDPA for it) got "check that its weights are complete ... re-copy
    them", advice that cannot help; a model whose weights are truncated keeps that advice."""
    from transformers import BloomConfig, BloomForCausalLM

    from shardwise.models.load import load_model

    d = tmp_path / "bloom"
    BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2)).save_pretrained(d)
    with pytest.raises(ShardwiseError) as e:
        load_model(str(d), torch.float32)
    msg = str(e.value)
    assert msg.startswith(f"--model {d}: transformers has no SDPA attention for BloomForCausalLM") and "\n" not in msg
    assert "re-copy" not in msg and "weights" not in msg, msg
    m = copy(tiny_dir, tmp_path)
    weights = m / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(ShardwiseError, match="re-copy them"):
        load_model(str(m), torch.float32)
