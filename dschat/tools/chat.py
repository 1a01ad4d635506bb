"""Multi-turn chat with a trained policy, as DeepSpeed-Chat's inference/chatbot.py: messages typed or piped in
('clear' starts a new conversation, 'quit' or 'exit' ends it), or one answer to --prompt.

The conversation is kept as messages and rendered with ``format_prompt`` on every turn, so the model sees
the same text format it was trained on (its chat template, else "Human:/Assistant:").
"""
import sys

from dschat.data.formatting import HUMAN_PREFIX, uses_chat_template
from dschat.args import HintingParser, add_hidden_local_rank
from dschat.errors import UsageError
from dschat.models.positions import context_limit
from dschat.tools.common import (add_generation_args, add_loading_args, check_generation_flags,
                                 check_room_for_a_prompt, check_stdout_open, check_utf8, config_before_loading,
                                 empty_answer_note, find_policy_path, flag_path, generation_kwargs, load_policy,
                                 one_process, tool_prompt)
from dschat.tools.generation import encode_prompts, generate_answers_and_cuts
from dschat.tools.records import prompt_record

QUIT_COMMANDS = ("quit", "exit")
CLEAR_COMMAND = "clear"


def conversation_prompt(history, user_text, tokenizer, model="the model"):
    """(messages, prompt text) of the next turn: the history plus the new user message. Turns the chat template
    refuses (a --prompt transcript's system message, for Gemma's) are a UsageError naming ``model``."""
    messages = list(history) + [{"role": "user", "content": user_text}]
    return messages, tool_prompt(messages, tokenizer, model)


def without_oldest_exchange(history):
    """``history`` less its oldest user message and the answer to it; a system message before them stays."""
    first = next((i for i, message in enumerate(history) if message["role"] != "system"), len(history))
    return history[:first] + history[first + 2:]


def own_turn(answer, tokenizer):
    """The answer up to a "Human:" turn the model went on to write: without a chat template, a model that does not
    stop at its EOS continues with a made-up user message, as its "Human:/Assistant:" training text does, which shown
    and kept in the history would pass for the assistant's words. DeepSpeed-Chat's chatbot cuts its answers there
    too. With a chat template the answer is as generated."""
    if uses_chat_template(tokenizer):
        return answer
    # (the answer arrives stripped: one that is the made-up turn alone, "\n\nHuman: ...", starts with "Human:")
    return ("\n\n" + answer).split(HUMAN_PREFIX.rstrip(" "), 1)[0].strip()


class ChatSession:
    """One conversation with a model: ``ask`` answers a user message and remembers both turns."""

    def __init__(self, model, tokenizer, generation_kwargs):
        self.model, self.tokenizer = model, tokenizer
        self.generation_kwargs = generation_kwargs
        self.history = []
        self.forgotten = 0  # exchanges the last answered message's prompt left out (the context was full)
        self.cut = False  # whether the last answer reached --max_new_tokens before the model ended it

    def clear(self):
        self.history = []

    def ask_after(self, messages):
        """The answer to ``messages`` (a --prompt transcript's turns, ending with the user's), its earlier turns as the
        history."""
        self.history = list(messages[:-1])
        return self.ask(messages[-1]["content"])

    def ask(self, user_text):
        messages, prompt = self.next_prompt(user_text)
        (generated,), (unended,) = generate_answers_and_cuts(self.model, self.tokenizer, [prompt],
                                                             self.generation_kwargs)
        answer = own_turn(generated, self.tokenizer)
        # (one that went on to a made-up "Human:" turn had ended its own)
        self.cut = unended and answer == generated
        self.forgotten = (len(self.history) + 1 - len(messages)) // 2
        self.history = messages + [{"role": "assistant", "content": answer}]
        return answer

    def next_prompt(self, user_text):
        """The next prompt, forgetting the oldest exchanges while prompt + answer exceed the model's context
        (a long chat would otherwise crash generation past the last position). A message that does not fit even
        alone is a UsageError (the conversation goes on in interactive mode)."""
        check_utf8(user_text, "the message")
        limit = context_limit(self.model.config)
        room = limit - self.generation_kwargs["max_new_tokens"] if limit else None
        history = list(self.history)
        while True:
            messages, prompt = conversation_prompt(history, user_text, self.tokenizer,
                                                   getattr(self.model, "name_or_path", None) or "the model")
            length = len(encode_prompts(self.tokenizer, [prompt])[0])
            if room is None or length <= room:
                return messages, prompt
            if history == without_oldest_exchange(history):  # (nothing left to forget but a system message)
                raise UsageError(f"the message takes {length} tokens as a prompt; with --max_new_tokens "
                                 f"{self.generation_kwargs['max_new_tokens']} the model's context of {limit} tokens "
                                 f"leaves room for {max(room, 0)}")
            history = without_oldest_exchange(history)


