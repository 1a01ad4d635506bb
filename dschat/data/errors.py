"""Errors raised for bad input data."""
from dschat.errors import UsageError


class DatasetFormatError(UsageError):
    """A data file or record is malformed; the message names the file and the line or record."""


class RecordError(ValueError):
    """One record cannot be read; raised by adapters, located (file, record) by the caller.

    ``field`` names the offending field so hub datasets can count skips per field and local files can
    report ``FILE record N field 'x': ...``.
    """

    def __init__(self, field, message):
        super().__init__(f"field {field!r}: {message}")
        self.field = field
        self.detail = message


class SkipRecord(Exception):
    """A well-formed record that this step cannot use (e.g. tied preference scores); counted by ``reason``."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


class EndsWithUser(SkipRecord):
    """A conversation record whose last message is the user's: a prompt (step 3), no answer for steps 1 and 2
    (skipped and counted), except that step 1's ``--multiturn`` trains its assistant turns before it."""

    REASON = "no answer (the conversation ends with a user turn)"

    def __init__(self, messages):
        super().__init__(self.REASON)
        self.messages = messages


class UntrainedAnswer(SkipRecord):
    """A conversation record whose last assistant turn has weight 0 (OpenAI's fine-tuning format: a turn not trained):
    no answer for steps 1 and 2 (skipped and counted), except that step 1's ``--multiturn`` trains its assistant turns
    of weight 1 before it."""

    REASON = "no answer to train (the last assistant turn has weight 0)"

    def __init__(self, messages):
        super().__init__(self.REASON)
        self.messages = messages
