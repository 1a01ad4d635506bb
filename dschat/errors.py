"""The error for what the user gave: a flag, a combination of flags, a file or a record.

Entry points print its message (which names the flag, file or record) and exit with status 2 instead of a
traceback through DeepSpeed, datasets and the step code (``dschat.utils.cli.run_entry_point``). It is a
ValueError, so library callers that catch ValueError keep working."""


class UsageError(ValueError):
    """Bad user input; the message says which input and what to do instead."""


class MissingInputError(UsageError, FileNotFoundError):
    """A file or folder the user named (or an earlier step should have written) is not there."""


class MissingModuleError(UsageError, ModuleNotFoundError):
    """A module the user named (e.g. ``--reward_fn module:function``) cannot be found."""


def given_as(flag, value):
    """``value`` as an error names it: after the flag it was given with (``--data_path x.jsonl``), where one is
    known."""
    return f"{flag} {value}" if flag else str(value)


def excerpt(value, limit=120):
    """``value`` (a record's text: a prompt, an answer, a message) quoted for an error message: its repr when that
    is at most ``limit`` characters, else the repr of its first and last ``limit // 2`` characters around how long
    it is (a prompt of thousands of characters buried the message's point; its end, the last user turn of a
    formatted prompt, tells it from others that share a system prompt). Not text: the same of its repr."""
    whole = repr(value)
    if len(whole) <= limit:
        return whole
    text, quote = (value, repr) if isinstance(value, str) else (whole, str)
    half = limit // 2
    return f"{quote(text[:half])} ... ({len(text):,} characters in all) ... {quote(text[-half:])}"
