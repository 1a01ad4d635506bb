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
