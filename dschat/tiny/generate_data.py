"""Build the bundled tiny RLHF dataset and its tokenizer, deterministically.

    python -m dschat.tiny.generate_data            # rewrites dschat/tiny/data/*.jsonl and tokenizer.json
    python -m dschat.tiny.generate_data --out-dir /tmp/x

Every prompt is a small request (list, opposite, arithmetic, repeat, copy) plus zero, one or two format
constraints ("Use all caps.", "End with the word done."); ``dschat.tiny.scorer`` checks an answer against
all of them from the prompt and the answer alone. ``chosen`` follows every instruction. ``rejected`` breaks
one, mostly in a way a tiny reward model can see (a constraint ignored, a sentence instead of one word, a
refusal), sometimes in content (wrong count, wrong fact). Combining constraints is what keeps a briefly
trained SFT model imperfect on held-out prompts, and what a reward model can teach it in PPO.
Eval prompts never occur in train.
"""
import argparse
import json
import random
from pathlib import Path

from dschat.tiny.lexicon import (ANTONYM_PAIRS, CATEGORIES, END_WORDS, NUMBER_NAMES, OPPOSITES,
                                 PHRASE_ADJECTIVES, PHRASE_NOUNS, PHRASE_PLACES, PHRASE_VERBS, REPEAT_WORDS)

SEED = 20240601
# 6000 rather than 3000: with the reward model's 40% share at 1200 pairs its held-out accuracy stalled near
# 0.90 (it memorises); at 2400 pairs it reaches about 0.94. Time per step does not depend on the size.
NUM_TRAIN = 6000
NUM_EVAL = 600
TOKENIZER_VOCAB_SIZE = 1536
SPECIAL_TOKENS = ("<|endoftext|>", "<pad>", "<unk>")
TINY_DIR = Path(__file__).resolve().parent

# Openers that change the wording but not the request.
PREFIXES = ("", "", "Hi! ", "Hello. ", "Quick question: ")
CAPS_TEMPLATES = ("Answer in capital letters.", "Use all caps.", "Write in uppercase.", "Reply in uppercase.")
END_TEMPLATES = ("End with the word {e}.", "Finish with the word {e}.", "Make the last word {e}.",
                 "End your reply with the word {e}.")
# How a violation of each kind is weighted when a rejected answer is drawn. Kinds a tiny reward model sees
# at a glance (a constraint ignored, wrong form) outweigh kinds that need a fact or an exact pairing.
# Measured: a 2-layer reward model trained for a minute or two separates the form kinds (96-99%), but wrong
# counts only a little better than chance and content kinds (a wrong fact or word pairing) at chance; so
# counts are uncommon and content kinds rare (together about one rejection in ten).
FORM_WEIGHT, COUNT_WEIGHT, CONTENT_WEIGHT = 8, 2, 1
MODIFIER_VIOLATIONS = {"ignored_caps": 10, "ignored_end": 10, "wrong_end": 1, "end_first": 3}


def _pick_other(rng, pool, exclude):
    return rng.choice([x for x in pool if x not in exclude])


def _join_items(rng, items):
    if len(items) > 1 and rng.random() < 0.25:
        return ", ".join(items[:-1]) + " and " + items[-1]
    return ", ".join(items)


# --- base requests: each samples a prompt, a correct answer, and ways to get it wrong -------------------
# A violation maps kind -> (weight, function returning the wrong answer's content).

class ListRequest:
    """ "List three colors." -> "red, blue, green" """
    templates = ("List {n} {c}.", "Name {n} {c}.", "Give me {n} {c}.", "Tell me {n} {c}.", "Please name {n} {c}.")
    modifier_weights = {"": 3, "caps": 3, "end": 3, "caps+end": 2}

    def sample(self, rng):
        count = rng.choice(list(NUMBER_NAMES))
        category = rng.choice(list(CATEGORIES))
        n_text = NUMBER_NAMES[count] if rng.random() < 0.6 else str(count)
        return {"text": rng.choice(self.templates).format(n=n_text, c=category), "count": count,
                "category": category}

    def answer(self, rng, item):
        return _join_items(rng, rng.sample(CATEGORIES[item["category"]], item["count"]))

    def violations(self, rng, item):
        count, category = item["count"], item["category"]
        members = CATEGORIES[category]
        other = CATEGORIES[_pick_other(rng, list(CATEGORIES), {category})]
        return {
            "single_item": (FORM_WEIGHT, lambda: rng.choice(members)),
            "prose": (FORM_WEIGHT, lambda: rng.choice(("I like {m}", "sure, {m} is one", "there are many {c}"))
                      .format(m=rng.choice(members), c=category)),
            "too_few": (COUNT_WEIGHT, lambda: _join_items(rng, rng.sample(members, count - 1))),
            "too_many": (COUNT_WEIGHT, lambda: _join_items(rng, rng.sample(members, count + rng.choice((1, 2))))),
            "wrong_category": (CONTENT_WEIGHT, lambda: _join_items(rng, rng.sample(other, count))),
        }


