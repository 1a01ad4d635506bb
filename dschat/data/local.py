"""Local data files as a ``PromptRawDataset`` (``LocalDataset``) and the helpers that read its records' values;
``dschat.data.sources`` says the spec forms (one string per dataset in ``--data_path``).


Without an eval file or split, the train data is split 90/10 with the seed (DeepSpeed-Chat's rule for
hub datasets that have no eval split), and the indices are cached under ``output_path``.

Record shapes (field names changeable with ``field_options``, e.g. from ``--data_fields
prompt=question,chosen=good``, or one mapping per dataset: ``parse_data_fields``):

* ``prompt`` + ``chosen`` [+ ``rejected``]: strings. ``prompt`` is the user message; a prompt that starts
  with "Human:" is read as a "Human:/Assistant:" transcript; ``prompt`` may also be a list of messages.
  Without a ``chosen`` field the data is prompt-only (step 3 only). A null ``rejected`` marks an SFT-only
  record (skipped, and counted, in step 2). TRL's ``completion`` is the ``chosen`` answer; a ``label`` column
  beside it (TRL's unpaired preference records, KTO's) marks the answers not to imitate, which steps 1 and 2 skip.
* ``messages``: a list of {role, content} ending with the assistant answer (SFT data; ShareGPT's
  ``conversations`` of {from, value} too, LLaMA-Factory's "function_call" and "observation" turns as tool calls and
  results; step 3's prompt is the turns before that answer, which its reward functions get as ``chosen``); one
  ending with a user turn is a prompt (step 3), skipped and counted by
  steps 1 and 2 (step 1's ``--multiturn`` trains its assistant turns before it). An assistant message's ``weight``
  (OpenAI's chat fine-tuning format) is 0 or 1: a turn of weight 0 is not trained (``--multiturn`` leaves it prompt;
  one that is the last turn makes the record a counted skip without ``--multiturn``). Tool calling (TRL's SFT data):
  an assistant message's ``tool_calls``, a tool's result as a message of role ``tool`` (or ``ipython``), the record's
  tool schemas in a ``tools`` column (``--data_fields tools=NAME``; OpenAI's older ``function_call``, role
  ``function`` and ``functions`` column read as these), rendered by the chat template
  (``apply_chat_template(tools=...)``; a template that leaves them out, or none, is the record's error when it is
  encoded); the answer follows the tool's result, or is the call itself where the conversation ends with one
  (function-calling data), and a prompt may end with a tool's result.
* ``chosen`` + ``rejected`` as message lists and no ``prompt`` (TRL's preference format), or as whole
  "\\n\\nHuman: ...\\n\\nAssistant: ..." transcripts (Anthropic/hh-rlhf's files): the turns before the last are
  the prompt and must be the same in both; the last (assistant) turns are the answers. Plain strings are TRL's
  implicit prompt: the words both begin with are the prompt ("The sky is" of "The sky is blue." and "... green.").
  ``chosen``/``rejected`` may be message lists next to a ``prompt`` too (TRL's explicit-prompt format).
* Alpaca's ``instruction`` [+ ``input``, ``history``] + ``output`` (LLaMA-Factory's default format; ``chosen`` and
  ``rejected`` for pairs): read as prompt records, the input joined after the instruction, the history's pairs the
  turns before (``LocalDataset._read_alpaca_columns``); under ``--data_fields`` naming the prompt, an input and
  history only where it names them (``input=NAME``, ``history=NAME``).

A ``system`` column (LLaMA-Factory's; ``--data_fields system=NAME``) is the conversation's first message, its system
prompt, beside any of these shapes; under ``--data_fields`` naming the record fields, only where it names it
(``LocalDataset._system_column``).

CSV cells are read as text ("5" stays "5"; an empty cell is null; a Windows file's "\\r\\n" line ends in a cell as
"\\n"), the header's names without the spaces around them; JSON values are kept as written, also in a column whose
type differs between records or whose objects write their keys in another order in another record (``_as_written``;
parquet and save_to_disk data hold one key order per column, the one they were written with). Every other column is
passed through ``get_extra``. Records are checked when the file is loaded: a malformed JSON line raises
``DatasetFormatError("FILE line N: ...")``; a missing/null/empty/wrongly typed field raises one naming the file, the
record (and its line where known: JSON Lines, CSV) and the field.
"""
import ast
import contextlib
import copy
import json
import os
import re

from dschat.errors import excerpt
from .base import (MARGIN_FIELD, PromptRawDataset, ROLE_ALIASES, SHAREGPT_ROLES, TOOL_ROLES, VALID_ROLES,
                   answer_from_transcript, checked_messages, final_assistant_answer, optional_text, prompt_messages,
                   required_text, trimmed, untrained_turns, without_none_values)
from .digests import _memo_bucket_lock
from .errors import DatasetFormatError, EndsWithUser, RecordError, SkipRecord, UntrainedAnswer
from .fields import (ALPACA_INSTRUCTION, ALPACA_OUTPUT, FIELD_NAMES, KTO_TAG, LABEL_FIELD, OPENAI_FUNCTIONS,
                     PROMPT_PARTS, SYSTEM_FIELD, TOOLS_FIELD, _are_messages, _is_one_message, checked_field_options,
                     renamable_fields)
from .formatting import parse_transcript, with_lf_line_ends
from .reading import (_hashes_shared, _keep_passed_check, _lists_of_objects, _records_check_memo, _split_digests,
                      keeps_nulls, load_saved_dataset, load_split_files, record_where)


_TRANSCRIPT_TURN = re.compile(r"(?:\A|\s)Assistant:")
_PROMPT_AFTER_PREAMBLE = re.compile(r"\n\nHuman: ")


