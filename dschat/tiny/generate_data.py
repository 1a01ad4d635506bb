"""Build the bundled tiny RLHF dataset and its tokenizer, deterministically.

    python -m dschat.tiny.generate_data            # rewrites dschat/tiny/data/*.jsonl and tokenizer.json
    python -m dschat.tiny.generate_data --out-dir /tmp/x

Every record is an instruction whose rule code can check from the prompt and the answer alone (see
``dschat.tiny.scorer``): ``chosen`` follows it, ``rejected`` breaks it in a way a tiny model can see (wrong
format, ignored instruction, wrong word, wrong count). Rejections come in several kinds per task so a reward
model learns the rule rather than one bad string. Eval prompts never occur in train.
"""
import argparse
import json
import random
from pathlib import Path

from dschat.tiny.lexicon import (ANTONYM_PAIRS, CATEGORIES, END_WORDS, NUMBER_NAMES, OPPOSITES,
                                 PHRASE_ADJECTIVES, PHRASE_NOUNS, PHRASE_PLACES, PHRASE_VERBS, REPEAT_WORDS)

SEED = 20240601
NUM_TRAIN = 3000
NUM_EVAL = 600
TOKENIZER_VOCAB_SIZE = 1536
SPECIAL_TOKENS = ("<|endoftext|>", "<pad>", "<unk>")
TINY_DIR = Path(__file__).resolve().parent


def _article(noun):
    return "an" if noun[0] in "aeiou" else "a"


def _pick_other(rng, pool, exclude):
    choices = [x for x in pool if x not in exclude]
    return rng.choice(choices)


def _jsonable(value):
    return value


# --- uppercase: "Reply in uppercase: the small dog runs" -> "THE SMALL DOG RUNS" ------------------------

UPPERCASE_TEMPLATES = (
    "Reply in uppercase: {p}", "Write this in capital letters: {p}", "Say this in all caps: {p}",
    "Rewrite in uppercase: {p}", "Please answer in capital letters: {p}", "Uppercase only: {p}",
    "Copy this in all caps: {p}",
)


def _phrases():
    phrases = []
    for adj in PHRASE_ADJECTIVES:
        for noun in PHRASE_NOUNS:
            phrases.append(f"the {adj} {noun}")
            phrases.append(f"a {adj} {noun}")
    for noun in PHRASE_NOUNS:
        for verb in PHRASE_VERBS:
            phrases.append(f"the {noun} {verb}")
            for place in PHRASE_PLACES:
                phrases.append(f"the {noun} {verb} {place}")
    for noun in PHRASE_NOUNS:
        for adj in PHRASE_ADJECTIVES:
            phrases.append(f"my {noun} is {adj}")
    return phrases


def uppercase_prompts(rng):
    phrases = _phrases()
    rng.shuffle(phrases)
    # One template per phrase keeps the pool large without near-duplicate prompts across the split.
    return [{"prompt": rng.choice(UPPERCASE_TEMPLATES).format(p=p), "phrase": p} for p in phrases]


def uppercase_pair(rng, item, all_items):
    phrase = item["phrase"]
    chosen = phrase.upper()
    other = rng.choice(all_items)["phrase"]
    while other == phrase:
        other = rng.choice(all_items)["phrase"]
    violations = {
        "lowercase_copy": lambda: phrase,
        "capitalized_copy": lambda: phrase.capitalize() + rng.choice(("", ".")),
        "title_copy": lambda: phrase.title(),
        "other_phrase_caps": lambda: other.upper(),
        "chatty_lowercase": lambda: rng.choice(("sure, ", "ok: ", "here it is: ")) + phrase,
    }
    kind = rng.choices(list(violations), weights=(3, 2, 2, 2, 1))[0]
    return chosen, violations[kind](), kind


# --- list: "List three colors." -> "red, blue, green" --------------------------------------------------

LIST_TEMPLATES = (
    "List {n} {c}.", "Name {n} {c}.", "Give me {n} {c}.", "Can you list {n} {c}?", "Please name {n} {c}.",
    "Write {n} {c}, separated by commas.", "Tell me {n} {c}.", "Please list {n} {c}.",
)


def list_prompts(rng):
    items = []
    for template in LIST_TEMPLATES:
        for count, name in NUMBER_NAMES.items():
            for category in CATEGORIES:
                for n_text in (name, str(count)):
                    items.append({"prompt": template.format(n=n_text, c=category), "count": count,
                                  "category": category})
    rng.shuffle(items)
    return items


