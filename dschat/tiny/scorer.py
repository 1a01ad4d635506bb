"""The rule behind the bundled tiny dataset, as a scorer: how well does an answer follow its prompt?

``rule_score(prompt, answer)`` reads the instructions from the prompt alone (no dataset columns), so it can
judge answers generated during PPO and measure "did RLHF work" independently of the reward model.

A prompt is one request (list, opposite, arithmetic, repeat, copy) plus optional constraints (all caps; a
required last word). The score is the product of the request's content score and one factor per constraint,
in [0, 1]; 1 means every instruction was followed. Partial credit where natural: the right content wrapped in
extra words, a count that is close, the right content with a constraint ignored.
"""
import re
from difflib import SequenceMatcher

from dschat.tiny.lexicon import CATEGORIES, COUNT_WORDS, OPPOSITES

EOT = "<|endoftext|>"
PAD = "<pad>"

# An answer with the right content but the wrong count keeps this much credit (times the size ratio).
WRONG_COUNT_CREDIT = 0.4
# The right content wrapped in extra words (breaking a "one word" or "just the number" form).
WRAPPED_CREDIT = 0.5
# The right content without the required last word.
MISSING_END_CREDIT = 0.25

_CATEGORY_ALTERNATION = "|".join(re.escape(c) for c in sorted(CATEGORIES, key=len, reverse=True))

_CAPS_RE = re.compile(r"capital letters|all caps|upper ?case", re.I)
_END_RE = re.compile(r"(?:with the word|last word must be|make the last word)\s+([a-z]+)", re.I)
_COPY_RE = re.compile(r"(?:copy this|repeat after me|say exactly this|echo this)\s*:\s*([a-z ]+)", re.I)
_ARITHMETIC_RES = (
    (re.compile(r"(\d+)\s*(?:plus|\+)\s*(\d+)", re.I), lambda a, b: a + b),
    (re.compile(r"(\d+)\s*(?:minus|-)\s*(\d+)", re.I), lambda a, b: a - b),
)
_OPPOSITE_RE = re.compile(r"opposite of\s+([a-z]+)", re.I)
_REPEAT_RE = re.compile(
    r"\b(?:repeat|say|write|type)\s+(?:the word\s+)?([a-z]+)\s+(?:exactly\s+)?(?:([a-z]+|\d+)\s+times|(twice))\b", re.I)
_LIST_RE = re.compile(rf"\b(?:list|name|give me|tell me)\s+([a-z]+|\d+)\s+({_CATEGORY_ALTERNATION})\b", re.I)


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
    return int(token) if token.isdigit() else COUNT_WORDS.get(token)


def _parse_request(message):
    """(task, params) of the request in a user message, or None."""
    match = _COPY_RE.search(message)
    if match:
        return "copy", {"phrase": match.group(1).strip()}
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


def parse_instruction(prompt: str):
    """(task, params, constraints) for a prompt of the tiny dataset, or None for an unknown prompt.

    constraints: {"caps": bool, "end": the required last word or None}.
    """
    message = extract_user_message(prompt)
    request = _parse_request(message)
    if request is None:
        return None
    end = _END_RE.search(message)
    constraints = {"caps": bool(_CAPS_RE.search(message)), "end": end.group(1).lower() if end else None}
    return request[0], request[1], constraints


def _count_credit(got: int, wanted: int) -> float:
    """1 for the requested count; otherwise a small credit that grows as the count gets closer."""
    if got == wanted:
        return 1.0
    return WRONG_COUNT_CREDIT * min(got, wanted) / max(got, wanted)


def _caps_fraction(answer):
    # No letters (a bare number) breaks no capitalisation rule; an empty answer fails on content anyway.
    letters = [c for c in answer if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters) if letters else 1.0


def _split_items(answer):
    items = []
    for part in re.split(r",|;|\n|\band\b|&", answer.lower()):
        item = re.sub(r"[^a-z ]", " ", part).split()
        if item and item[0] in ("a", "an", "the"):
            item = item[1:]
        if item:
            items.append(" ".join(item))
    return items


def _score_copy(answer, phrase):
    # Word order matters (a copy, not a bag of words), hence a sequence match rather than overlap.
    return SequenceMatcher(None, words_of(phrase), words_of(answer), autojunk=False).ratio()


def _score_list(answer, count, category):
    items = _split_items(answer)
    if not items:
        return 0.0
    distinct_valid = len({item for item in items if item in CATEGORIES[category]})
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


def _content_score(task, params, answer):
    if task == "copy":
        return _score_copy(answer, params["phrase"])
    if task == "list":
        return _score_list(answer, params["count"], params["category"])
    if task == "repeat":
        return _score_repeat(answer, params["word"], params["count"])
    if task == "opposite":
        return _score_single_word(answer, params["target"])
    if task == "arithmetic":
        return _score_single_word(answer, str(params["target"]))
    raise AssertionError(f"unhandled task {task}")


def _split_end_word(answer, end):
    """(answer without its final ``end`` word, whether it ended with it)."""
    match = re.search(rf"[\s,.;:!]*\b{re.escape(end)}\b[\s.!]*$", answer, re.I)
    if not match:
        return answer, False
    return answer[:match.start()], True


def rule_score(prompt: str, answer: str) -> float:
    """How well ``answer`` follows every instruction in ``prompt``, in [0, 1]; 0 for prompts of unknown tasks."""
    parsed = parse_instruction(prompt)
    if parsed is None:
        return 0.0
    task, params, constraints = parsed
    answer = clean_answer(answer)
    score = 1.0
    if constraints["caps"]:
        score *= _caps_fraction(answer)
    if constraints["end"]:
        answer, ended = _split_end_word(answer, constraints["end"])
        score *= 1.0 if ended else MISSING_END_CREDIT
    return score * _content_score(task, params, answer)


def score_batch(prompts, answers) -> list:
    """``rule_score`` over paired lists of prompts and answers."""
    if len(prompts) != len(answers):
        raise ValueError(f"{len(prompts)} prompts but {len(answers)} answers")
    return [rule_score(p, a) for p, a in zip(prompts, answers)]