class LocalDataset(PromptRawDataset):
    """A ``PromptRawDataset`` over local files; records are validated when loaded (``strict``)."""
    strict = True

    def __init__(self, source, output_path, seed, local_rank, field_options=None):
        self.source = source
        self.fields = {name: name for name in renamable_fields()}
        self.renamed = checked_field_options(field_options or {})
        self.fields.update(self.renamed)
        self.margin_field = self.fields[MARGIN_FIELD]
        # (a CSV cell holds one message as its JSON text; a JSON or parquet file's text is text: ``_json_list_text``)
        self.csv_cells = "csv" in {source.kind, source.eval_type}
        self._name_as(source)
        super().__init__(output_path, seed, local_rank, dataset_name=source.spec, raw_datasets=None)

    def _name_as(self, source):
        self.dataset_name, self.dataset_name_clean = source.spec, "tiny" if source.spec == "tiny" else source.name_clean

    def spelled_as(self, source):
        """This reader as one made for ``source``, another spelling of the same files (``./a.jsonl``,
        ``jsonl:a.jsonl``, its absolute path: ``get_raw_dataset``'s kept reads): the records read, its name and the
        paths its errors give ``source``'s."""
        if source == self.source:
            return self
        reader = copy.copy(self)
        reader.source = source
        reader._name_as(source)
        return reader

    @property
    def eval_split(self):
        """Its eval file's (or save_to_disk split's), read as the split "eval"; None where it has none."""
        return None if self.raw_datasets["eval"] is None else "eval"

    @property
    def renames_record_fields(self):
        """Whether --data_fields renames a field of the records' shape (a tools=, label= or system= column alone kept
        ShareGPT's conversations from being read: "no 'prompt', 'messages' or 'chosen' field")."""
        return bool(set(self.renamed) & set(FIELD_NAMES))

    def load(self):
        self.keeps_nulls = keeps_nulls(self.source)
        # (the files' hashes as they are loaded: what their records' pass is kept by, ``_validate_unless_passed``)
        train_digests = _split_digests(self.source.kind, self.source.train_files)
        eval_digests = _split_digests(self.source.eval_type, self.source.eval_files)
        train, eval_data = self._load_splits()
        self._read_alpaca_columns(train.column_names)
        self._read_pairwise_conversations(train)
        if "chosen" not in self.renamed and "chosen" not in train.column_names and "completion" in train.column_names:
            self.fields["chosen"] = "completion"  # TRL's prompt-completion records: the completion is the answer
        self.label_field = self._label_column(train)
        if "conversations" in train.column_names and not self.renames_record_fields and not any(
                self.fields[name] in train.column_names for name in FIELD_NAMES):  # (a --data_fields typo stays one)
            self.fields["messages"] = "conversations"  # ShareGPT's own name for its from/value messages
        self._read_older_functions_column(train)
        self.shape = self._record_shape(train, self.source.train_where)
        self._check_renamed_columns_beside(train.column_names, self.source.train_where)
        self.system_field = self._system_column(train.column_names)
        self.used_columns = tuple(self.fields[name] for name in self._shape_fields()) + \
            ((self.system_field,) if self.system_field else ()) + \
            tuple(name for name in (self.input_field, self.history_field) if name and self.shape == "prompt")
        # (the system prompt, Alpaca's input and history: the prompt's, and columns too)
        self.reward_columns = tuple(name for name in (self.system_field, self.input_field, self.history_field) if name)
        self.alpaca_output = "chosen" not in self.renamed and self.fields["chosen"] == ALPACA_OUTPUT and \
            self.fields["rejected"] not in train.column_names
        if self.alpaca_output:  # (the reward functions' column under its own name: ``get_reference_answers``)
            self.reward_columns += (ALPACA_OUTPUT,)
        self.has_answers = self.shape != "prompt" or self.fields["chosen"] in train.column_names
        self.has_rejected = self.shape != "messages" and self.fields["rejected"] in train.column_names
        self._validate_unless_passed(train, self.source.kind, self.source.train_files, train_digests,
                                     self.source.train, self._train_lines)
        if eval_data is not None:
            eval_where = self.source.eval_where or self.source.train_where
            if self._record_shape(eval_data, eval_where) != self.shape:
                raise DatasetFormatError(f"{eval_where}: the eval records have different fields from the train "
                                         f"records ({eval_data.column_names} vs {train.column_names})")
            self._check_renamed_columns_beside(eval_data.column_names, eval_where)
            self._check_renamed_prompt_parts(eval_data.column_names, eval_where)
            self._validate_unless_passed(eval_data, self.source.eval_type, self.source.eval_files, eval_digests,
                                         self.source.eval or f"{self.source.train} (eval split)", self._eval_lines)
        return {"train": train, "eval": eval_data}

    def _system_column(self, columns):
        """The column read as each record's system prompt, else None: the one ``system=NAME`` names, or a "system"
        column (LLaMA-Factory's) where --data_fields names none of the record fields. A mapping that names them decides,
        as LLaMA-Factory's "columns" do (their system is None unless named): a "system" column beside it is an extra
        column unless it names it (one of something else, the system that wrote an answer, was put before every
        prompt)."""
        if SYSTEM_FIELD not in self.renamed and self.renames_record_fields:
            return None
        return self.fields[SYSTEM_FIELD] if self.fields[SYSTEM_FIELD] in columns else None

    def _check_renamed_columns_beside(self, columns, where):
        """A system=, tools= or margin= of --data_fields naming a column the train or eval file lacks is an error (a typo:
        the system prompt, the tool schemas or the margins went unread, without a word, where a misspelt prompt=, input=
        or label= is said), in
        a file the mapping is of: one that has a record field it renames, or any file where it renames none. A file of
        another shape under the same mapping (messages data beside renamed prompts) is read as before."""
        renamed_fields = [self.fields[name] for name in FIELD_NAMES if name in self.renamed]
        if renamed_fields and not any(field in columns for field in renamed_fields):
            return
        self._check_renamed((SYSTEM_FIELD, TOOLS_FIELD, MARGIN_FIELD), columns, where)

    def _read_older_functions_column(self, train):
        """OpenAI's older function-calling records name their tool schemas ``functions`` (each a bare function schema
        {"name", "description", "parameters"}, as LLaMA-Factory's tools are): read as the tools column where the records
        have none (it was an extra column, and the model trained to call functions it was not shown). Not where its
        first value given is something else (``_are_function_schemas``): a "functions" column of a code dataset's
        function names, say, is an extra column, as it was; read as the tools, it stopped the file."""
        columns = train.column_names
        if TOOLS_FIELD in self.renamed or self.fields[TOOLS_FIELD] in columns or OPENAI_FUNCTIONS not in columns:
            return
        first = next((value for value in train[:100][OPENAI_FUNCTIONS] if value), None)
        if first is None or _are_function_schemas(first):  # (none in the first records: later ones may hold some)
            self.fields[TOOLS_FIELD] = OPENAI_FUNCTIONS

    def _read_pairwise_conversations(self, train):
        """LLaMA-Factory's pairwise records (its ShareGPT conversations, or messages, ending with the user's turn, then
        chosen and rejected each one message, {"from": "gpt", "value": ...}) read without --data_fields: the
        conversation is the prompt (TRL's explicit-prompt format), the two messages the answers. They were "field
        'chosen': expected a non-empty list of messages, got dict". (Told by a chosen value that is one message: a
        messages column beside chosen and rejected lists is not read, as before.)"""
        columns = train.column_names
        if self.renames_record_fields or self.fields["prompt"] in columns or \
                not all(self.fields[name] in columns for name in ("chosen", "rejected")):
            return
        conversation = next((name for name in ("conversations", self.fields["messages"]) if name in columns), None)
        first = next((value for value in train[:100][self.fields["chosen"]] if value is not None), None)
        if conversation and (_is_one_message(first) or self.csv_cells and _message_of_json_text(first) is not None):
            self.fields["prompt"] = conversation

    def _read_alpaca_columns(self, columns):
        """Alpaca's records (LLaMA-Factory's default format: instruction, input, output, and system, history; chosen
        and rejected for preference data) are read without --data_fields: the instruction is the prompt, with its input
        (where given) after it on a line of its own, as LLaMA-Factory joins them, after the turns of its history
        ([instruction, answer] pairs), and the output is the answer. They were "no 'prompt' field".

        An explicit --data_fields mapping of the record's fields decides what is read, as LLaMA-Factory's "columns"
        do: an input and a history column are the prompt's only where it names them (``input=NAME``, ``history=NAME``;
        they may be named beside any prompt column). An input or history column of something else beside
        ``prompt=instruction`` stopped the file with an Alpaca-format error."""
        answered = ALPACA_OUTPUT in columns or self.fields["chosen"] in columns  # (dolly's instruction, context and
        # response are not Alpaca's: its context would be left out)
        if not self.renames_record_fields and ALPACA_INSTRUCTION in columns and answered and \
                not any(self.fields[name] in columns for name in ("prompt", "messages")):
            self.fields["prompt"] = ALPACA_INSTRUCTION
            if ALPACA_OUTPUT in columns and self.fields["chosen"] not in columns:
                self.fields["chosen"] = ALPACA_OUTPUT
        self.alpaca_detected = not self.renames_record_fields and self.fields["prompt"] == ALPACA_INSTRUCTION
        self._check_renamed_prompt_parts(columns, self.source.train_where)
        self.input_field, self.history_field = (self.fields[name] if name in self.renamed or self.alpaca_detected and
                                                self.fields[name] in columns else None for name in PROMPT_PARTS)

    def _alpaca_hint(self, field):
        """Said of an input or history column read as Alpaca's without --data_fields: how to read it as a column."""
        if not self.alpaca_detected or field in {self.renamed.get(name) for name in PROMPT_PARTS}:
            return ""
        return (f" (read so beside Alpaca's {ALPACA_INSTRUCTION!r}; a {field!r} column of something else is an extra "
                f"column under --data_fields prompt={ALPACA_INSTRUCTION},chosen={self.fields['chosen']}, which reads "
                "only the columns it names)")

    def _label_column(self, train):
        """The column of TRL's unpaired preference labels (KTO's prompt/completion/label records), else None: the one
        ``--data_fields label=NAME`` names, or a "label" column that reads as labels (every value one, or any a
        true/false or a float column's 1.0/0.0: a typo among them is then its record's error) beside TRL's completion
        or a renamed chosen, with no rejected; a category column beside a plain chosen stays data. A renamed label a
        file lacks is an error only where its columns hold true/false (an SFT file in the mix has no labels). A
        "kto_tag" column (LLaMA-Factory's KTO records, ShareGPT's conversations beside it) is the labels: it was an
        extra column, and the answers tagged false were trained on."""
        name, renamed, columns = self.fields[LABEL_FIELD], LABEL_FIELD in self.renamed, train.column_names
        if not renamed and name not in columns and KTO_TAG in columns:
            name, renamed = KTO_TAG, True  # (LLaMA-Factory's KTO records: their labels, whatever their answers' field)
        if name not in columns:
            if renamed and any(_says_true_or_false(values) for values in train[:100].values()):
                self._check_renamed((LABEL_FIELD,), columns, self.source.train_where)
            return None
        if renamed:
            return name
        answer_is_kto_like = self.fields["chosen"] == "completion" or "chosen" in self.renamed
        values = [value for value in train[name] if value is not None]
        labels = values and (all(_label_value(v) is not None for v in values) or _says_true_or_false(values))
        return name if answer_is_kto_like and self.fields["rejected"] not in columns and labels else None

    def _load_splits(self):
        self._train_lines = self._eval_lines = None
        if self.source.kind == "disk":
            if self.source.eval:
                return load_saved_dataset(self.source.train)[0], load_saved_dataset(self.source.eval)[0]
            return load_saved_dataset(self.source.train)
        train, self._train_lines = load_split_files(self.source.kind, self.source.train_files)
        if not self.source.eval:
            return train, None
        eval_data, self._eval_lines = load_split_files(self.source.eval_type, self.source.eval_files)
        if self.source.unread_evals:
            from dschat.utils.dist import print_rank_0

            print_rank_0(f"[dschat.data] {self.source.spec}: evaluating on {os.path.basename(self.source.eval)}; "
                         f"{' and '.join(self.source.unread_evals)} not read")
        return train, eval_data

    def get_train_data(self):
        if self.raw_datasets["eval"] is None:
            return self.seeded_train_eval_part(self.raw_datasets["train"], 0)
        return self.raw_datasets["train"]

    def get_eval_data(self):
        if self.raw_datasets["eval"] is None:
            return self.seeded_train_eval_part(self.raw_datasets["train"], 1)
        return self.raw_datasets["eval"]

    # --- record shapes ---
    def _record_shape(self, data, where):
        columns = data.column_names
        self._check_records_not_in_a_list(data, where)
        preference = self.fields["chosen"] in columns and self.fields["rejected"] in columns
        named_prompt = "prompt" in self.renamed and "messages" not in self.renamed and self.fields["prompt"] in columns
        if self.fields["messages"] in columns and not preference and not named_prompt:
            # the other fields are not read from messages records: a prompt column beside them (ultrachat's,
            # no_robots') is their first turn; preference records that also carry the chosen conversation as messages
            # (ultrafeedback_binarized's columns) read as preference pairs, and a prompt field named by --data_fields
            # as prompt records
            return "messages"
        if self.fields["prompt"] in columns:
            # Prompt-only (step 3) and SFT-only files legitimately lack the answer columns, under one --data_fields
            # for every file; only a rejected answer with no chosen one is a certain typo.
            if self.fields["rejected"] in columns:
                self._check_renamed(("chosen",), columns, where)
            return "prompt"
        self._check_renamed(("prompt",), columns, where)
        if self.fields["chosen"] in columns:
            return "chosen_messages"
        raise DatasetFormatError(
            f"{where}: no {self.fields['prompt']!r}, {self.fields['messages']!r} or {self.fields['chosen']!r} "
            f"field; the records have {columns}. Name yours with --data_fields, e.g. "
            f"'prompt=question,chosen=answer,rejected=bad_answer'{self._records_list_hint(data)}")

    def _check_records_not_in_a_list(self, data, where):
        """A file of one record (one JSON object on one line) without the records' fields, whose list of objects has
        them, is a JSON object holding the records in a list beside other fields ({"version": ..., "data": [...]},
        the layout load_dataset's field= reads): an error naming that list. It was read as one record of columns
        'version' and 'data', refused with "name yours with --data_fields". (Indented, or with no other field,
        ``check_json_document`` says so before loading.)"""
        defining = {self.fields[name] for name in ("prompt", "messages", "chosen")} | \
            (set() if self.renames_record_fields else {"conversations"})  # (ShareGPT's records, read as messages)
        lists = _lists_of_objects(data) if not defining & set(data.column_names) else {}
        holding = [name for name, value in lists.items() if any(defining & set(item) for item in value)]
        if holding:
            raise DatasetFormatError(f"{where}: the records are in the list under {holding[0]!r} of a JSON object; "
                                     "give a file that is that list (a JSON array of records) or JSON Lines")

    @staticmethod
    def _records_list_hint(data):
        """Said of a file of one record, without the records' fields, that holds one list of objects: they may be
        the records."""
        lists = _lists_of_objects(data)
        if len(lists) != 1:
            return ""
        (name, value), = lists.items()
        fields = sorted({field for item in value for field in item})
        return (f" (the file is one record; if the records are its list under {name!r}, of objects with the fields "
                f"{fields}, give a file that is that list (a JSON array of records) or JSON Lines)")

    def _check_renamed_prompt_parts(self, columns, where):
        """An input= or history= of --data_fields naming a column the train or eval file lacks is an error (a typo; the
        eval file's held-out prompts were built without it, unsaid), in a file with the prompt column: records of
        another shape in the mix need neither."""
        if self.fields["prompt"] in columns:
            self._check_renamed(PROMPT_PARTS, columns, where)

    def _check_renamed(self, names, columns, where):
        """A field the records' shape needs, renamed by --data_fields to a column the records lack, is an error
        naming it (else the records read as another shape and fail later, or not at all). Only fields the shape
        cannot do without are checked, so records of another shape (e.g. messages data next to the renamed data)
        are not rejected for a rename that does not apply."""
        for name in names:
            if name in self.renamed and self.fields[name] not in columns:
                # the field the user named is not there: say so, not what follows
                raise DatasetFormatError(f"{where}: no {self.fields[name]!r} field, which --data_fields "
                                         f"{name}={self.fields[name]} names; the records have {columns}")

    def check_usable(self, train_phase):
        if train_phase in (1, 2) and not self.has_answers and "chosen" in self.renamed:
            # a misspelt chosen=... is why the answers are missing: name it, not "no 'chosen' field"
            self._check_renamed(("chosen",), self.raw_datasets["train"].column_names, self.source.train_where)
        super().check_usable(train_phase)
        if train_phase == 2:
            self.check_rejected_rename()

    def check_rejected_rename(self):
        """A rejected=... that names a column the records lack is why they have no rejected answers: said as such.
        (Other steps' files may lack rejected answers under the same --data_fields; step 2's cannot. Conversations
        beside the renamed data, which have none under any name, are skipped and counted as without --data_fields.)"""
        if self.shape != "messages" and not self.has_rejected and "rejected" in self.renamed:
            self._check_renamed(("rejected",), self.raw_datasets["train"].column_names, self.source.train_where)

    def _shape_fields(self):
        return {"messages": ("messages",), "prompt": ("prompt", "chosen", "rejected"),
                "chosen_messages": ("chosen", "rejected")}[self.shape]

    # The reader's attributes that say where its data is and what it is called, not how a record is read
    # (``_reading_settings``)
    NOT_READING_SETTINGS = frozenset({"source", "dataset_name", "dataset_name_clean", "flag", "output_path", "seed",
                                      "local_rank", "raw_datasets", "_train_lines", "_eval_lines"})

    def _reading_settings(self):
        """How this reader reads a record (its field names, the record shape, its columns...), as JSON: every
        attribute set but NOT_READING_SETTINGS, so that one added later is in the records' pass's key
        (``_records_check_memo``) unless said to be of no matter."""
        return [type(self).__qualname__, {name: value for name, value in vars(self).items()
                                          if name not in self.NOT_READING_SETTINGS}]

    def _validate_unless_passed(self, data, kind, paths, digests, where, record_lines):
        """``_validate`` of the records of the files ``paths``, loaded by their sha256s ``digests``
        (``_split_digests``), unless they passed it before with the same content, reader settings and code
        (``_records_check_memo``), the pass kept where later processes find the files' hashes without reading them
        and those are still ``digests`` (as ``checked_json``'s; a failed walk keeps nothing). Processes walking the
        same records at once take turns (``_memo_bucket_lock``)."""
        memo = _records_check_memo(kind, digests, self._reading_settings())
        if memo is None:
            self._validate(data, where, record_lines)
            return
        if os.path.isfile(memo):
            return
        with _memo_bucket_lock(memo) if _hashes_shared(paths, digests) else contextlib.nullcontext():
            if os.path.isfile(memo):  # (kept by another process while this one waited)
                return
            self._validate(data, where, record_lines)
            if _hashes_shared(paths, digests):
                _keep_passed_check(memo, [(path, None) for path in paths], {"passed": True})

    def _validate(self, data, path, record_lines):
        """Read every record through the accessors once, so a bad one fails now, with its location."""
        for index, sample in enumerate(data):
            try:
                self.get_conversation(sample)
                self.get_chosen_text(sample)
                self.get_rejected_text(sample)
                self.is_undesirable(sample)
                self.get_tools(sample)
            except SkipRecord:  # (counted where the phase reads it)
                pass
            except RecordError as err:
                raise DatasetFormatError(f"{record_where(path, index, record_lines)}: {err}"
                                         f"{self._other_shape_hint(sample, err)}") from None

    def locate(self, sample):
        """Where a record read after loading (e.g. one the tokenizer's chat template refuses) is: its file, line and
        record number, as on load; the source's name if not found."""
        eval_path = self.source.eval or f"{self.source.train} (eval split)"
        for data, path, lines in ((self.raw_datasets["train"], self.source.train, self._train_lines),
                                  (self.raw_datasets["eval"], eval_path, self._eval_lines)):
            for index, record in enumerate(data or ()):
                if record == sample or repr(record) == repr(sample):  # (repr: a NaN is not equal to itself)
                    return record_where(path, index, lines)
        return self.dataset_name

    def _other_shape_hint(self, sample, err):
        """A record missing a field of the file's shape that has another shape's field instead: the file mixes record
        shapes."""
        defining = {"prompt": "prompt", "messages": "messages", "chosen_messages": "chosen"}[self.shape]
        if err.detail != "missing or null" or err.field != self.fields[defining]:
            return ""
        own = {self.fields[name] for name in self._shape_fields()}
        other = [self.fields[name] for name in FIELD_NAMES
                 if self.fields[name] not in own and sample.get(self.fields[name]) is not None]
        if not other:
            return ""
        shape = {"prompt": "prompt/chosen/rejected", "chosen_messages": "chosen/rejected conversation"}.get(
            self.shape, self.shape)
        return (f" (it has {other[0]!r} instead: the file mixes record shapes and reads as {shape} records; give each "
                f"shape a file of its own)")

    # --- structured accessors ---
    def get_conversation(self, sample):
        return self._with_system(sample, self._conversation(sample))

    def _with_system(self, sample, messages):
        """``messages`` after the record's system prompt column (LLaMA-Factory's ``system``; ``--data_fields
        system=NAME``) where it has text: it was passed on as an extra column, and the model trained without it. Messages
        that begin with it already keep it once; beginning with another system message, they are the record's error
        (which of the two is meant cannot be told)."""
        field = self.system_field
        text = sample.get(field) if field else None
        if text is None:
            return messages
        if not isinstance(text, str):
            raise RecordError(field, f"expected the system prompt as text, got {type(text).__name__}")
        if not text.strip():
            return messages
        system = {"role": "system", "content": trimmed(text)}
        if messages and messages[0]["role"] == "system":
            if _turns_of(messages[:1]) != _turns_of([system]):
                raise RecordError(field, "the record's messages begin with another system message; give one of the "
                                         "two")
            return messages
        return [system, *messages]

    def _conversation(self, sample):
        if self.shape == "messages":
            awaiting = self._awaiting_answer(sample)
            if awaiting:  # a conversation awaiting its answer: step 3's prompt
                return awaiting
            return self._split_message_list(sample, self.fields["messages"])[0]
        if self.shape == "chosen_messages":
            return self._split_message_list(sample, self.fields["chosen"])[0]
        return self._prompt_conversation(sample)

    def conversation_field(self, sample):
        if self.shape == "prompt":  # (the chosen list's turns where they hold the prompt's: ``_prompt_conversation``)
            chosen = self.fields["chosen"]
            turns = self._answer_list_turns(sample, chosen) if sample.get(chosen) is not None else None
            return chosen if turns else self.fields["prompt"]
        return self.fields["chosen" if self.shape == "chosen_messages" else "messages"]

    def _prompt_conversation(self, sample):
        """The prompt field's messages; or the chosen answer list's turns before its answer, where they end with them
        (a system message or earlier turns the prompt field leaves out: orca_dpo_pairs', ultrafeedback's)."""
        prompt = self._prompt_field_messages(sample)
        chosen = self.fields["chosen"]
        turns = self._answer_list_turns(sample, chosen) if sample.get(chosen) is not None else None
        return self._holding_prompt(turns, prompt, chosen) or prompt

    def _prompt_field_messages(self, sample):
        field = self.fields["prompt"]
        value = _json_list_text(sample.get(field), field, self.csv_cells)
        if isinstance(value, (list, tuple)):
            return prompt_messages(self._checked_messages(value, sample, field), field)
        text, earlier = self._with_input(sample, required_text(sample, field)), self._history_turns(sample)
        try:
            return earlier + text_prompt_messages(text)
        except ValueError as error:
            raise RecordError(field, str(error)) from None

    def _with_input(self, sample, instruction):
        """An Alpaca record's instruction with its input (where it has one) on a line of its own after it."""
        value = sample.get(self.input_field) if self.input_field else None
        if value is None:
            return instruction
        if not isinstance(value, str):
            raise RecordError(self.input_field, f"expected text (the instruction's input), got {type(value).__name__}"
                                                f"{self._alpaca_hint(self.input_field)}")
        return instruction + "\n" + trimmed(value) if value.strip() else instruction

    def _history_turns(self, sample):
        """The earlier turns of an Alpaca record's history ([[instruction, answer], ...]), else []."""
        value = sample.get(self.history_field) if self.history_field else None
        if isinstance(value, str) and value.strip().startswith("["):  # (a CSV cell's JSON text)
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass  # (said below)
        if not value:
            return []
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(text, str) and text.strip()
                                                                          for text in pair) for pair in value):
            raise RecordError(self.history_field, "expected a list of [instruction, answer] pairs of text, as "
                                                  "LLaMA-Factory's Alpaca records give the turns before"
                                                  f"{self._alpaca_hint(self.history_field)}")
        return [{"role": role, "content": trimmed(text)} for pair in value
                for role, text in zip(("user", "assistant"), pair)]

    def _answer_list_turns(self, sample, field):
        """The turns before the answer of an answer given as a message list, else None (a string answer)."""
        value = _json_list_text(sample[field], field, self.csv_cells)
        if not isinstance(value, (list, tuple)):
            return None
        return final_assistant_answer(self._checked_messages(value, sample, field), field)[0]

    def _checked_messages(self, value, sample, field):
        """``checked_messages`` of the field's message list ``value``, the nulls of its calls kept where they are as
        written (``keeps_nulls``; a list given as JSON text)."""
        return checked_messages(value, field, self.keeps_nulls or isinstance(sample.get(field), str))

    def _holding_prompt(self, turns, prompt, field):
        """``turns`` (an answer list's, before its answer) when there are any: they must end with the ``prompt``
        field's messages (else the answer would be trained after another prompt, its turns dropped)."""
        if not turns:
            return None
        _check_answer_follows_user(turns, field)
        if len(turns) < len(prompt) or _turns_of(turns[len(turns) - len(prompt):]) != _turns_of(prompt):
            raise RecordError(field, f"its turns before the answer do not end with the prompt of field "
                                     f"{self.fields['prompt']!r}; give the answer alone, or turns ending with that "
                                     "prompt")
        return list(turns)

    def _awaiting_answer(self, sample):
        """The messages of a record whose last message is the user's (a message list, or a "Human: ... Assistant:"
        transcript ending with an empty assistant turn), else None."""
        field = self.fields["messages"]
        value = _json_list_text(sample.get(field), field, self.csv_cells)
        if isinstance(value, (list, tuple)):
            messages = self._checked_messages(value, sample, field)
        elif isinstance(value, str) and _TRANSCRIPT_TURN.search(value):
            messages = parse_transcript(value)
        else:
            return None  # (read as a transcript answer, which says what is wrong)
        return messages if messages and messages[-1]["role"] in ("user", *TOOL_ROLES) else None

    def _split_message_list(self, sample, field):
        """(prompt turns, answer) of a full conversation whose last message is the assistant's answer: a message
        list, or a "Human: ... Assistant: ..." transcript (Anthropic/hh-rlhf's chosen and rejected); a chosen and
        rejected pair of plain strings, TRL's implicit prompt: the words both begin with, then each one's answer."""
        value = _json_list_text(sample.get(field), field, self.csv_cells)
        if isinstance(value, str):
            if self.shape == "chosen_messages" and self._plain_string_pair(sample):
                return _split_at_shared_prompt(sample, field, self.fields["chosen"], self.fields["rejected"])
            return _transcript_answer(sample, field, WHOLE_CONVERSATIONS if self.shape == "chosen_messages" else
                                      CONVERSATION)
        prompt, answer = final_assistant_answer(self._checked_messages(value, sample, field), field)
        if self.shape != "messages":
            _check_answer_weighted(value, field)
        if not prompt:
            raise RecordError(field, "there must be a user message before the answer")
        _check_answer_follows_user(prompt, field)
        return prompt_messages(prompt, field), answer

    def _plain_string_pair(self, sample):
        """Whether the record's chosen and rejected are both strings, neither a transcript nor a message list."""
        values = [_json_list_text(sample.get(self.fields[name]), self.fields[name], self.csv_cells)
                  for name in ("chosen", "rejected")]
        return all(isinstance(v, str) and not _TRANSCRIPT_TURN.search(v) for v in values)

    def get_chosen_text(self, sample):
        if self.shape == "messages":
            awaiting = self._awaiting_answer(sample)
            if awaiting:
                raise EndsWithUser(self._with_system(sample, awaiting))
            answer = self._split_message_list(sample, self.fields["messages"])[1]
            messages, untrained = self._weighted_messages(sample)
            if untrained and len(messages) - 1 in untrained:  # (a transcript has no weights, and no messages here)
                raise UntrainedAnswer(messages)
            return answer
        if self.shape == "chosen_messages":
            return self._split_message_list(sample, self.fields["chosen"])[1]
        field = self.fields["chosen"]
        if field not in sample:
            return None  # prompt-only data
        if sample[field] is None:
            raise RecordError(field, "missing or null")
        return self._answer_value(sample, field)

    def get_tools(self, sample):
        """The record's ``tools`` column (renamed: ``--data_fields tools=NAME``): a list of tool schemas (JSON objects),
        or that list as JSON text; None where the record has none."""
        field = self.fields[TOOLS_FIELD]
        value = sample.get(field)
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else None
            except json.JSONDecodeError as err:
                raise RecordError(field, f"not a JSON list of tool schemas ({err})") from None
        elif isinstance(value, (list, tuple)) and not self.keeps_nulls:  # (Arrow's None for the keys other records'
            value = without_none_values(value)  # schemas have)
        if not value:
            return None
        if not isinstance(value, (list, tuple)) or not all(isinstance(tool, dict) for tool in value):
            raise RecordError(field, "expected a list of tool schemas ({\"type\": \"function\", \"function\": "
                                     "{\"name\", \"description\", \"parameters\"}}), as apply_chat_template(tools=...) "
                                     "takes")
        return list(value)

    def get_untrained_turns(self, sample):
        return self._weighted_messages(sample)[1] if self.shape == "messages" else frozenset()

    def _weighted_messages(self, sample):
        """(messages, positions of the assistant turns of weight 0) of a conversation record ((None, none) for a
        transcript: it has no weights)."""
        field = self.fields["messages"]
        value = _json_list_text(sample.get(field), field, self.csv_cells)
        if not isinstance(value, (list, tuple)):
            return None, frozenset()
        messages = self._checked_messages(value, sample, field)
        written = self._with_system(sample, messages)  # (the system column's message first: the positions after it)
        return written, frozenset(position + len(written) - len(messages)
                                  for position in untrained_turns(value, messages))

    def get_rejected_text(self, sample):
        field = self.fields["rejected"]
        if self.shape == "messages" or sample.get(field) is None:
            return None
        if self.shape == "chosen_messages":
            prompt, answer = self._split_message_list(sample, field)
            if _turns_of(prompt) != _turns_of(self._split_message_list(sample, self.fields["chosen"])[0]):
                raise RecordError(field, f"its prompt turns differ from those of {self.fields['chosen']!r}")
            return answer
        answer = self._answer_value(sample, field)
        self._check_follows_conversation(sample, field)
        return answer

    def _check_follows_conversation(self, sample, field):
        """A rejected answer given as a list with turns before it answered those turns: they must be the conversation's
        (the chosen list's turns, else the prompt field's), which both answers are trained after. Turns before the
        prompt that differ (another system message, another earlier exchange) were dropped without a word."""
        turns = self._answer_list_turns(sample, field)
        if turns and _turns_of(turns) != _turns_of(self._conversation(sample)):
            raise RecordError(field, "its turns before the answer differ from those the chosen answer follows; a "
                                     "pair's answers must answer the same conversation")

    def get_reference_answers(self, sample):
        # TRL's completion is no pair's answer (TRL passes no completion column); Alpaca's output read without
        # --data_fields is no pair's either: its column, as written, under its own name (it came as chosen=, which no
        # column of the file is called). A messages record's last reply, the answer step 1 trains, comes as chosen, as
        # an answer renamed by --data_fields does: it has no column of its own (it was dropped; none where the
        # conversation awaits its answer, or its last reply has weight 0)
        if self.shape != "messages" and (self.fields["chosen"] == "completion" or self.alpaca_output):
            return {}
        return super().get_reference_answers(sample)

    def is_undesirable(self, sample):
        if self.label_field is None:
            return False
        value = sample.get(self.label_field)
        label = _label_value(value)
        if label is None:
            said = "missing or null" if value is None else f"{excerpt(value)} is not a label ({LABEL_SPELLINGS})"
            raise RecordError(self.label_field, f"{said}: TRL's unpaired preference records (prompt, completion, "
                                                "label) each say whether to imitate their answer")
        return not label

    def _answer_value(self, sample, field):
        """An answer given as a string, or as a message list whose last message is the assistant's. Turns before it
        (ultrafeedback_binarized's chosen repeats its prompt) must be the prompt field's: they would be dropped."""
        value = _json_list_text(sample[field], field, self.csv_cells)
        if isinstance(value, (list, tuple)):
            turns, answer = final_assistant_answer(self._checked_messages(value, sample, field), field)
            _check_answer_weighted(value, field)
            self._holding_prompt(turns, self._prompt_field_messages(sample), field)
            return answer
        return optional_text(sample, field)


