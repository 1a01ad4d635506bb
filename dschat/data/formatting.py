"""Prompt and answer formatting shared by all three steps.

Step 1 trains on ``format_prompt(messages) + format_answer(answer)``, step 2 scores the same strings and
step 3 generates after ``format_prompt(messages)``; using these functions everywhere keeps the three steps
seeing identical text, which is what makes the reward model's scores meaningful for the actor.

Without a chat template the text is DeepSpeed-Chat's::

    "\\n\\nHuman: {user}\\n\\nAssistant: {assistant}\\n\\nHuman: {user}\\n\\nAssistant:" + " {answer}" + EOT

With ``tokenizer.chat_template`` set, the template renders the prompt (with the generation prompt), and the answer
is what the template writes after that prompt for the conversation with the answer added, up to its EOT (Llama-2's
" {answer} " before "</s>"; ChatML's "{answer}" before "<|im_end|>"), then the EOT: the final answer is trained with
the template's spacing, as OpenRLHF and TRL cut it from the whole rendered conversation, and as the earlier turns of
a ``--multiturn`` conversation are. A template that writes no EOT after the answer (Gemma's "<end_of_turn>" where the
EOS is "<eos>"), or renders the prompt otherwise, gives ``answer + EOT``.
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
    message as ``render_human_assistant`` writes it). "\\r\\n" line ends are read as "\\n" (text written on Windows).
    """
    text = with_lf_line_ends(text)
    pattern = _PARAGRAPH_MARKER if _HAS_PARAGRAPH_MARKER.search(text) else _INLINE_MARKER
    parts = pattern.split(text)
    turns = [(preamble_role, parts[0])]
    turns += [(ROLE_BY_SPEAKER[speaker], content) for speaker, content in zip(parts[1::2], parts[2::2])]
    return merge_consecutive_roles({"role": role, "content": content.strip()} for role, content in turns)


def with_lf_line_ends(text):
    """``text`` with its "\\r\\n" line ends as "\\n": a transcript's blank-line markers ("\\n\\nHuman:") were not found
    in "\\r\\n\\r\\nHuman:", so a system message before the first turn went unread and the turns were cut wherever a
    turn's text says "Human:"."""
    return text.replace("\r\n", "\n")


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
    a user turn. A last turn that calls tools is a ``ToolCallAnswer``."""
    if messages and messages[-1]["role"] == "assistant":
        last = messages[-1]
        calls = last.get("tool_calls")
        return list(messages[:-1]), ToolCallAnswer(last["content"], calls) if calls else last["content"]
    return list(messages), None


class ToolCallAnswer(str):
    """An answer that calls tools (function-calling SFT data: glaive's, xlam's, hermes': the call is the answer): its
    text (mostly empty) with the assistant turn's ``tool_calls``. ``format_answer`` writes it as the chat template
    writes the turn after the prompt; it equals only an answer of the same text and calls (two other calls are no
    tie)."""

    def __new__(cls, text, tool_calls):
        answer = super().__new__(cls, text)
        answer.tool_calls = list(tool_calls)
        return answer

    def __eq__(self, other):
        return isinstance(other, str) and str(self) == str(other) and \
            self.tool_calls == getattr(other, "tool_calls", None)

    def __ne__(self, other):
        return not self == other

    __hash__ = str.__hash__

    def __reduce__(self):
        return type(self), (str(self), self.tool_calls)


def answer_message(text):
    """The assistant message of the answer ``text`` (with its calls, a ``ToolCallAnswer``'s)."""
    calls = getattr(text, "tool_calls", None)
    return {"role": "assistant", "content": str(text), **({"tool_calls": calls} if calls else {})}


def render_human_assistant(messages):
    """DeepSpeed-Chat's prompt text; a system message is put as it is, without a speaker marker (after an earlier turn,
    in a paragraph of its own: not glued to that turn's text)."""
    pieces = []
    for message in messages:
        if message["role"] == "system":
            pieces.append(("\n\n" if pieces else "") + message["content"])
        else:
            pieces.append(f"\n\n{SPEAKER_BY_ROLE[message['role']]}: {message['content']}")
    return "".join(pieces) + ASSISTANT_PREFIX


def format_prompt(messages, tokenizer, tools=None):
    """The text the model sees before its answer; ends where generation starts. ``messages``: the conversation's
    {"role", "content"} messages, or a string, read as a record's string prompt is (``parse_transcript``: a
    "Human: ... Assistant:" transcript, or one user message); a string was read character by character ("string
    indices must be integers"). ``tools``: the record's tool schemas, for the chat template (``tools=``)."""
    if isinstance(messages, str):
        messages = parse_transcript(messages)
    if uses_chat_template(tokenizer):
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                             **tools_argument(tools))
    return render_human_assistant(messages)


def tools_argument(tools):
    """apply_chat_template's ``tools`` keyword for a record's tool schemas (none: no keyword, as before)."""
    return {"tools": list(tools)} if tools else {}


def format_answer(text, tokenizer, add_eot=True, eot_token=None, messages=None, prompt=None, tools=None):
    """The answer as it follows ``format_prompt(messages)`` (``prompt``, when the caller has it): " " + text + EOT;
    with a chat template, the template's rendering of the answer up to its EOT (``templated_answer``, given the
    prompt's ``messages``), else text + EOT. An answer calling tools (``ToolCallAnswer``) is the template's rendering
    of its turn: one the template does not write so is an error (``pipeline.check_answer_calls_rendered`` names the
    record first)."""
    eot = eot_token if eot_token is not None else get_eot_token(tokenizer)
    templated = templated_answer(messages, text, tokenizer, eot, prompt, tools) \
        if messages and uses_chat_template(tokenizer) else None
    if getattr(text, "tool_calls", None) and not templated:  # (its text alone is an empty turn, not the answer)
        raise UsageError(f"an answer calling the tool {text.tool_calls[0]['function']['name']!r} is written only by a "
                         "chat template that writes the call after the prompt, up to its EOT; the tokenizer's does "
                         "not")
    body = " " + text if not uses_chat_template(tokenizer) else templated or text
    return body + eot if add_eot else body


def templated_answer(messages, text, tokenizer, eot, prompt=None, tools=None):
    """What the chat template writes for the answer ``text`` after ``format_prompt(messages)`` (``prompt``), up to
    the first EOT after the text; None when it writes none there or renders the prompt otherwise."""
    from jinja2.exceptions import TemplateError

    prompt = prompt if prompt is not None else format_prompt(messages, tokenizer, tools)
    try:
        whole = tokenizer.apply_chat_template([*messages, answer_message(text)], tokenize=False,
                                              **tools_argument(tools))
    except (TemplateError, ValueError):
        return None
    if not whole.startswith(prompt):
        return None
    rest = whole[len(prompt):]
    at = rest.find(text)
    if at < 0:  # (templates that strip the answer: Llama-2's, Llama-3's, Gemma's)
        text = text.strip()
        at = rest.find(text)
    end = rest.find(eot, at + len(text)) if at >= 0 and eot else -1
    return rest[:end] if end >= 0 else None
