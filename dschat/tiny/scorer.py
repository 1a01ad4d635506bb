"""The rule behind the bundled tiny dataset, as a scorer: how well does an answer follow its prompt?

``rule_score(prompt, answer)`` reads the instruction from the prompt alone (no dataset columns), so it can
judge answers generated during PPO and measure "did RLHF work" independently of the reward model.
Scores are in [0, 1]; 1 means the instruction was followed exactly, with partial credit where an answer
is right in substance but breaks the requested form (e.g. "The answer is 7." instead of "7").
"""
import re
from difflib import SequenceMatcher

from dschat.tiny.lexicon import CATEGORIES, COUNT_WORDS, OPPOSITES, SINGULAR_TO_PLURAL

EOT = "<|endoftext|>"
PAD = "<pad>"

# An answer with the right content but the wrong count keeps this much credit (times the size ratio).
WRONG_COUNT_CREDIT = 0.4
# An answer with the right content wrapped in extra words (breaking a "one word"/"just the number" form).
WRAPPED_CREDIT = 0.5

_CATEGORY_ALTERNATION = "|".join(re.escape(c) for c in sorted(CATEGORIES, key=len, reverse=True))
_SINGULAR_ALTERNATION = "|".join(re.escape(c) for c in sorted(SINGULAR_TO_PLURAL, key=len, reverse=True))

_UPPERCASE_RE = re.compile(r"(?:upper ?case|capital letters|all caps)[^:]*:\s*(.+)$", re.I | re.S)
_END_WORD_RE = re.compile(r"(?:with the word|last word must be)\s+([a-z]+)", re.I)
_END_CATEGORY_RE = re.compile(rf"\b(?:a|an|one)\s+({_SINGULAR_ALTERNATION})\b", re.I)
_COMPARE_RE = re.compile(r"\bis\s+(\d+)\s+(greater|bigger|larger|more|less|smaller)\s+than\s+(\d+)", re.I)
_ARITHMETIC_RES = (
    (re.compile(r"(\d+)\s*(?:plus|\+)\s*(\d+)", re.I), lambda a, b: a + b),
    (re.compile(r"(\d+)\s*(?:minus|-)\s*(\d+)", re.I), lambda a, b: a - b),
    (re.compile(r"\badd\s+(\d+)\s+and\s+(\d+)", re.I), lambda a, b: a + b),
    (re.compile(r"\bsubtract\s+(\d+)\s+from\s+(\d+)", re.I), lambda b, a: a - b),
)
_OPPOSITE_RE = re.compile(r"opposite of\s+([a-z]+)", re.I)
_REPEAT_RE = re.compile(
    r"\b(?:repeat|say|write|type)\s+(?:the word\s+)?([a-z]+)\s+(?:exactly\s+)?(?:([a-z]+|\d+)\s+times|(twice))\b",
    re.I)
_LIST_RE = re.compile(rf"\b(?:list|name|give me|write|tell me)\s+([a-z]+|\d+)\s+({_CATEGORY_ALTERNATION})\b",
                      re.I)


def extract_user_message(prompt: str) -> str:
    """The last user message, from either the raw message or the "\\n\\nHuman: ...\\n\\nAssistant:" form."""
    if "Human:" in prompt:
        prompt = prompt.rsplit("Human:", 1)[1]
        prompt = prompt.split("Assistant:", 1)[0]
    return prompt.strip()


def clean_answer(answer: str) -> str:
    """The answer text up to the first end-of-text token, without padding tokens or outer whitespace."""
    return answer.split(EOT, 1)[0].replace(PAD, "").strip()


def words_of(text: str) -> list:
    """Lower-cased words and digit runs; punctuation and spacing never matter to the rule."""
    return re.findall(r"[a-z]+|\d+", text.lower())


def _count_of(token: str):
    token = token.lower()
    if token.isdigit():
        return int(token)
    return COUNT_WORDS.get(token)


