"""`shardwise chat` in a real process on the session's trained runs: a full model's final/,
a LoRA run's final/ (an adapter directory whose base is found from adapter_config.json),
and a base model + --adapter. The streamed answer must equal a greedy decode computed here
by hand (argmax token by token, stopping at an end-of-turn token) from the same weights."""

import json

import pytest
import torch

from tests.helpers import ConcurrentRuns


PROMPT = "reverse: apple river stone"
NEW = 8


@pytest.fixture(scope="module")
def chats(ddp_ref, lora_single_ref):
    r = ConcurrentRuns()
    common = ("--prompt", PROMPT, "--max-new-tokens", str(NEW))
    r.add("full", "chat", str(ddp_ref.out / "final"), *common)
    r.add("lora", "chat", str(lora_single_ref.out / "final"), *common)
    return r


def greedy(model, tok) -> str:
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    stop = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    new = []
    with torch.no_grad():
        for _ in range(NEW):
            nxt = int(model(input_ids=ids).logits[0, -1].argmax())
            if nxt in stop:
                break
            new.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return tok.decode(new, skip_special_tokens=True)


def test_chat_answers_a_full_model_final_dir(chats, ddp_ref):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = chats.get("full")
    final = str(ddp_ref.out / "final")
    model = AutoModelForCausalLM.from_pretrained(final, local_files_only=True).eval()
    want = greedy(model, AutoTokenizer.from_pretrained(final, local_files_only=True))
    assert want.strip(), "the trained model should say something (else this test proves little)"
    assert p.stdout == want + "\n", (p.stdout, want)


def test_chat_finds_the_base_of_a_lora_final_dir_and_applies_the_adapter(chats, lora_single_ref, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardwise.cli import main

    final = str(lora_single_ref.out / "final")
    base = json.loads((lora_single_ref.out / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, local_files_only=True), final).eval()
    tok = AutoTokenizer.from_pretrained(final, local_files_only=True)
    want = greedy(model, tok)
    plain = greedy(AutoModelForCausalLM.from_pretrained(base, local_files_only=True).eval(), tok)
    assert want.strip() and want != plain, "the adapter must change the answer (else this test proves little)"
    assert chats.get("lora").stdout == want + "\n"
    # base model + --adapter (in this process: the same code path after parsing)
    capsys.readouterr()
    assert main(["chat", base, "--adapter", final, "--prompt", PROMPT, "--max-new-tokens", str(NEW)]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_end_message_names_the_kind_of_final_directory(ddp_ref, lora_single_ref):
    assert "final/ (PEFT adapter directory)" in lora_single_ref.stdout
    assert "final/ (Hugging Face directory)" in ddp_ref.stdout