def _join_items(rng, items):
    if len(items) > 1 and rng.random() < 0.25:
        return ", ".join(items[:-1]) + " and " + items[-1]
    return ", ".join(items)


def list_pair(rng, item, _all_items):
    count, category = item["count"], item["category"]
    members = list(CATEGORIES[category][1])
    chosen = _join_items(rng, rng.sample(members, count))
    other_category = _pick_other(rng, list(CATEGORIES), {category})
    other_members = [m for m in CATEGORIES[other_category][1] if m not in members]
    violations = {
        "too_few": lambda: _join_items(rng, rng.sample(members, max(1, count - rng.choice((1, 2))))),
        "too_many": lambda: _join_items(rng, rng.sample(members, count + rng.choice((1, 2)))),
        "wrong_category": lambda: _join_items(rng, rng.sample(other_members, count)),
        "repeated_item": lambda: ", ".join([rng.choice(members)] * max(3, count)),
        "prose": lambda: rng.choice(("I like {m}.", "Sure, {m} is one.", "My favorite is {m}.",
                                     "There are many {c}.")).format(m=rng.choice(members), c=category),
    }
    kind = rng.choices(list(violations), weights=(2, 2, 3, 1, 2))[0]
    return chosen, violations[kind](), kind


# --- repeat: "Repeat the word moon three times." -> "moon moon moon" ------------------------------------

REPEAT_TEMPLATES = (
    "Repeat the word {w} {n}.", "Say {w} {n}.", "Write the word {w} {n}.", "Type {w} exactly {n}.",
    "Please repeat {w} {n}.", "Say the word {w} {n}, nothing else.",
)


def repeat_prompts(rng):
    items = []
    for template in REPEAT_TEMPLATES:
        for word in REPEAT_WORDS:
            for count, name in NUMBER_NAMES.items():
                times = "twice" if count == 2 and rng.random() < 0.3 else f"{name} times"
                items.append({"prompt": template.format(w=word, n=times), "word": word, "count": count})
    rng.shuffle(items)
    return items


def _repeat(rng, word, count):
    separator = ", " if rng.random() < 0.2 else " "
    return separator.join([word] * count)


def repeat_pair(rng, item, _all_items):
    word, count = item["word"], item["count"]
    other = _pick_other(rng, REPEAT_WORDS, {word})
    wrong_count = rng.choice([k for k in range(1, 7) if abs(k - count) >= 1 and k != count])

    def mixed():
        words = [word if i % 2 == 0 else other for i in range(count + 1)]
        return " ".join(words)

    violations = {
        "wrong_count": lambda: _repeat(rng, word, wrong_count),
        "wrong_word": lambda: _repeat(rng, other, count),
        "single": lambda: word.capitalize() + ".",
        "mixed_words": mixed,
    }
    kind = rng.choices(list(violations), weights=(4, 3, 2, 1))[0]
    return _repeat(rng, word, count), violations[kind](), kind


# --- opposite: "Answer with one word: what is the opposite of hot?" -> "cold" ---------------------------

OPPOSITE_TEMPLATES = (
    "Answer with one word: what is the opposite of {w}?", "In one word, what is the opposite of {w}?",
    "What is the opposite of {w}? Use one word.", "Give the opposite of {w} in one word.",
    "One word only: what is the opposite of {w}?", "Say the opposite of {w}, in a single word.",
)


def opposite_prompts(rng):
    items = [{"prompt": t.format(w=w), "word": w} for t in OPPOSITE_TEMPLATES for w in sorted(OPPOSITES)]
    rng.shuffle(items)
    return items


def opposite_pair(rng, item, _all_items):
    word = item["word"]
    target = OPPOSITES[word]
    all_words = [w for pair in ANTONYM_PAIRS for w in pair]
    wrong = _pick_other(rng, all_words, {word, target})
    chosen = rng.choice((target, target, target.capitalize(), target + "."))
    violations = {
        "same_word": lambda: rng.choice((word, word.capitalize())),
        "wrong_word": lambda: rng.choice((wrong, wrong.capitalize() + ".")),
        "negation": lambda: f"not {word}",
        "sentence": lambda: f"The opposite of {word} is {target}.",
        "wrong_sentence": lambda: f"The opposite of {word} is {wrong}.",
    }
    kind = rng.choices(list(violations), weights=(3, 4, 1, 1, 1))[0]
    return chosen, violations[kind](), kind