class OppositeRequest:
    """ "What is the opposite of hot?" -> "cold" """
    templates = ("What is the opposite of {w}?", "In one word, what is the opposite of {w}?",
                 "One word only: the opposite of {w}?", "Give one word for the opposite of {w}.")
    modifier_weights = {"": 4, "caps": 2, "end": 2, "caps+end": 1}

    def sample(self, rng):
        word = rng.choice(sorted(OPPOSITES))
        return {"text": rng.choice(self.templates).format(w=word), "word": word}

    def answer(self, rng, item):
        return OPPOSITES[item["word"]]

    def violations(self, rng, item):
        word = item["word"]
        target = OPPOSITES[word]
        wrong = _pick_other(rng, [w for pair in ANTONYM_PAIRS for w in pair], {word, target})
        return {
            "sentence": (FORM_WEIGHT, lambda: f"the opposite of {word} is {target}"),
            "negation": (FORM_WEIGHT, lambda: f"not {word}"),
            "refusal": (FORM_WEIGHT, lambda: rng.choice(("I do not know", "there is no opposite"))),
            "same_word": (CONTENT_WEIGHT, lambda: word),
            "wrong_word": (CONTENT_WEIGHT, lambda: wrong),
        }


class ArithmeticRequest:
    """ "What is 3 plus 4?" -> "7" (small numbers, so every fact recurs in the data) """
    plus_templates = ("What is {a} plus {b}?", "What is {a} + {b}?", "Compute {a} plus {b}.",
                      "How much is {a} plus {b}?")
    minus_templates = ("What is {a} minus {b}?", "What is {a} - {b}?", "Compute {a} minus {b}.",
                       "How much is {a} minus {b}?")
    # Capital letters mean nothing for a number, so arithmetic only takes the end-word constraint.
    modifier_weights = {"": 1, "end": 1}

    def sample(self, rng):
        if rng.random() < 0.6:
            a, b = rng.randint(1, 4), rng.randint(1, 4)
            return {"text": rng.choice(self.plus_templates).format(a=a, b=b), "a": a, "b": b, "target": a + b}
        a = rng.randint(2, 5)
        b = rng.randint(1, a - 1)
        return {"text": rng.choice(self.minus_templates).format(a=a, b=b), "a": a, "b": b, "target": a - b}

    def answer(self, rng, item):
        return str(item["target"])

    def violations(self, rng, item):
        a, b, target = item["a"], item["b"], item["target"]
        off = target + rng.choice((-2, -1, 1, 2))
        off = off if off > 0 else target + 1
        echo = a if a != target else b
        return {
            "sentence": (FORM_WEIGHT, lambda: rng.choice(("the answer is {r}", "{a} and {b} make {r}")).format(
                r=target, a=a, b=b)),
            "refusal": (FORM_WEIGHT, lambda: rng.choice(("I do not know", "I can not do math", "maybe"))),
            "off_by_small": (CONTENT_WEIGHT, lambda: str(off)),
            "operand_echo": (CONTENT_WEIGHT, lambda: str(echo)),
        }


class RepeatRequest:
    """ "Say moon three times." -> "moon moon moon" """
    templates = ("Say {w} {n} times.", "Repeat the word {w} {n} times.", "Write the word {w} {n} times.",
                 "Please repeat {w} {n} times.")
    modifier_weights = {"": 3, "caps": 3, "end": 3, "caps+end": 2}

    def sample(self, rng):
        word, count = rng.choice(REPEAT_WORDS), rng.choice(list(NUMBER_NAMES))
        return {"text": rng.choice(self.templates).format(w=word, n=NUMBER_NAMES[count]), "word": word,
                "count": count}

    def answer(self, rng, item):
        return (", " if rng.random() < 0.2 else " ").join([item["word"]] * item["count"])

    def violations(self, rng, item):
        word, count = item["word"], item["count"]
        other = _pick_other(rng, REPEAT_WORDS, {word})
        wrong_count = rng.choice([k for k in range(2, 7) if k != count])
        return {
            "single": (FORM_WEIGHT, lambda: word),
            "chatty": (FORM_WEIGHT, lambda: rng.choice(("sure", "okay, here you go", "I will not"))),
            "wrong_count": (COUNT_WEIGHT, lambda: " ".join([word] * wrong_count)),
            "wrong_word": (CONTENT_WEIGHT, lambda: " ".join([other] * count)),
        }