def _check_answer_weighted(value, field):
    """A pair's answer (a chosen or rejected list's last message) of weight 0 is an error: a weight says which turns
    of a conversation (``messages``) step 1 trains, and a pair's answers are both read (it was, without a word)."""
    if value[-1].get("weight") == 0:
        raise RecordError(field, f"its answer (message {len(value) - 1}) has weight 0: a weight says which turns of a "
                                 "'messages' conversation to train, and a pair's answers are both read; remove it")


def _check_answer_follows_user(turns, field):
    """The turns before a conversation's answer end with the user's (said as such: not "the prompt messages must end
    with a user message")."""
    if turns[-1]["role"] == "assistant":
        raise RecordError(field, "the conversation ends with two assistant messages in a row; the answer must follow "
                                 "a user message")


def _turns_of(messages):
    """(role, text, tool calls) of each message, its whitespace runs as one space (a file's \r\n is the same prompt);
    calls of other functions or arguments are other turns (of text alone, all of them read as the same empty turn)."""
    return [(message["role"], " ".join(message["content"].split()),
             json.dumps(message.get("tool_calls"), sort_keys=True, default=str)) for message in messages]


def text_prompt_messages(text):
    """The messages of a prompt given as (stripped) text: a DeepSpeed-Chat-style transcript ("Human: ...
    \n\nAssistant:"), maybe after a system message as dschat writes one ("Be brief.\n\nHuman: ..."), else one user
    message (whose words "Human:" or "Assistant:" are its own). A transcript not ending with a Human turn is a
    ValueError."""
    transcript = with_lf_line_ends(text)
    if transcript.startswith("Human:") or (_PROMPT_AFTER_PREAMBLE.search(transcript) and
                                           transcript.endswith("Assistant:")):
        messages = parse_transcript(transcript, preamble_role="system")
        if not messages or messages[-1]["role"] != "user":
            raise ValueError("the transcript must end with a non-empty 'Human:' turn")
        return messages
    return [{"role": "user", "content": text}]


