"""dschat.data.formatting: the prompt/answer text shared by the three steps."""
import copy

import pytest

from dschat.data import format_answer, format_prompt, get_eot_token, parse_transcript
from dschat.data.formatting import render_human_assistant, split_last_answer
from dschat.tiny import load_tiny_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

CONVERSATION = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Name a fruit."}]



@pytest.fixture(scope="module")
def chat_tokenizer():
    tok = copy.deepcopy(load_tiny_tokenizer())
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_eot_token_is_the_tokenizers_eos(tokenizer):
    assert get_eot_token(tokenizer) == tokenizer.eos_token == "<|endoftext|>"


def test_eot_token_requires_an_eos(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.eos_token = None
    with pytest.raises(ValueError, match="eos_token"):
        get_eot_token(tok)


def test_prompt_without_template_is_deepspeed_chat_format(tokenizer):
    assert format_prompt(CONVERSATION, tokenizer) == \
        "\n\nHuman: Hi there\n\nAssistant: Hello.\n\nHuman: Name a fruit.\n\nAssistant:"


def test_answer_without_template_has_leading_space_and_eot(tokenizer):
    assert format_answer("A pear.", tokenizer) == " A pear.<|endoftext|>"
    assert format_answer("A pear.", tokenizer, add_eot=False) == " A pear."
    assert format_answer("A pear.", tokenizer, eot_token="</s>") == " A pear.</s>"


def test_prompt_with_chat_template_uses_apply_chat_template(chat_tokenizer):
    expected = "<|user|>Hi there\n<|assistant|>Hello.\n<|user|>Name a fruit.\n<|assistant|>"
    assert format_prompt(CONVERSATION, chat_tokenizer) == expected
    assert format_answer("A pear.", chat_tokenizer) == "A pear.<|endoftext|>"  # no leading space


def test_an_answer_with_a_chat_template_is_written_as_the_template_writes_it_up_to_the_eot(chat_tokenizer):
    """Llama-2's template puts a space on either side of the answer: "[/INST] A pear. </s>". The answer was "A pear."
    right after "[/INST]", tokens the model never sees at inference after its own template's prompt."""
    llama2 = copy.deepcopy(chat_tokenizer)
    llama2.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                            "{% else %} {{ m['content'] }} {{ eos_token }}{% endif %}{% endfor %}")
    conversation = CONVERSATION
    assert format_prompt(conversation, llama2).endswith("[INST] Name a fruit. [/INST]")
    assert format_answer("A pear.", llama2, messages=conversation) == " A pear. <|endoftext|>"
    assert format_answer("A pear.", llama2, add_eot=False, messages=conversation) == " A pear. "
    stripping = copy.deepcopy(llama2)  # Llama-2's own template strips the answer: found all the same
    stripping.chat_template = llama2.chat_template.replace("{{ m['content'] }} {{ eos_token }}",
                                                           "{{ m['content'] | trim }} {{ eos_token }}")
    assert format_answer("A pear.\n", stripping, messages=conversation) == " A pear. <|endoftext|>"
    # no EOT after the answer in the template's rendering (Gemma's <end_of_turn> where the EOS is <eos>): as before
    assert format_answer("A pear.", chat_tokenizer, messages=conversation) == "A pear.<|endoftext|>"
    assert format_answer("A pear.", llama2, eot_token="</s>", messages=conversation) == "A pear.</s>"


def test_a_string_prompt_is_formatted_as_a_records_string_prompt_is(tokenizer, chat_tokenizer):
    """format_prompt("Name a fruit.", tokenizer), a notebook's natural call (DeepSpeed-Chat's prompts are strings),
    failed with "string indices must be integers": the string was read as its characters' messages."""
    transcript = "\n\nHuman: Hi there\n\nAssistant: Hello.\n\nHuman: Name a fruit.\n\nAssistant:"
    for tok in (tokenizer, chat_tokenizer):
        assert format_prompt(transcript, tok) == format_prompt(CONVERSATION, tok)
        assert format_prompt("Name a fruit.", tok) == format_prompt([{"role": "user", "content": "Name a fruit."}], tok)
    assert format_prompt(transcript, tokenizer) == transcript  # (DeepSpeed-Chat's prompt, as it was)