# --- end_word: "Name a fruit. End your reply with the word done." -> "mango done" -----------------------

END_WORD_TEMPLATES = (
    "Name {a} {c}. End your reply with the word {e}.", "Name {a} {c} and end your reply with the word {e}.",
    "Tell me {a} {c}, then finish with the word {e}.", "Name one {c}. Your last word must be {e}.",
    "Give me {a} {c} and end with the word {e}.", "Pick {a} {c}. Finish your answer with the word {e}.",
)


def end_word_prompts(rng):
    items = []
    for template in END_WORD_TEMPLATES:
        for category, (singular, _) in CATEGORIES.items():
            for end in END_WORDS:
                items.append({"prompt": template.format(a=_article(singular), c=singular, e=end),
                              "category": category, "end": end})
    rng.shuffle(items)
    return items


def end_word_pair(rng, item, _all_items):
    category, end = item["category"], item["end"]
    member = rng.choice(CATEGORIES[category][1])
    chosen = rng.choice(("{m} {e}", "{m}, {e}", "{M}. {e}", "{M} {e}")).format(
        m=member, M=member.capitalize(), e=end)
    other_end = _pick_other(rng, END_WORDS, {end})
    violations = {
        "missing_end": lambda: rng.choice((member, member.capitalize() + ".")),
        "wrong_end": lambda: f"{member} {other_end}",
        "end_first": lambda: f"{end} {member}",
        "end_only": lambda: end,
    }
    kind = rng.choices(list(violations), weights=(4, 3, 2, 1))[0]
    return chosen, violations[kind](), kind


# --- arithmetic: "What is 3 plus 4?" -> "7" -------------------------------------------------------------

PLUS_TEMPLATES = ("What is {a} plus {b}?", "What is {a} + {b}?", "Compute {a} plus {b}.",
                  "How much is {a} plus {b}?", "Add {a} and {b}.")
MINUS_TEMPLATES = ("What is {a} minus {b}?", "What is {a} - {b}?", "Compute {a} minus {b}.",
                   "Subtract {b} from {a}.")


def arithmetic_prompts(rng):
    items = []
    for a in range(1, 13):
        for b in range(1, 13):
            template = rng.choice(PLUS_TEMPLATES)
            items.append({"prompt": template.format(a=a, b=b), "a": a, "b": b, "target": a + b})
    for a in range(2, 21):
        for b in range(1, min(a, 13)):
            template = rng.choice(MINUS_TEMPLATES)
            items.append({"prompt": template.format(a=a, b=b), "a": a, "b": b, "target": a - b})
    rng.shuffle(items)
    return items


def arithmetic_pair(rng, item, _all_items):
    a, b, target = item["a"], item["b"], item["target"]
    off = max(0, target + rng.choice((-3, -2, -1, 1, 2, 3)))
    off = off if off != target else target + 1
    echo = a if a != target else b
    violations = {
        "off_by_small": lambda: str(off),
        "operand_echo": lambda: str(echo),
        "sentence": lambda: rng.choice(("The answer is {r}.", "It is {r}.", "{a} and {b} make {r}.")).format(
            r=target, a=a, b=b),
        "wrong_sentence": lambda: rng.choice(("The answer is {r}.", "I think it is {r}.")).format(r=off),
        "refusal": lambda: rng.choice(("I do not know.", "I can not do math.", "Maybe.")),
    }
    kind = rng.choices(list(violations), weights=(4, 2, 1, 2, 1))[0]
    return rng.choice((str(target), str(target), f"{target}.")), violations[kind](), kind


# --- compare: "Is 7 greater than 3? Answer yes or no." -> "yes" -----------------------------------------

COMPARE_TEMPLATES = (
    "Is {a} {rel} than {b}? Answer yes or no.", "Is {a} {rel} than {b}? Reply with yes or no.",
    "Yes or no: is {a} {rel} than {b}?", "Answer yes or no. Is {a} {rel} than {b}?",
)
RELATIONS = (("greater", True), ("bigger", True), ("larger", True), ("more", True), ("less", False),
             ("smaller", False))


def compare_prompts(rng):
    items = []
    for a in range(1, 21):
        for b in range(1, 21):
            if a == b:
                continue
            relation, means_greater = rng.choice(RELATIONS)
            template = rng.choice(COMPARE_TEMPLATES)
            holds = a > b if means_greater else a < b
            items.append({"prompt": template.format(a=a, b=b, rel=relation), "a": a, "b": b,
                          "relation": relation, "target": "yes" if holds else "no"})
    rng.shuffle(items)
    return items