_LABEL_WORDS = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False}
LABEL_SPELLINGS = "true/false, 1/0, 1.0/0.0 or yes/no"  # (every spelling _label_value reads)
# 1/0 written as a float: pandas' to_csv writes a label column holding a null (NaN) as a float column, "1.0"/"0.0"
_NUMBER_LABEL = re.compile(r"([01])\.0*")


def _label_value(value):
    """A KTO label as a bool: a bool, 1/0 (also 1.0/0.0), or the text "true"/"false"/"1"/"0"/"yes"/"no"/"1.0"/"0.0" (a
    CSV cell, any case); else None."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _label_text_value(value.strip().lower())
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    return None


def _label_text_value(text):
    """The label a (stripped, lower-case) text spells, else None."""
    number = _NUMBER_LABEL.fullmatch(text)
    return number.group(1) == "1" if number else _LABEL_WORDS.get(text)


def _says_true_or_false(values):
    """Whether any value is a bool, the word true/false, or 1.0/0.0 as a float or its text (a float column of labels,
    as pandas writes one holding a null, to CSV or JSON): how KTO's labels are written (0/1 and yes/no are also other
    things). A float column was read as data where a CSV's text was labels: one score among 1.0/0.0 (0.7) left every
    answer trained from JSON Lines or parquet, and was its record's error from CSV."""
    return any(isinstance(v, bool) or (isinstance(v, float) and v in (0.0, 1.0))
               or (isinstance(v, str) and _spells_true_or_false(v.strip().lower())) for v in values)