def cut_note(session):
    return (f"(the answer reached --max_new_tokens {session.generation_kwargs['max_new_tokens']} before the model "
            "ended it: cut there)")


def forgotten_note(session):
    return (f"(the oldest {session.forgotten} exchange(s) no longer fit the model's context with --max_new_tokens "
            f"{session.generation_kwargs['max_new_tokens']}: left out from now on)")


def run_interactive(session, read=input, write=print, interrupt_stops_answer=False):
    """Read user messages until 'quit' or 'exit' (or end of input); 'clear' starts a new conversation. With
    ``interrupt_stops_answer`` (a terminal), Ctrl-C during an answer stops that answer alone, as chat CLIs do (it
    ended the chat); Ctrl-C at the prompt still quits. Piped input ends at it: no one is there to go on. Returns the
    line numbers (1 the first read) of the messages refused with "(not answered: ...)"."""
    quits = " or ".join(f"'{command}'" for command in QUIT_COMMANDS)
    write(f"Chat with the model. '{CLEAR_COMMAND}' starts a new conversation, {quits} ends the chat.")
    unanswered, line = [], 0
    while True:
        try:
            text = read("Human: ").strip()
        except (EOFError, KeyboardInterrupt):
            write("")
            return unanswered
        line += 1
        if text.lower() in QUIT_COMMANDS:
            return unanswered
        if text.lower() == CLEAR_COMMAND:
            session.clear()
            write("(new conversation)")
        elif text:
            try:
                answer = session.ask(text)
            except UsageError as error:
                write(f"(not answered: {error})")
                unanswered.append(line)
                continue
            except KeyboardInterrupt:
                if not interrupt_stops_answer:
                    raise
                # (ask keeps the history only once the answer is whole: the conversation is as before the message)
                write("(answer stopped: the message is left out of the conversation)")
                continue
            if session.forgotten:
                write(forgotten_note(session))
            write(f"Assistant: {answer}")
            if empty := empty_answer_note(answer, session.cut):  # (else "Assistant:" and nothing after it)
                write(f"({empty})")
            if session.cut:  # (an answer cut short read as the model's whole answer)
                write(cut_note(session))


def read_bytes_that_are_not_utf8_as_surrogates(*streams):
    """Each text stream (stdin, stdout) decoding (encoding) bytes that are not UTF-8 as lone surrogates, as Python's
    C/POSIX locale does: under a UTF-8 locale (en_US.UTF-8, PYTHONIOENCODING=utf-8) stdin is strict, and a Latin-1
    line raised UnicodeDecodeError in input(), a traceback that ended the chat, instead of ``check_utf8``'s message
    (and the echo of such a line failed to print). Before the first read: a stream cannot change it after."""
    for stream in streams:
        if hasattr(stream, "reconfigure"):  # (a TextIOWrapper: not a test's replacement)
            stream.reconfigure(errors="surrogateescape")


def read_past_a_byte_order_mark(stream):
    """``stream`` (stdin, UTF-8) decoding a byte-order mark at its start as nothing (utf-8-sig; one later on stays): a
    file saved with one (Notepad, PowerShell's redirection) kept it in the first message, so a first line 'quit' did
    not quit and the model saw the mark. Before the first read, keeping the stream's errors handler."""
    import codecs

    encoding = getattr(stream, "encoding", None)
    if hasattr(stream, "reconfigure") and encoding and codecs.lookup(encoding).name == "utf-8":
        stream.reconfigure(encoding="utf-8-sig", errors=stream.errors)


def echoing_input(prompt):
    """``input`` for piped stdin: echo the message so the printed transcript shows both sides."""
    text = input(prompt)
    print(text)
    return text