def _phrases():
    phrases = [f"{det} {adj} {noun}" for det in ("the", "my") for adj in PHRASE_ADJECTIVES for noun in PHRASE_NOUNS]
    for noun in PHRASE_NOUNS:
        for verb in PHRASE_VERBS:
            phrases.append(f"the {noun} {verb}")
            phrases.extend(f"the {noun} {verb} {place}" for place in PHRASE_PLACES)
    return phrases


class CopyRequest:
    """ "Copy this: the cat sleeps." -> "the cat sleeps"; with "Use all caps." it is the uppercase task """
    templates = ("Copy this: {p}.", "Repeat after me: {p}.", "Say exactly this: {p}.", "Echo this: {p}.")
    modifier_weights = {"": 1, "caps": 5, "end": 1, "caps+end": 2}
    phrases = _phrases()

    def sample(self, rng):
        phrase = rng.choice(self.phrases)
        return {"text": rng.choice(self.templates).format(p=phrase), "phrase": phrase}

    def answer(self, rng, item):
        return item["phrase"]

    def violations(self, rng, item):
        phrase = item["phrase"]
        other = _pick_other(rng, self.phrases, {phrase})
        return {
            "chatty": (FORM_WEIGHT, lambda: rng.choice(("sure, I can do that", "no", "okay"))),
            "first_word_only": (FORM_WEIGHT, lambda: phrase.split()[0]),
            "other_phrase": (CONTENT_WEIGHT, lambda: other),
        }


REQUESTS = {"list": ListRequest(), "opposite": OppositeRequest(), "arithmetic": ArithmeticRequest(),
            "repeat": RepeatRequest(), "copy": CopyRequest()}


# --- constraints and whole records ---------------------------------------------------------------------

def _sample_prompt(rng, request):
    item = request.sample(rng)
    modifiers = rng.choices(list(request.modifier_weights), weights=list(request.modifier_weights.values()))[0]
    item["caps"] = "caps" in modifiers
    item["end"] = rng.choice(END_WORDS) if "end" in modifiers else None
    parts = [item["text"]]
    if item["caps"]:
        parts.append(rng.choice(CAPS_TEMPLATES))
    if item["end"]:
        parts.append(rng.choice(END_TEMPLATES).format(e=item["end"]))
    # Constraints come before or after the request, in either order, so wording and position vary.
    request_text = parts.pop(0)
    parts.insert(rng.randint(0, len(parts)), request_text)
    item["prompt"] = rng.choice(PREFIXES) + " ".join(parts)
    return item


def _apply_constraints(rng, content, caps, end, *, end_word=None, end_first=False):
    """The final answer: ``content`` with the end word appended (or put first) and capitalised as asked."""
    end_word = end_word or end
    text = content
    if end_word:
        text = f"{end_word} {content}" if end_first else content + rng.choice((" ", ", ", ". ")) + end_word
    if caps:
        return text.upper()
    # Some answers start with a capital letter, as people write; the rule ignores case unless caps is asked.
    return text[0].upper() + text[1:] if rng.random() < 0.3 else text


def _wrong_case(rng, text):
    return rng.choice((text.lower(), text.lower().capitalize(), text.title()))


def make_pair(rng, request, item):
    """(chosen, rejected, violation kind) for one prompt."""
    caps, end = item["caps"], item["end"]
    chosen = _apply_constraints(rng, request.answer(rng, item), caps, end)
    candidates = dict(request.violations(rng, item))
    if caps:
        candidates["ignored_caps"] = (MODIFIER_VIOLATIONS["ignored_caps"], None)
    if end:
        for kind in ("ignored_end", "wrong_end", "end_first"):
            candidates[kind] = (MODIFIER_VIOLATIONS[kind], None)
    kinds = sorted(candidates)
    kind = rng.choices(kinds, weights=[candidates[k][0] for k in kinds])[0]
    content = request.answer(rng, item)
    if kind == "ignored_caps":
        rejected = _wrong_case(rng, _apply_constraints(rng, content, False, end))
    elif kind == "ignored_end":
        rejected = _apply_constraints(rng, content, caps, None)
    elif kind == "wrong_end":
        rejected = _apply_constraints(rng, content, caps, end, end_word=_pick_other(rng, END_WORDS, {end}))
    elif kind == "end_first":
        rejected = _apply_constraints(rng, content, caps, end, end_first=True)
    else:
        rejected = _apply_constraints(rng, candidates[kind][1](), caps, end)
    return chosen, rejected, kind