def _spells_true_or_false(text):
    return text in ("true", "false") or _NUMBER_LABEL.fullmatch(text) is not None


# JSON text of a list of objects, also as json.dumps(indent=...) writes it ("[\n {")
_LIST_OF_OBJECTS = re.compile(r"\s*\[\s*\{")
# JSON text of one object: a message's (LLaMA-Factory's pairwise answers), in a CSV cell
_OBJECT = re.compile(r"\s*\{")


def _json_list_text(value, field, csv_cell=False):
    """A message list written as JSON text (a CSV cell holds no lists) as the list, and one message (LLaMA-Factory's
    pairwise answers: {"from": "gpt", "value": ...}) as a list of it, as is its JSON text in a CSV cell (``csv_cell``:
    a JSON or parquet file's string answer that reads as a message's JSON is an answer of JSON text, trained on as
    such, as it was before); any other value (a prompt that
    happens to read as JSON, "[1, 2, 3]", or an answer that is JSON objects, a tool call's
    '[{"name": "get_weather", "arguments": ...}]') as it is. A message list written as Python, as pandas' to_csv writes
    a list column, is its record's error (it was trained on as text)."""
    if _is_one_message(value):
        return [value]
    message = _message_of_json_text(value) if csv_cell else None
    if message is not None:  # (its JSON text, as a CSV cell holds it: read as the list of it is)
        return [message]
    if isinstance(value, str) and _LIST_OF_OBJECTS.match(value):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            if _are_messages(_python_literal(value)):
                raise RecordError(field, "a message list written as Python, not JSON (pandas' to_csv writes a list "
                                         "column so); write it as JSON text (json.dumps) or save the file as JSON "
                                         "Lines or parquet") from None
            return value
        return parsed if _are_messages(parsed) else value
    return value