def build_parser():
    # (--help's description: the docstring's first paragraph, which says how to chat)
    parser = HintingParser(allow_abbrev=False, description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--path", required=True,
                        help="A run's output folder (uses the policy its last train.py run reported, else "
                             "step3_ppo/actor, step2_dpo, step1_sft; an unfinished run's step1_sft first), a model "
                             "folder, a hub name or a tiny preset.")
    parser.add_argument("--prompt", default=None,
                        help="Answer this one message (or the last of a 'Human: ... Assistant: ... Human: ...' "
                             "transcript, as prompt_eval and rw_eval read it), print the answer and exit.")
    add_loading_args(parser)
    add_generation_args(parser, sample_by_default=True)
    add_hidden_local_rank(parser)
    return parser


def check_prompt_fits(turns, path, config, args):
    """``turns`` (--prompt's) formatted with the tokenizer of ``path`` before its model loads, as prompt_eval formats
    its prompts: turns its chat template refuses, and a last message too long for the context of ``config`` (None:
    not readable alone) with --max_new_tokens even once the earlier turns are left out (``ChatSession.next_prompt``),
    are said at once, not once the model has loaded."""
    from types import SimpleNamespace

    from dschat.models.loading import load_tokenizer

    tokenizer = load_tokenizer(path, add_eot_token=args.add_eot_token)
    tool_prompt(turns, tokenizer, path)
    if config is None:
        return
    session = ChatSession(SimpleNamespace(config=config, name_or_path=path), tokenizer,
                          {"max_new_tokens": args.max_new_tokens})
    session.history = list(turns[:-1])
    try:
        session.next_prompt(turns[-1]["content"])
    except UsageError as error:
        raise UsageError(f"--prompt: {error}") from None


def check_piped_messages_answered(lines):
    """Piped messages refused (``lines``, said as "(not answered: ...)" as the chat went on) are a UsageError once the
    input ends (exit status 2, as --prompt's): the run ended with status 0, so a script could not tell that some went
    unanswered. At a terminal the person saw it and went on: not called."""
    if not lines:
        return
    numbers = ", ".join(map(str, lines))
    raise UsageError(f"standard input line{'s' if len(lines) > 1 else ''} {numbers}: not answered (said above as "
                     "\"(not answered: ...)\"; the chat went on with the other messages)")


@one_process
def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.prompt is not None and not args.prompt.strip():
        parser.error("--prompt: the message is empty")
    if args.prompt is not None:  # (before the model loads: its text, a transcript's turns as prompt_eval reads them)
        turns = prompt_record(args.prompt, "--prompt").messages
    elif sys.stdin is None:  # (started with stdin closed, `<&-`: an AttributeError once the model had loaded)
        parser.error("no standard input to read messages from (it is closed): give --prompt, or pipe the messages")
    check_stdout_open("the answers")
    check_generation_flags(args)  # (before the model loads)
    path = flag_path("--path", find_policy_path, args.path)
    config = config_before_loading(path)
    check_room_for_a_prompt(config, args.max_new_tokens)
    if args.prompt is not None:  # turns its chat template refuses (a transcript's system turn, for Gemma's), too long
        check_prompt_fits(turns, path, config, args)
    model, tokenizer = load_policy(path, dtype=args.dtype, add_eot_token=args.add_eot_token)
    check_room_for_a_prompt(model.config, args.max_new_tokens)  # (a config transformers could not read alone)
    session = ChatSession(model, tokenizer, generation_kwargs(args))
    print(f"[chat] model: {path} on {model.device}", file=sys.stderr)  # (stdout: the answers alone)
    if args.prompt is not None:
        try:
            answer = session.ask_after(turns)
        except UsageError as error:  # (a message too long for the context: the flag that gave it, named)
            raise UsageError(f"--prompt: {error}") from None
        if session.forgotten:  # (a transcript too long for the context: said on stderr, the answer alone on stdout)
            print(forgotten_note(session), file=sys.stderr)
        print(answer)
        if empty := empty_answer_note(answer, session.cut):  # (stderr: stdout holds the answer alone, an empty line)
            print(f"({empty})", file=sys.stderr)
        if session.cut:  # (stderr: stdout holds the answer alone)
            print(cut_note(session), file=sys.stderr)
        return 0
    read_past_a_byte_order_mark(sys.stdin)
    read_bytes_that_are_not_utf8_as_surrogates(sys.stdin, sys.stdout)
    terminal = sys.stdin.isatty()
    unanswered = run_interactive(session, read=input if terminal else echoing_input, interrupt_stops_answer=terminal)
    if not terminal:
        check_piped_messages_answered(unanswered)
    return 0


if __name__ == "__main__":  # python -m dschat.tools.chat, as the script that calls it
    from dschat.utils.cli import run_script

    run_script(main)
