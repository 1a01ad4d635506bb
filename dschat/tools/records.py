"""Prompts (and answers) for the tools: from the command line, from a local file, or the tiny held-out data."""
from dataclasses import dataclass
from itertools import islice

from dschat.data.formatting import parse_transcript
from dschat.errors import MissingInputError
from dschat.tiny import EVAL_FILE


@dataclass
class Record:
    messages: list          # prompt turns, ending with the user's
    chosen: str | None = None
    rejected: str | None = None

    @property
    def user_message(self):
        """The last user turn: what the tiny rule scorer reads the instruction from."""
        return self.messages[-1]["content"]


def prompt_record(text):
    """A command-line prompt: a plain user message or a "Human: ... Assistant: ... Human: ..." transcript."""
    return Record(parse_transcript(text))


def load_records(path, data_fields=None, limit=None):
    """Every record of a local data file, read by the training data's own adapter.

    So a file is accepted here exactly when training accepts it (prompt/chosen/rejected strings, message
    lists, transcripts, TRL's preference format, renamed fields), and is read whole: no train/eval split.
    """
    from dschat.data.local import LocalDataset, parse_field_map, resolve_local_spec

    source = resolve_local_spec(str(path))
    if source is None:
        raise MissingInputError(f"no data file at {path}")
    raw = LocalDataset(source, output_path=None, seed=0, local_rank=-1, field_options=parse_field_map(data_fields))
    splits = [raw.raw_datasets[name] for name in ("train", "eval") if raw.raw_datasets[name] is not None]
    samples = islice((sample for split in splits for sample in split), limit)
    return [Record(raw.get_conversation(s), raw.get_chosen_text(s), raw.get_rejected_text(s)) for s in samples]


def tiny_held_out_records(limit=None):
    """The embedded data's held-out records (never trained on by any step)."""
    return load_records(EVAL_FILE, limit=limit)