def _message_of_json_text(value):
    """The message ``value`` is the JSON text of ({"role": "assistant", "content": ...}, ShareGPT's {"from": "gpt",
    "value": ...}), else None: an answer that is some other JSON object ('{"name": "get_weather", ...}', or one with a
    role key but no text) is its text."""
    if not isinstance(value, str) or not _OBJECT.match(value):
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return None
    if not _is_one_message(parsed):
        return None
    speaker = parsed.get("role", parsed.get("from"))
    known = speaker in (*VALID_ROLES, *ROLE_ALIASES, *SHAREGPT_ROLES) if isinstance(speaker, str) else False
    return parsed if known and any(key in parsed for key in ("content", "value", "tool_calls", "function_call")) \
        else None


def _are_function_schemas(value):
    """Whether ``value`` (or the JSON text of it) is a list of function schemas: objects, each with its name."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return False
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(schema, dict) and isinstance(schema.get("name"), str) for schema in value)


def _python_literal(text):
    """``text`` read as a Python literal, else None."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


# what chosen and rejected must hold without a prompt field: said where a record holds something else
WHOLE_CONVERSATIONS = ("without a 'prompt' field (--data_fields prompt=...), chosen and rejected must be whole "
                       "conversations, as message lists or \"\\n\\nHuman: ...\\n\\nAssistant: ...\" transcripts, or "
                       "strings that begin with the same prompt (TRL's implicit prompt)")


