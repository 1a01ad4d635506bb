"""Training on every assistant turn of a conversation (step 1's ``--multiturn``, OpenRLHF's flag of that name).

By default a ``messages`` record trains on its last assistant turn, and the earlier turns are prompt. With
``--multiturn`` the earlier assistant turns get labels too. Each is found in the rendered prompt right where the
conversation before it, rendered as a prompt (``format_prompt``), ends: that is the text the model answers from at
that turn, so the turn is trained exactly as if it were the answer. The end token the template writes after a turn
(ChatML's ``<|im_end|>``, Llama-3's ``<|eot_id|>``) is trained with it when it is the EOT token, so the model learns
to stop there; DeepSpeed-Chat's Human/Assistant text writes none between turns.

A conversation ending with a user turn (a ShareGPT dump cut after a question) has no answer to train by default;
with ``--multiturn`` its assistant turns before that turn are trained, as TRL's and OpenRLHF's assistant-only losses
train them, and the data report counts such conversations.

An assistant turn of weight 0 (OpenAI's chat fine-tuning format: ``"weight": 0``) is not trained: it stays prompt, and
a conversation whose last turn has it is trained up to its last turn of weight 1.

A template that renders earlier turns otherwise than a prompt ending at them (one dropping an earlier turn's
reasoning, say) leaves that turn in the prompt; the data report counts those turns.

An assistant turn that calls tools (``tool_calls``) is trained as TRL's assistant-only loss trains it: from where the
prompt before it ends through the template's EOT after it (its text, if any, and the calls as the template writes
them), when every call's function name is there; a conversation ending with a call has it as its answer
(``ToolCallAnswer``). Tool results (role "tool") are never trained: they stay prompt.
"""
from bisect import bisect_left, bisect_right

from dschat.errors import UsageError
from .base import final_assistant_answer, prompt_messages
from .errors import RecordError
from .formatting import format_prompt


def check_offsets_available(tokenizer):
    if not getattr(tokenizer, "is_fast", False):
        raise UsageError("--multiturn needs a fast tokenizer (it maps each assistant turn's text to its tokens "
                         f"through offsets), and {type(tokenizer).__name__} is not one")


def answered_turns(skip, untrained=frozenset()):
    """(prompt turns, answer) of the conversation ``skip`` (an EndsWithUser, or an UntrainedAnswer: its last turn has
    weight 0) holds, up to its last assistant turn to train (not one of the positions ``untrained``); the skip itself
    when it has none."""
    messages = skip.messages
    last = max((i for i, message in enumerate(messages) if message["role"] == "assistant" and i not in untrained),
               default=None)
    if last is None or not any(message["role"] == "user" for message in messages[:last]):
        raise skip
    prompt, answer = final_assistant_answer(messages[:last + 1], "messages")
    if prompt[-1]["role"] == "assistant":
        raise RecordError("messages", "two assistant messages in a row; each answer must follow a user message")
    return prompt_messages(prompt, "messages"), answer


def earlier_answer_spans(messages_list, prompt_texts, offsets, tokenizer, eot_token, untrained_list=None,
                         tools_list=None):
    """Per conversation, ``([start, end, start, end, ...] token spans of its earlier assistant turns in the prompt
    ids, how many turns were not found)``; ``offsets``: each prompt token's (start, end) characters;
    ``untrained_list``: per conversation, the positions of its turns not to train (weight 0); ``tools_list``: per
    conversation, its tool schemas (rendered by the template)."""
    result = []
    count = len(messages_list)
    for messages, text, token_offsets, untrained, tools in zip(messages_list, prompt_texts, offsets,
                                                               untrained_list or [frozenset()] * count,
                                                               tools_list or [None] * count):
        spans, missed = answer_char_spans(messages, text, tokenizer, eot_token, untrained, tools)
        result.append((token_spans(spans, token_offsets), missed))
    return result


def answer_char_spans(messages, prompt_text, tokenizer, eot_token, untrained=frozenset(), tools=None):
    """(character spans [start, end) of the assistant turns of ``messages`` in ``prompt_text``, but those at the
    positions ``untrained`` (weight 0: they stay prompt), how many were not found there)."""
    spans, missed = [], 0
    for index, message in enumerate(messages):
        if message["role"] == "assistant" and index not in untrained:
            if message.get("tool_calls"):
                span = call_turn_span(messages[:index], message, prompt_text, tokenizer, eot_token, tools)
            else:
                span = turn_span(messages[:index], message["content"], prompt_text, tokenizer, eot_token, tools)
            if span is None:
                missed += 1
            else:
                spans.append(span)
    return spans, missed


def turn_span(before, content, prompt_text, tokenizer, eot_token, tools=None):
    """Where ``content`` follows the rendering of ``before`` in ``prompt_text`` (from the end of that rendering,
    through the content and an EOT after it), or None."""
    prefix = rendered_prefix(before, prompt_text, tokenizer, tools)
    if prefix is None or not content:
        return None
    body = _after_whitespace(prompt_text, len(prefix))
    if not prompt_text.startswith(content, body):
        return None
    end = body + len(content)
    after = _after_whitespace(prompt_text, end)
    if eot_token and prompt_text.startswith(eot_token, after):
        end = after + len(eot_token)
    return len(prefix), end


def call_turn_span(before, message, prompt_text, tokenizer, eot_token, tools=None):
    """Where an assistant turn calling tools is in ``prompt_text``: from the end of the rendering of ``before``
    through the first EOT after it, when every call's function name is in between; else None."""
    prefix = rendered_prefix(before, prompt_text, tokenizer, tools)
    if prefix is None or not eot_token:
        return None
    end = prompt_text.find(eot_token, len(prefix))
    if end < 0:
        return None
    body = prompt_text[len(prefix):end]
    if message["content"] and message["content"] not in body or any(
            call["function"]["name"] not in body for call in message["tool_calls"]):
        return None
    return len(prefix), end + len(eot_token)


def rendered_prefix(before, prompt_text, tokenizer, tools=None):
    """``format_prompt(before)`` where ``prompt_text`` begins with it, else None."""
    from jinja2.exceptions import TemplateError

    try:
        prefix = format_prompt(before, tokenizer, tools)
    except (TemplateError, ValueError):  # a template that refuses a conversation opening with the assistant; an empty
        return None  # conversation (transformers' "Cannot apply chat template to an empty conversation")
    return prefix if prompt_text.startswith(prefix) else None


def _after_whitespace(text, position):
    while position < len(text) and text[position].isspace():
        position += 1
    return position


def token_spans(char_spans, offsets):
    """Flattened [start, end) token spans of the tokens that overlap each character span (a (0, 0) token, one added
    before the text, overlaps none)."""
    starts = [start for start, _ in offsets]
    ends = [end for _, end in offsets]
    flat = []
    for start, end in char_spans:
        first, last = bisect_right(ends, start), bisect_left(starts, end)
        if first < last:
            flat += [first, last]
    return flat
