"""The built-in synthetic instruction set (`--data demo`): small learnable tasks in chat form.

Deterministic (its own fixed seed), a few thousand examples whose lengths and numbers of
loss tokens differ, including some multi-turn conversations and system prompts.
"""

from __future__ import annotations

import random

ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
        "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
WORDS = ("apple river stone cloud lamp tiger paper green quiet music honey window orange silver "
         "garden rocket pencil forest bridge candle mirror planet sugar winter").split()
N_EXAMPLES = 3000
SEED = 1234


def number_words(n: int) -> str:
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    return ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " and " + number_words(n % 100))


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(5)
    if kind == 0:
        ws = rng.sample(WORDS, rng.randint(2, 6))
        return "Reverse the words: " + " ".join(ws), " ".join(reversed(ws))
    if kind == 1:
        a, b = rng.randint(0, 60), rng.randint(0, 39)
        return f"What is {number_words(a)} plus {number_words(b)}?", number_words(a + b)
    if kind == 2:
        xs = [rng.randint(0, 99) for _ in range(rng.randint(3, 8))]
        return "Sort these numbers: " + " ".join(map(str, xs)), " ".join(map(str, sorted(xs)))
    if kind == 3:
        ws = rng.sample(WORDS, rng.randint(1, 5))
        return "Uppercase: " + " ".join(ws), " ".join(ws).upper()
    ws = rng.sample(WORDS, rng.randint(2, 7))
    return "How many words are in: " + " ".join(ws), number_words(len(ws))


def demo_records(n: int = N_EXAMPLES) -> list[dict]:
    rng = random.Random(SEED)
    out = []
    for _ in range(n):
        messages = []
        if rng.random() < 0.2:
            messages.append({"role": "system", "content": "You are a careful assistant. Answer briefly."})
        for _turn in range(1 if rng.random() < 0.8 else rng.randint(2, 3)):
            q, a = _task(rng)
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        out.append({"messages": messages})
    return out


def _wrong(rng: random.Random, answer: str) -> str:
    """A plausible wrong answer: the words of the right one shuffled, or one of them replaced."""
    ws = answer.split()
    if len(ws) > 1 and rng.random() < 0.5:
        shuffled = ws[:]
        while shuffled == ws:
            rng.shuffle(shuffled)
        return " ".join(shuffled)
    i = rng.randrange(len(ws))
    ws[i] = rng.choice([w for w in WORDS + ONES if w != ws[i]])
    return " ".join(ws)


def demo_preference_records(n: int = N_EXAMPLES) -> list[dict]:
    """The demo tasks as preference pairs (`--task dpo --data demo`): each prompt with its right answer chosen and a
    near miss rejected, in TRL's {prompt, chosen, rejected} message form."""
    rng = random.Random(SEED + 1)
    out = []
    for _ in range(n):
        q, a = _task(rng)
        out.append({"prompt": [{"role": "user", "content": q}],
                    "chosen": [{"role": "assistant", "content": a}],
                    "rejected": [{"role": "assistant", "content": _wrong(rng, a)}]})
    return out