# what a messages field must hold (the explanation above is about chosen and rejected)
CONVERSATION = ("a conversation must be a list of messages ({role, content}) or a "
                "\"\\n\\nHuman: ...\\n\\nAssistant: ...\" transcript")


def _transcript_answer(sample, field, must_hold):
    """(prompt turns, answer) of a "Human:/Assistant:" transcript string; a string with no such turns is an error
    that says what the field must hold (``must_hold``)."""
    text = required_text(sample, field)
    if not _TRANSCRIPT_TURN.search(text):
        raise RecordError(field, f"a string without 'Human:'/'Assistant:' turns: {must_hold}")
    return answer_from_transcript(text, field)


# scripts written without spaces between words (Han, kana, Thai, Lao, Khmer, Myanmar, Tibetan): each character is a
# word boundary's side, so a shared beginning in them ends where the two part
_UNSPACED_SCRIPTS = ("\u0e00-\u0eff\u0f00-\u0fff\u1000-\u109f\u1780-\u17ff\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff"
                     "\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003ffff")
# the end of a shared beginning that is the start of a word of a spaced script: it stays with the answers
_SPACED_WORD_TAIL = re.compile(rf"[^\W{_UNSPACED_SCRIPTS}]+\Z")
# the last word of a text (a character of an unspaced script), with the spaces after it
_LAST_WORD = re.compile(rf"(?:[{_UNSPACED_SCRIPTS}]|[^\s{_UNSPACED_SCRIPTS}]+)\s*\Z")