def test_parse_transcript_splits_turns_and_drops_trailing_assistant_marker():
    text = "\n\nHuman: What are cuss words?\n\nAssistant: Here: a list.\n\nHuman: And yours?\n\nAssistant:"
    assert parse_transcript(text) == [{"role": "user", "content": "What are cuss words?"},
                                      {"role": "assistant", "content": "Here: a list."},
                                      {"role": "user", "content": "And yours?"}]
    assert render_human_assistant(parse_transcript(text)) == text


def test_parse_transcript_inline_markers_and_merging():
    assert parse_transcript(" Human: hi there Assistant:") == [{"role": "user", "content": "hi there"}]
    assert parse_transcript("\n\nHuman: a\n\nHuman: b\n\nAssistant: c") == [
        {"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c"}]
    assert parse_transcript("no markers at all") == [{"role": "user", "content": "no markers at all"}]
    # "Human:" inside a turn is kept when turns are separated by blank lines
    assert parse_transcript("\n\nHuman: say Human: twice\n\nAssistant: ok")[0]["content"] == "say Human: twice"


def test_split_last_answer():
    prompt, answer = split_last_answer(CONVERSATION + [{"role": "assistant", "content": "Apple."}])
    assert prompt == CONVERSATION and answer == "Apple."
    assert split_last_answer(CONVERSATION) == (CONVERSATION, None)


def test_eot_flags_that_a_tokenizer_with_an_eos_ignores_print_a_warning(monkeypatch, capsys):
    # DeepSpeed-Chat appends --eot_token to every answer; dschat only adds it as the EOS of a tokenizer without one
    from dschat.models import loading

    monkeypatch.setattr(loading, "_WARNED_EOT", set(), raising=False)  # warned once per setting per process
    tok = loading.load_tokenizer("tiny-llama", add_eot_token=True, eot_token="<|im_end|>")
    out = capsys.readouterr().out
    assert get_eot_token(tok) == "<|endoftext|>" and "<|im_end|>" not in tok.get_vocab()
    assert out.count("warning:") == 1 and "--add_eot_token --eot_token '<|im_end|>' has no effect" in out
    assert "its own EOS token '<|endoftext|>'" in out
    loading.load_tokenizer("tiny-llama", add_eot_token=True, eot_token="<|im_end|>")  # step 3 loads it per model
    loading.load_tokenizer("tiny-llama", add_eot_token=True)  # the flag asks for the token the tokenizer has
    loading.load_tokenizer("tiny-llama")
    assert "warning:" not in capsys.readouterr().out


def test_a_system_message_after_a_turn_is_a_paragraph_of_its_own_without_a_chat_template():
    """It was glued to the turn before it: "Assistant: Hello.Now answer in French."."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "system", "content": "Now answer in French."}, {"role": "user", "content": "Bye?"}]
    assert render_human_assistant(messages) == ("\n\nHuman: Hi\n\nAssistant: Hello.\n\nNow answer in French."
                                                "\n\nHuman: Bye?\n\nAssistant:")
    assert render_human_assistant([{"role": "system", "content": "Be brief."}, messages[0]]) == \
        "Be brief.\n\nHuman: Hi\n\nAssistant:"  # first: as dschat writes a system preamble


def test_named_chat_templates_without_a_default_are_refused_at_load(tmp_path):
    """A tokenizer saved with named templates only (tool_use, rag) failed in apply_chat_template on every record as
    data was built; it is refused where it is loaded, naming the folder and its templates. With a "default" it is
    the one conversations are formatted with."""
    from dschat.errors import UsageError
    from dschat.models.loading import load_tokenizer

    tok = copy.deepcopy(load_tiny_tokenizer())
    tok.chat_template = {"tool_use": CHAT_TEMPLATE, "rag": CHAT_TEMPLATE}
    tok.save_pretrained(tmp_path / "named")
    with pytest.raises(UsageError, match=r"named.* has named chat templates \(rag, tool_use\) and none called "
                                         r"'default'"):
        load_tokenizer(str(tmp_path / "named"))
    tok.chat_template = {"default": CHAT_TEMPLATE, "tool_use": "unused"}
    tok.save_pretrained(tmp_path / "with_default")
    assert format_prompt(CONVERSATION, load_tokenizer(str(tmp_path / "with_default"))).endswith(
        "<|user|>Name a fruit.\n<|assistant|>")
