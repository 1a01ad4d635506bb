"""Prompt and answer formatting shared by all three steps.

Step 1 trains on ``format_prompt(messages) + format_answer(answer)``, step 2 scores the same strings and
step 3 generates after ``format_prompt(messages)``; using these functions everywhere keeps the three steps
seeing identical text, which is what makes the reward model's scores meaningful for the actor.

Without a chat template the text is DeepSpeed-Chat's::

    "\\n\\nHuman: {user}\\n\\nAssistant: {assistant}\\n\\nHuman: {user}\\n\\nAssistant:" + " {answer}" + EOT

With ``tokenizer.chat_template`` set, the template renders the prompt (with the generation prompt) and the
answer is ``answer + EOT`` (the template already ends where the answer starts, so no extra space).
"""
import re

from dschat.errors import UsageError

ROLE_BY_SPEAKER = {"Human": "user", "Assistant": "assistant"}
SPEAKER_BY_ROLE = {"user": "Human", "assistant": "Assistant"}
HUMAN_PREFIX = "\n\nHuman: "
ASSISTANT_PREFIX = "\n\nAssistant:"

# Hub transcripts separate turns with a blank line ("\n\nHuman: ..."); some (DeepSpeed-Chat's own
# re-formatting of synthetic data) use a single space. Splitting on the blank-line form when present avoids
# cutting a turn that merely mentions "Human:" in its text.
_PARAGRAPH_MARKER = re.compile(r"(?:\A\s*|\n\n+)(Human|Assistant):")
_INLINE_MARKER = re.compile(r"(?:\A\s*|\s+)(Human|Assistant):")
_HAS_PARAGRAPH_MARKER = re.compile(r"\n\n(Human|Assistant):")


def get_eot_token(tokenizer):
    """The end-of-conversation token appended to every answer (steps 1 and 2) and used to stop (step 3).

    DeepSpeed-Chat hard-coded "<|endoftext|>", which is a real token only for GPT-2-style vocabularies; the
    tokenizer's own EOS token is a single known id for every model, and generation stops on it by default.
    ``--eot_token`` only reaches it through ``load_tokenizer``, as the EOS token ``--add_eot_token`` gives a tokenizer
    that has none.
    """
    if not getattr(tokenizer, "eos_token", None):
        raise UsageError("the tokenizer has no eos_token to end conversations with; set one, e.g. "
                         "tokenizer.add_special_tokens({'eos_token': '<|endoftext|>'}) and resize the model")
    return tokenizer.eos_token


def uses_chat_template(tokenizer):
    return bool(getattr(tokenizer, "chat_template", None))


def parse_transcript(text, preamble_role="user"):
    """"\\n\\nHuman: a\\n\\nAssistant: b\\n\\nHuman: c\\n\\nAssistant:" -> [user a, assistant b, user c].

    Empty turns (the trailing "Assistant:" of a prompt) are dropped and consecutive turns of one role are
    merged, because chat templates require user/assistant alternation and hh-rlhf has repeated speakers.
    Text before the first marker (or text with no marker at all) is a ``preamble_role`` turn ("system": a system
    message as ``render_human_assistant`` writes it).
    """
    pattern = _PARAGRAPH_MARKER if _HAS_PARAGRAPH_MARKER.search(text) else _INLINE_MARKER
    parts = pattern.split(text)
    turns = [(preamble_role, parts[0])]
    turns += [(ROLE_BY_SPEAKER[speaker], content) for speaker, content in zip(parts[1::2], parts[2::2])]
    return merge_consecutive_roles({"role": role, "content": content.strip()} for role, content in turns)


def merge_consecutive_roles(messages):
    merged = []
    for message in messages:
        if not message["content"]:
            continue
        if merged and merged[-1]["role"] == message["role"]:
            merged[-1] = {"role": message["role"], "content": merged[-1]["content"] + "\n\n" + message["content"]}
        else:
            merged.append(dict(message))
    return merged


def split_last_answer(messages):
    """A full conversation -> (prompt turns, final assistant answer), or (messages, None) if it ends with
    a user turn."""
    if messages and messages[-1]["role"] == "assistant":
        return list(messages[:-1]), messages[-1]["content"]
    return list(messages), None


def render_human_assistant(messages):
    """DeepSpeed-Chat's prompt text; a system message is put first, without a speaker marker."""
    pieces = []
    for message in messages:
        if message["role"] == "system":
            pieces.append(message["content"])
        else:
            pieces.append(f"\n\n{SPEAKER_BY_ROLE[message['role']]}: {message['content']}")
    return "".join(pieces) + ASSISTANT_PREFIX


def format_prompt(messages, tokenizer):
    """The text the model sees before its answer; ends where generation starts."""
    if uses_chat_template(tokenizer):
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return render_human_assistant(messages)


def format_answer(text, tokenizer, add_eot=True, eot_token=None):
    """The answer as it follows ``format_prompt``: " " + text + EOT, or text + EOT with a chat template."""
    body = text if uses_chat_template(tokenizer) else " " + text
    if not add_eot:
        return body
    return body + (eot_token if eot_token is not None else get_eot_token(tokenizer))