def _split_at_shared_prompt(sample, field, chosen_field, rejected_field):
    """(prompt turns, answer) of ``field`` in a pair of plain strings with TRL's implicit prompt ("The sky is blue."
    and "The sky is green."): the prompt is what both begin with up to the last word boundary (the start of the word
    they part in, "bl" of "blue" and "black", stays with the answers; "2+2=4" and "2+2=5" part after "2+2=", as TRL
    cuts them), the answer the rest. Text without word boundaries ("天空是蓝色的") is cut where the two part, as TRL
    cuts every pair: each of its characters is a word). Words of a spaced script that merely begin alike ("Blue."
    and "Black.", "Sure, ..." and "Sorry, ...") share no prompt: "Bl" or "S" is no prompt. Where one is the other's
    beginning ("The sky is blue." and "The sky is blue. Really."), the shorter one's last word is its answer (an empty
    answer is no answer, as an empty field is none)."""
    chosen, rejected = required_text(sample, chosen_field), required_text(sample, rejected_field)
    shared = _SPACED_WORD_TAIL.sub("", os.path.commonprefix([chosen, rejected]))
    if not (chosen[len(shared):].strip() and rejected[len(shared):].strip()):
        shared = _LAST_WORD.sub("", shared)  # one is the other's beginning: its last word is its answer, not nothing
    if not shared.strip():
        other = rejected_field if field == chosen_field else chosen_field
        raise RecordError(field, f"a string without 'Human:'/'Assistant:' turns that shares no beginning with "
                                 f"{other!r}: {WHOLE_CONVERSATIONS}")
    try:
        prompt = text_prompt_messages(shared.strip())
    except ValueError as error:
        raise RecordError(field, f"the prompt it shares with the other answer: {error}") from None
    return prompt, (chosen if field == chosen_field else rejected)[len(shared):].strip()