def _shares(total, parts):
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def _record(task, item, chosen, rejected, kind):
    # Extra columns are plain strings: a list column that is empty in many rows trips Arrow's type inference.
    constraints = "+".join(c for c, on in (("caps", item["caps"]), ("end_word", item["end"])) if on) or "none"
    return {"prompt": item["prompt"], "chosen": chosen, "rejected": rejected, "task": task,
            "constraints": constraints, "violation": kind}


def build_records(seed=SEED, num_train=NUM_TRAIN, num_eval=NUM_EVAL):
    """(train, eval) record lists. Eval prompts are drawn first and excluded from train."""
    rng = random.Random(seed)
    train, evaluation = [], []
    for (task, request), n_train, n_eval in zip(REQUESTS.items(), _shares(num_train, len(REQUESTS)),
                                                _shares(num_eval, len(REQUESTS))):
        eval_prompts = set()
        while len(eval_prompts) < n_eval:
            item = _sample_prompt(rng, request)
            if item["prompt"] not in eval_prompts:
                eval_prompts.add(item["prompt"])
                evaluation.append(_record(task, item, *make_pair(rng, request, item)))
        produced = 0
        while produced < n_train:
            item = _sample_prompt(rng, request)
            if item["prompt"] in eval_prompts:
                continue
            train.append(_record(task, item, *make_pair(rng, request, item)))
            produced += 1
    rng.shuffle(train)
    rng.shuffle(evaluation)
    return train, evaluation


def conversation_texts(records):
    """Texts in the "\\n\\nHuman: ...\\n\\nAssistant: ..." form the steps train on, for the tokenizer."""
    for r in records:
        for answer in (r["chosen"], r["rejected"]):
            yield f"\n\nHuman: {r['prompt']}\n\nAssistant: {answer}{SPECIAL_TOKENS[0]}"


def lexicon_texts():
    """Every lexicon word in lower, Capitalised and UPPER case, so each has whole-word tokens in any case a
    policy may write it, not only in the cases the records happen to use."""
    words = {w for members in CATEGORIES.values() for w in members} | set(OPPOSITES) | set(END_WORDS)
    words |= set(REPEAT_WORDS) | set(PHRASE_ADJECTIVES) | set(PHRASE_NOUNS) | set(PHRASE_VERBS)
    words |= set(CATEGORIES) | {w for place in PHRASE_PLACES for w in place.split()}
    for word in sorted(words):
        yield f" {word} {word.capitalize()} {word.upper()}"


# Qwen2's pre-tokenizer (single digits, words with their leading space). transformers' AutoTokenizer loads a
# folder whose config says model_type "qwen2" as Qwen2Tokenizer whatever tokenizer_config.json says, and that
# class rebuilds the pipeline from vocab + merges with exactly this normalizer and pre-tokenizer. Training with
# the same pipeline makes every architecture's saved folder tokenize identically.
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                     r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def train_tokenizer(texts, vocab_size=TOKENIZER_VOCAB_SIZE):
    """A byte-level BPE tokenizer; eos/bos ``<|endoftext|>`` = 0, ``<pad>`` = 1, ``<unk>`` = 2."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
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


def generate(out_dir=TINY_DIR, seed=SEED, num_train=NUM_TRAIN, num_eval=NUM_EVAL):
    """Write data/train.jsonl, data/eval.jsonl and tokenizer.json under ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    train, evaluation = build_records(seed, num_train, num_eval)
    paths = {"train": out_dir / "data" / "train.jsonl", "eval": out_dir / "data" / "eval.jsonl",
             "tokenizer": out_dir / "tokenizer.json"}
    write_jsonl(paths["train"], train)
    write_jsonl(paths["eval"], evaluation)
    tokenizer = train_tokenizer([*conversation_texts(train + evaluation), *lexicon_texts()])
    paths["tokenizer"].write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--out-dir", default=str(TINY_DIR))
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--num-train", type=int, default=NUM_TRAIN)
    parser.add_argument("--num-eval", type=int, default=NUM_EVAL)
    args = parser.parse_args(argv)
    for name, path in generate(args.out_dir, args.seed, args.num_train, args.num_eval).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