def parse_instruction(prompt: str):
    """(task, params) for a prompt of the tiny dataset, or None when the prompt is not one of its tasks.

    The order matters: the uppercase task's phrase and the end-word task's "Name a ..." could otherwise be
    read as other tasks.
    """
    message = extract_user_message(prompt)
    match = _UPPERCASE_RE.search(message)
    if match:
        return "uppercase", {"phrase": match.group(1)}
    match = _END_WORD_RE.search(message)
    if match:
        category = _END_CATEGORY_RE.search(message)
        plural = SINGULAR_TO_PLURAL[category.group(1).lower()] if category else None
        return "end_word", {"end": match.group(1).lower(), "category": plural}
    match = _COMPARE_RE.search(message)
    if match:
        a, relation, b = int(match.group(1)), match.group(2).lower(), int(match.group(3))
        holds = a > b if relation in ("greater", "bigger", "larger", "more") else a < b
        return "compare", {"target": "yes" if holds else "no"}
    for pattern, operation in _ARITHMETIC_RES:
        match = pattern.search(message)
        if match:
            return "arithmetic", {"target": operation(int(match.group(1)), int(match.group(2)))}
    match = _OPPOSITE_RE.search(message)
    if match and match.group(1).lower() in OPPOSITES:
        return "opposite", {"target": OPPOSITES[match.group(1).lower()]}
    match = _REPEAT_RE.search(message)
    if match:
        count = 2 if match.group(3) else _count_of(match.group(2))
        if count:
            return "repeat", {"word": match.group(1).lower(), "count": count}
    match = _LIST_RE.search(message)
    if match and _count_of(match.group(1)):
        return "list", {"count": _count_of(match.group(1)), "category": match.group(2).lower()}
    return None


def _count_credit(got: int, wanted: int) -> float:
    """1 for the requested count; otherwise a small credit that grows as the count gets closer."""
    if got == wanted:
        return 1.0
    return WRONG_COUNT_CREDIT * min(got, wanted) / max(got, wanted)


def _score_uppercase(answer, phrase):
    letters = [c for c in answer if c.isalpha()]
    if not letters:
        return 0.0
    caps_fraction = sum(c.isupper() for c in letters) / len(letters)
    # Word order matters (a copy, not a bag of words), hence a sequence match rather than overlap.
    content = SequenceMatcher(None, words_of(phrase), words_of(answer), autojunk=False).ratio()
    return caps_fraction * content


def _split_items(answer):
    parts = re.split(r",|;|\n|\band\b|&", answer.lower())
    items = []
    for part in parts:
        item = re.sub(r"[^a-z ]", " ", part).split()
        if item and item[0] in ("a", "an", "the"):
            item = item[1:]
        if item:
            items.append(" ".join(item))
    return items


def _score_list(answer, count, category):
    items = _split_items(answer)
    if not items:
        return 0.0
    members = CATEGORIES[category][1]
    distinct_valid = len({item for item in items if item in members})
    return distinct_valid / len(items) * _count_credit(len(items), count)


def _score_repeat(answer, word, count):
    words = words_of(answer)
    hits = words.count(word)
    if not hits:
        return 0.0
    return hits / len(words) * _count_credit(hits, count)


def _score_single_word(answer, target):
    words = words_of(answer)
    if words == [target]:
        return 1.0
    return WRAPPED_CREDIT if target in words else 0.0


def _score_end_word(answer, end, category):
    words = words_of(answer)
    if not words or words[-1] != end:
        return 0.0
    body = words[:-1]
    has_item = bool(body) if category is None else any(w in CATEGORIES[category][1] for w in body)
    return 0.5 + 0.5 * has_item


def _score_yes_no(answer, target):
    words = words_of(answer)
    if words == [target]:
        return 1.0
    return WRAPPED_CREDIT if words and words[0] == target else 0.0


def rule_score(prompt: str, answer: str) -> float:
    """How well ``answer`` follows the instruction in ``prompt``, in [0, 1]; 0 for prompts of unknown tasks."""
    parsed = parse_instruction(prompt)
    if parsed is None:
        return 0.0
    task, params = parsed
    answer = clean_answer(answer)
    if task == "uppercase":
        return _score_uppercase(answer, params["phrase"])
    if task == "list":
        return _score_list(answer, params["count"], params["category"])
    if task == "repeat":
        return _score_repeat(answer, params["word"], params["count"])
    if task == "opposite":
        return _score_single_word(answer, params["target"])
    if task == "end_word":
        return _score_end_word(answer, params["end"], params["category"])
    if task == "arithmetic":
        return _score_single_word(answer, str(params["target"]))
    if task == "compare":
        return _score_yes_no(answer, params["target"])
    raise AssertionError(f"unhandled task {task}")


def score_batch(prompts, answers) -> list:
    """``rule_score`` over paired lists of prompts and answers."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    return [rule_score(p, a) for p, a in zip(prompts, answers)]