def compare_pair(rng, item, _all_items):
    a, b, relation, target = item["a"], item["b"], item["relation"], item["target"]
    flipped = "no" if target == "yes" else "yes"
    chosen = rng.choice((target, target.capitalize(), target.capitalize() + "."))
    violations = {
        "flipped": lambda: rng.choice((flipped, flipped.capitalize() + ".")),
        "hedge": lambda: rng.choice(("maybe", "I am not sure.", "yes or no")),
        "number": lambda: str(rng.choice((a, b))),
        "sentence": lambda: f"{target.capitalize()}, {a} is {'' if target == 'yes' else 'not '}{relation} than {b}.",
    }
    kind = rng.choices(list(violations), weights=(6, 2, 2, 1))[0]
    return chosen, violations[kind](), kind


TASKS = {
    "uppercase": (uppercase_prompts, uppercase_pair),
    "list": (list_prompts, list_pair),
    "repeat": (repeat_prompts, repeat_pair),
    "opposite": (opposite_prompts, opposite_pair),
    "end_word": (end_word_prompts, end_word_pair),
    "arithmetic": (arithmetic_prompts, arithmetic_pair),
    "compare": (compare_prompts, compare_pair),
}


def _shares(total, parts):
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def _record(task, item, chosen, rejected, kind):
    return {"prompt": item["prompt"], "chosen": chosen, "rejected": rejected, "task": task, "violation": kind}


def build_records(seed=SEED, num_train=NUM_TRAIN, num_eval=NUM_EVAL):
    """(train, eval) record lists. Eval prompts are split off first, so no eval prompt text is in train."""
    rng = random.Random(seed)
    train, evaluation = [], []
    train_shares = _shares(num_train, len(TASKS))
    eval_shares = _shares(num_eval, len(TASKS))
    for (task, (make_prompts, make_pair)), n_train, n_eval in zip(TASKS.items(), train_shares, eval_shares):
        items = make_prompts(rng)
        # Prompt texts can repeat within a pool (e.g. same phrase, same template); split on unique texts.
        seen, unique = set(), []
        for item in items:
            if item["prompt"] not in seen:
                seen.add(item["prompt"])
                unique.append(item)
        assert len(unique) > n_eval + n_train // 8, f"{task}: only {len(unique)} distinct prompts"
        eval_items, train_items = unique[:n_eval], unique[n_eval:]
        for item in eval_items:
            evaluation.append(_record(task, item, *make_pair(rng, item, unique)))
        for i in range(n_train):
            # Cycle the pool so every train prompt is used about equally often before any repeats.
            if i % len(train_items) == 0:
                rng.shuffle(train_items)
            item = train_items[i % len(train_items)]
            train.append(_record(task, item, *make_pair(rng, item, unique)))
    rng.shuffle(train)
    rng.shuffle(evaluation)
    return train, evaluation


def conversation_texts(records):
    """Texts in the "\\n\\nHuman: ...\\n\\nAssistant: ..." form the steps train on, for the tokenizer."""
    for r in records:
        for answer in (r["chosen"], r["rejected"]):
            yield f"\n\nHuman: {r['prompt']}\n\nAssistant: {answer}{SPECIAL_TOKENS[0]}"


def train_tokenizer(texts, vocab_size=TOKENIZER_VOCAB_SIZE):
    """A byte-level BPE tokenizer; eos/bos ``<|endoftext|>`` = 0, ``<pad>`` = 1, ``<unk>`` = 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(list(texts), trainer)
    return tokenizer


def write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def generate(out_dir=TINY_DIR, seed=SEED):
    """Write data/train.jsonl, data/eval.jsonl and tokenizer.json under ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    train, evaluation = build_records(seed)
    paths = {"train": out_dir / "data" / "train.jsonl", "eval": out_dir / "data" / "eval.jsonl",
             "tokenizer": out_dir / "tokenizer.json"}
    write_jsonl(paths["train"], train)
    write_jsonl(paths["eval"], evaluation)
    tokenizer = train_tokenizer(conversation_texts(train + evaluation))
    paths["tokenizer"].write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=str(TINY_DIR))
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    for name, path in generate(args.out_dir, args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
