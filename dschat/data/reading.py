"""Opening and reading local data files: decompression, the JSON and JSON Lines checks (and their kept passes),
CSV, Arrow loading with JSON's key orders as written, save_to_disk folders, and a split's files read as one.
"""
import bz2
import collections
import contextlib
import functools
import gzip
import hashlib
import json
import lzma
import os
import re
import shlex
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from dschat.errors import MissingInputError, UsageError
from dschat.utils.files import atomic_file
from .digests import (HEAD_BYTES, _datasets_cache_folder, _memo_bucket_lock, _prune_now_and_then, _stat_stamp,
                      file_digest, file_digest_and_stamp, shared_digest)
from .errors import DatasetFormatError
from .fields import EVAL_SPLIT_NAMES, EXTENSION_TYPES, SPEAKER_KEYS, _are_messages, files_where
from .formatting import with_lf_line_ends


def _is_saved_dataset(path):
    return any(os.path.isfile(os.path.join(path, name)) for name in ("dataset_dict.json", "state.json"))


@dataclass(frozen=True)
class Compression:
    """How a file compressed with one tool is told and undone: by its name's ``extension`` or its first bytes
    (``magic``, a regular expression); ``decompress``, the shell command that writes the plain file beside it
    (``decompress_command``); ``module``, what undoes it as the file is read (``open_data_file``), for the compressions
    of JSON that datasets' json loader undoes too (``PACKED_JSON``), else None."""
    extension: str
    magic: bytes
    decompress: str
    module: object = None


# by tool: hub datasets ship some data so (Anthropic/hh-rlhf's harmless-base/train.jsonl.gz, allenai/c4's shards);
# zstd needs a package datasets does not install, and a zip is an archive of files
COMPRESSIONS = {"gzip": Compression(".gz", rb"\x1f\x8b", "gunzip -k", gzip),
                "bzip2": Compression(".bz2", rb"BZh[1-9]1AY&SY", "bunzip2 -k", bz2),
                "xz": Compression(".xz", rb"\xfd7zXZ\x00", "unxz -k", lzma),
                "zstd": Compression(".zst", rb"\x28\xb5\x2f\xfd", "unzstd"),
                "zip": Compression(".zip", rb"PK\x03\x04", "unzip")}
COMPRESSED_EXTENSIONS = {compression.extension: tool for tool, compression in COMPRESSIONS.items()}
# the extension that names each compression of JSON dschat reads decompressed: gzip's .gz
PACKED_JSON_EXTENSIONS = {tool: compression.extension for tool, compression in COMPRESSIONS.items()
                          if compression.module}


# the modules that undo them, by the file's extension (``open_data_file``)
DECOMPRESSORS = {compression.extension: compression.module for compression in COMPRESSIONS.values()
                 if compression.module}
PACKED_JSON = tuple(DECOMPRESSORS)  # (their extensions: a JSON file named so, x.jsonl.gz, is read decompressed)


@dataclass(frozen=True)
class BinaryTable:
    """A binary table file, told by its first bytes (``magic``, as a compression's) whatever its name: a Parquet file
    named train.csv or train.jsonl was read as text, "not UTF-8 text (byte 0xd4 at column 8)", and an Arrow file's NULs
    said "UTF-16?". Its last bytes are its ``magic`` too (each format writes it last: ``is_binary_table``; else a CSV
    whose first column is named PAR1 or FEA1 would be one), or, ``schema_first``, an Arrow schema that pyarrow reads
    follows its first bytes (``starts_an_arrow_stream``). ``what``: its words;
    ``kind``: the data type dschat reads it as, by its ``extension`` (EXTENSION_TYPES), None for one it does not read,
    told the Python that writes it as Parquet: ``read``, pyarrow's expression that reads it ({path}: the file's),
    after ``advice``, where said, on what to give instead."""
    what: str
    extension: str
    magic: bytes
    kind: str | None = None
    read: str = "pyarrow.feather.read_table({path})"
    advice: str = ""
    schema_first: bool = False


# An Arrow IPC stream's first bytes: no magic word, but its first message's length (little-endian), after a
# continuation marker (pyarrow 0.15 on), or alone (before: as pyarrow writes with use_legacy_format), then, there, the
# root offset of the message's flatbuffer; a length under 16 MiB after the marker, under 64 KiB alone, as a schema's.
# A file they start is read for its schema (``starts_an_arrow_stream``: a UTF-32 text's may start so), not told by its
# last bytes: a stream not closed ends without its end-of-stream marker, one before 0.15 with another ("UTF-16?").
ARROW_STREAM_START = rb"\xff\xff\xff\xff[\x00-\xff]{3}\x00|[\x00-\xff]{2}\x00\x00[\x00-\xff]\x00\x00\x00"

# by name: what pandas' to_parquet and to_feather write (Feather v2 is an Arrow IPC file), and the Arrow IPC stream
# datasets writes: a save_to_disk folder's data-00000-of-00001.arrow and its cache files
BINARY_TABLES = {"parquet": BinaryTable("a Parquet file", ".parquet", rb"PAR1", "parquet"),
                 "arrow": BinaryTable("an Arrow IPC (Feather v2) file", ".arrow", rb"ARROW1"),
                 "feather": BinaryTable("a Feather v1 file", ".feather", rb"FEA1"),
                 "arrow_stream": BinaryTable(
                     "an Arrow IPC stream (as a datasets save_to_disk folder's data-00000-of-00001.arrow)", ".arrow",
                     ARROW_STREAM_START, read="pyarrow.ipc.open_stream({path}).read_all()",
                     advice="where it is from a save_to_disk folder, give the folder as disk:FOLDER; else ",
                     schema_first=True)}


def told_by_magic(formats, head):
    """The name of the format of ``formats`` ({name: a Compression or BinaryTable}) whose magic the first bytes
    ``head`` start with, else None."""
    return next((name for name, held in formats.items() if re.match(held.magic, head)), None)


def data_file_extensions(path):
    """(the extension of the file's data type, that of its compression or ""): train.jsonl.gz: (".jsonl", ".gz")."""
    stem, last = os.path.splitext(path)
    return (os.path.splitext(stem)[1], last) if last.lower() in PACKED_JSON else (last, "")


# --- reading files (datasets does the parsing; JSON is pre-checked for line-numbered errors) ---

# what the modules that undo the compressions of ``PACKED_JSON`` (``DECOMPRESSORS``) raise for data that is not what
# its name says or is cut short (bz2's OSError, "Invalid data stream"; gzip's BadGzipFile is one too: an OSError
# without an errno, unlike a read the file system failed)
DECOMPRESSION_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)


@contextlib.contextmanager
def open_data_file(path, encoding=None):
    """The file at ``path`` open to read, as text of ``encoding`` where one is given, else as bytes; decompressed as
    it is read where its name says it is compressed (``PACKED_JSON``: a hub download's train.jsonl.gz), so a JSON
    file's checks read, a line at a time, what datasets' json loader reads. A compressed file whose data does not
    decompress (cut short, or not what its name says) is an error naming it; one of no bytes is read as the empty
    file it is (it holds no compressed stream: bzip2's and xz's readers said "ended before the end-of-stream"). A read
    the file system fails (an OSError with an errno: EACCES, EIO) stays that error, naming the file: it was said to be
    a file cut short, to download again."""
    packed = data_file_extensions(path)[1].lower()
    mode = "rt" if encoding else "rb"
    if not packed or os.path.getsize(path) == 0:
        with open(path, mode, encoding=encoding) as f:
            yield f
        return
    try:
        with DECOMPRESSORS[packed].open(path, mode, encoding=encoding) as f:
            yield f
    except UsageError:
        raise  # (the reader's own errors: MissingInputError is an OSError too)
    except DECOMPRESSION_ERRORS as err:
        if isinstance(err, OSError) and err.errno is not None:  # (EACCES, EIO: the file system's, not the data's)
            if err.filename is None:  # (a failed read names no file)
                raise OSError(err.errno, err.strerror, path) from err
            raise
        raise undecompressable_error(path, packed, err) from err


def undecompressable_error(path, packed, err):
    """The error for the file at ``path``, named compressed (``packed``: its extension, ``PACKED_JSON``), whose data
    did not decompress (``err``): a stream cut short (EOFError: a download stopped); data not of that compression, by
    its first bytes (``compressed_with``): ``misnamed_compressed_error`` (it was "a file cut short?", which it is not);
    else a stream damaged inside."""
    tool = COMPRESSED_EXTENSIONS[packed]
    if isinstance(err, EOFError):
        return DatasetFormatError(f"{path}: not readable as {tool} data, as its name says it is ({err}): a file cut "
                                  "short? download or compress it again")
    held = compressed_with(path)
    if held == tool:
        return DatasetFormatError(f"{path}: not readable as {tool} data, as its name says it is ({err}): its data is "
                                  "damaged; download or compress it again")
    return misnamed_compressed_error(path, tool, held, read_decompressed=True)


def misnamed_compressed_error(path, named, held, where=None, read_decompressed=False, plain_fix=None):
    """The error for a file whose name says it is compressed with ``named`` (x.csv.gz, x.jsonl.gz), told by what its
    bytes hold (``held``: ``compressed_with``), not by its name: x.csv.gz holding xz, or the plain CSV, was told
    "compressed with gzip ... (gunzip -k x.csv.gz)", which gunzip refuses ("not in gzip format"). Data of no
    compression is told the name to give it (or ``plain_fix``: a folder's, the commands that write all its plain
    files); of a compression the file would be read decompressed in, named so (``read_decompressed``: a file
    ``open_data_file`` reads; PACKED_JSON_EXTENSIONS), that name; of another, that one's command
    (``compressed_error``). A binary table (``binary_table_of``: train.jsonl.gz that is Parquet) is told what it is
    and its fix (``binary_table_fix``): it was told the uncompressed name, train.jsonl, and only the next run that it
    is Parquet. ``where``: how the error names ``path``."""
    misnamed = f"{where or path}: not {named} data, though its name says it is"
    if held is None:
        table = binary_table_of(path)
        if table is None:
            return DatasetFormatError(f"{misnamed}: " + (plain_fix or "where it is the uncompressed file, name it so "
                                                         f"({plain_file_command(path, held)})"))
        said = f"{misnamed}: it is {table.what}"
        return DatasetFormatError(f"{said}: {plain_fix}" if plain_fix else f"{said}{binary_table_fix(path, table)}")
    if read_decompressed and held in PACKED_JSON_EXTENSIONS:
        renamed = named_compressed_with(path, PACKED_JSON_EXTENSIONS[held])
        return DatasetFormatError(f"{misnamed}: it is compressed with {held}; name it so "
                                  f"({rename_command(path, renamed)})")
    return compressed_error(path, held, where)


def held_compression(path, named):
    """The compression the file at ``path``, named compressed with ``named`` (x.csv.gz), holds by its first bytes
    (``compressed_with``), None for none; where it cannot be read, ``named`` (the load would fail on its own)."""
    try:
        return compressed_with(path)
    except OSError:
        return named


def plain_file_command(path, held):
    """The shell command that writes the plain file of ``path``, a file named compressed (x.csv.gz) that holds
    ``held`` (``held_compression``): that compression's command (``decompress_command``), or for none the rename to
    the name without the compression's extension (x.csv), or, for a binary table (``binary_table_of``), the command
    that makes it read (``binary_table_command``: x.parquet)."""
    if held is not None:
        return decompress_command(path, held)
    table = binary_table_of(path)
    return rename_command(path, os.path.splitext(path)[0]) if table is None else binary_table_command(path, table)


def text_encoding(path, head=None):
    """"utf-8-sig" for a file whose text starts with a UTF-8 byte-order mark (Windows editors write one), else
    "utf-8": the mark is not part of the first record. (A compressed file's text: ``open_data_file``.) ``head``: the
    file's first bytes where read already (``HashedFile.head``): a file not named compressed, its text's. Text of
    another encoding told by them is an error (``check_not_utf16``), as is a packed JSON file whose decompressed ones
    are a binary table's (``check_not_a_packed_binary_table``: a Parquet file gzipped as train.jsonl.gz)."""
    packed = data_file_extensions(path)[1]
    if head is None or packed:
        with open_data_file(path) as f:
            head = f.read(HEAD_BYTES)
    if packed:
        check_not_a_packed_binary_table(path, head)
    check_not_utf16(path, head)
    return "utf-8-sig" if head.startswith(b"\xef\xbb\xbf") else "utf-8"


def check_not_utf16(path, head):
    """A text file whose first bytes (``head``) hold a NUL byte is an error saying it is not UTF-8 (UTF-16, as
    PowerShell's ``>`` and Excel's "Unicode Text" save; UTF-32): no JSON, CSV or document's text starts with one.
    Without a byte-order mark, its ASCII decoded as UTF-8 with a NUL after each character: a JSON file was "invalid
    JSON (Expecting property name ... at column 2)", a CSV "Field "" does not exist in schema", and a document's text
    was trained on with its NULs."""
    if b"\x00" in head:
        raise DatasetFormatError(f"{path}: not UTF-8 text (a NUL byte among its first {len(head)} bytes: UTF-16?); "
                                 "save the file as UTF-8")


def holds_no_bytes(path):
    """Whether the file at ``path`` is empty: of a compressed file, its text (``open_data_file``)."""
    with open_data_file(path) as f:
        return not f.read(1)


def _json_reason(err):
    """json's message and column: "Unterminated string starting at column 7" (its message may end in "at")."""
    return f"{err.msg.removesuffix(' at')} at column {err.colno}"


class _KeysWrittenTwice:
    """json's ``object_pairs_hook`` that notes each object that writes a key twice (json keeps its last value, and the
    first was lost without a word; pyarrow refused a JSON Lines file's with an unrelated error)."""

    def __init__(self):
        self.twice = {}  # id of such an object -> the key
        self.objects = 0  # parsed so far: a record parsed with no other object inside it has no key order to gather

    def hook(self, pairs):
        self.objects += 1
        obj = dict(pairs)
        if len(obj) < len(pairs):
            seen = set()
            self.twice[id(obj)] = next(key for key, _ in pairs if key in seen or seen.add(key))
        return obj

    def key_in(self, value):
        """The key written twice in ``value`` or an object inside it, else None."""
        return _first_inside(value, lambda item: self.twice.get(id(item)) if isinstance(item, dict) else None)

    def check(self, record, where):
        key = self.key_in(record) if self.twice else None
        if key is not None:
            raise DatasetFormatError(f"{where}: an object writes the key {key!r} twice (JSON keeps only its last "
                                     "value); write each key once")


class NotJsonNumber(str):
    """NaN, Infinity or -Infinity as json's ``parse_constant`` reads them (Python's json.dumps writes a float NaN so):
    no JSON value, reported by ``check_json_numbers`` with the field that holds it."""


def check_json_numbers(record, where):
    """A record holding NaN or Infinity is an error naming its field: JSON Lines read it as a float ("expected a
    string, got float"), a JSON array as null ("missing or null"), and an extra column kept either."""
    for field, value in record.items():
        constant = _not_json_number_in(value)
        if constant is not None:
            raise DatasetFormatError(f"{where}: field {field!r}: {constant} is not a JSON value (Python's json.dumps "
                                     "writes a float NaN or infinity so); write null for a missing value, or text")


class _NotJsonNumbers:
    """json's ``parse_constant`` noting that NaN or Infinity was read: only then are the records walked for the field
    that holds it (walking every value of every record took longer than parsing them)."""

    def __init__(self):
        self.seen = False

    def parse(self, text):
        self.seen = True
        return NotJsonNumber(text)

    def check(self, record, where):
        if self.seen:
            check_json_numbers(record, where)


def _not_json_number_in(value):
    return _first_inside(value, lambda item: item if isinstance(item, NotJsonNumber) else None)


def _first_inside(value, find):
    """The first of ``find(item)`` that is not None, over a JSON value and every value inside it (depth first)."""
    found = find(value)
    if found is not None:
        return found
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((found for found in (_first_inside(child, find) for child in children) if found is not None), None)


def check_jsonl_lines(path, key_orders=None, encoding=None):
    """Line numbers (1-based) of the records in a JSONL file; DatasetFormatError at the first bad line. Where given,
    ``key_orders`` (a ``_KeyOrders``) gathers the order of its objects' keys in the same parse; ``encoding``, its
    ``text_encoding`` where found already.

    datasets/pyarrow report a malformed line without its number, so the file is checked here first.
    """
    record_lines, keys, constants = [], _KeysWrittenTwice(), _NotJsonNumbers()
    try:
        for line_number, line in record_text_lines(path, encoding):
            # a JSON array given as JSON Lines fails on its first line: said how to give it
            array = " (the file is one JSON array: give it as json:PATH)" if not record_lines and \
                line.lstrip().startswith("[") else ""
            objects = keys.objects
            try:  # (a record cut short is at its line's end, not the next)
                record = json.loads(line.rstrip("\r\n"), object_pairs_hook=keys.hook, parse_constant=constants.parse)
            except json.JSONDecodeError as err:
                raise DatasetFormatError(f"{path} line {line_number}: invalid JSON ({_json_reason(err)}){array}") \
                    from None
            if not isinstance(record, dict):
                raise DatasetFormatError(f"{path} line {line_number}: expected a JSON object, got "
                                         f"{type(record).__name__}{array}")
            keys.check(record, f"{path} line {line_number}")
            constants.check(record, f"{path} line {line_number} (record {len(record_lines)})")
            if key_orders is not None and keys.objects > objects + 1:  # (a flat record's: none to gather)
                key_orders.add(record)
            record_lines.append(line_number)
    except UnicodeDecodeError:
        raise not_utf8_error(path) from None
    return compact_lines(record_lines)


def record_text_lines(path, encoding=None):
    """(line number, line) of each line of a JSON Lines file's text that is not blank, numbered (from 1) as its check
    and its errors number them (a compressed file's text: ``open_data_file``; ``encoding``: ``text_encoding``'s where
    found already)."""
    with open_data_file(path, encoding or text_encoding(path)) as f:
        for line_number, line in enumerate(f, start=1):
            if line.strip():
                yield line_number, line


def compact_lines(lines):
    """Record line numbers (ascending) as a range where they run without a gap (a file of no blank lines: most), else
    the list: a list holds ~36 bytes a record for the whole run (allenai/c4's en, 365M records, ~13 GB while its
    shards were read). Either is indexed, measured and tested for emptiness alike."""
    if lines and lines[-1] - lines[0] + 1 == len(lines):
        return range(lines[0], lines[-1] + 1)
    return lines


def caused_by(error, kind):
    while error is not None:
        if isinstance(error, kind):
            return True
        error = error.__cause__ or error.__context__
    return False


def not_utf8_error(path):
    """A DatasetFormatError naming the first line of ``path`` that is not UTF-8 text (JSON files must be; a compressed
    file's text: ``open_data_file``)."""
    with open_data_file(path) as f:
        for line_number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                return DatasetFormatError(f"{path} line {line_number}: not UTF-8 text (byte 0x{line[err.start]:02x} at "
                                          f"column {err.start + 1}); save the file as UTF-8")
    return DatasetFormatError(f"{path}: not UTF-8 text; save the file as UTF-8")


def check_json_document(path, key_orders=None, encoding=None):
    """A .json file must be one JSON array of objects (None returned) or JSON Lines (its record lines returned, as
    ``check_jsonl_lines``); DatasetFormatError with the line of a syntax error. Where given, ``key_orders`` (a
    ``_KeyOrders``) gathers the order of its objects' keys in the same parse; ``encoding``, its ``text_encoding``
    where found already."""
    encoding = encoding or text_encoding(path)
    try:
        if _starts_as_json_lines(path, encoding):
            return check_jsonl_lines(path, key_orders, encoding)
        with open_data_file(path, encoding) as f:
            text = f.read()
    except UnicodeDecodeError:
        raise not_utf8_error(path) from None
    if not text.strip():
        raise DatasetFormatError(f"{path}: no records ({_why_no_records('json', path)})")
    keys, constants = _KeysWrittenTwice(), _NotJsonNumbers()
    try:
        document = json.loads(text, object_pairs_hook=keys.hook, parse_constant=constants.parse)
    except json.JSONDecodeError as err:
        if _is_json_lines(text):
            return check_jsonl_lines(path, key_orders, encoding)
        raise DatasetFormatError(f"{path} line {err.lineno}: invalid JSON ({_json_reason(err)})") from None
    keys_of_records = _records_keys(document)
    key = keys_of_records[0] if keys_of_records else None
    if key is not None and len(document) == 1:  # (a one-key object is never a record)
        raise DatasetFormatError(f"{path}: the records are in the list under {key!r} of a JSON object; give a file "
                                 "that is that list (a JSON array of records) or JSON Lines")
    if len(keys_of_records) > 1 and len(keys_of_records) == len(document):  # nor one of record lists alone: splits
        # ({"train": [...], "test": [...]}; written on one line it was read as one JSON Lines record, to be named
        # with --data_fields)
        raise DatasetFormatError(f"{path}: the records are in the lists under {', '.join(map(repr, keys_of_records))}"
                                 " of a JSON object; give a file for each list (a JSON array of records, or JSON "
                                 "Lines): a train and an eval file as TYPE:TRAIN_PATH,EVAL_PATH")
    if key is not None and "\n" in text.strip():  # (or one record with a list of objects: a tool list, say)
        raise DatasetFormatError(f"{path}: expected a JSON array of records, got a JSON object: if the records are "
                                 f"the list under {key!r}, give a file that is that list (or JSON Lines); one record? "
                                 "put it in a JSON array, [...]")
    if isinstance(document, dict) and "\n" not in text.strip():  # JSON Lines of one record, as datasets reads it
        return check_jsonl_lines(path, key_orders, encoding)
    if not isinstance(document, list):
        one = " (one record? put it in a JSON array, [...])" if isinstance(document, dict) else ""
        raise DatasetFormatError(f"{path}: expected a JSON array of records, got a {type(document).__name__}{one}")
    if not document:
        raise DatasetFormatError(f"{path}: no records (the JSON array is empty)")
    for index, record in enumerate(document):
        if not isinstance(record, dict):
            raise DatasetFormatError(f"{path} record {index}: expected a JSON object, got {type(record).__name__}")
        keys.check(record, f"{path} record {index}")
        constants.check(record, f"{path} record {index}")
    if key_orders is not None and keys.objects > len(document):  # (flat records, the array's objects alone: none)
        for record in document:
            key_orders.add(record)
    return None


def _starts_as_json_lines(path, encoding=None):
    """Whether a .json file is JSON Lines by its start: a first line that is a whole JSON object, with more text on the
    lines after it, is no one JSON document, and ``check_json_document`` checks it as JSON Lines, as it did once it
    had read the whole text (allenai/c4's shards, ~800 MB decompressed) and failed to parse it. Only the first line,
    and the blank ones before and after it, are read (a file that starts otherwise, its first character alone).
    ``encoding``: ``text_encoding``'s where found already."""
    with open_data_file(path, encoding or text_encoding(path)) as f:
        start = f.read(1)
        while start.isspace():
            start = f.read(1)
        if start != "{":
            return False
        try:
            first = json.loads(start + f.readline())
        except json.JSONDecodeError:
            return False
        return isinstance(first, dict) and any(line.strip() for line in f)


def _records_keys(document):
    """The keys of a JSON object whose values are lists of records ({"data": [...]}, as load_dataset's field= reads
    it), else []; a list of messages ({"messages": [{"role": ...}]}, a record's own) holds no records."""
    if not isinstance(document, dict) or any(_are_messages(value) for value in document.values()):
        return []  # (an object with a message list of its own is a record)
    return [key for key, value in document.items() if isinstance(value, list) and value and
            all(isinstance(item, dict) for item in value) and
            not any(speaker in item for item in value for speaker in SPEAKER_KEYS)]


def _is_json_lines(text):
    """A .json file that is really JSON Lines (common) is accepted and checked line by line."""
    first = text.lstrip()[:1]
    return first == "{" and "\n" in text.strip()


def compressed_error(path, tool, where=None, kind=None, plain_fix=None):
    """The error for a data file compressed with ``tool`` that dschat does not read so: a JSON or JSON Lines file
    (``kind``) compressed with gzip, bzip2 or xz is, where its name says so (x.jsonl.gz): the name to give it (``gunzip
    -k x.jsonl`` would refuse it for its name); another is to be decompressed (or ``plain_fix``: a folder's, the
    commands that write all its plain files). ``where``: how the error names ``path`` (``data_spec_where``: with the
    flag that gave it), else by itself."""
    if _read_decompressed_as(kind, tool):
        return DatasetFormatError(f"{where or path}: the file is compressed with {tool}, which its name does not say: "
                                  + (plain_fix or f"name it so ({compressed_file_command(path, tool, kind)}), and it "
                                                  "is read decompressed"))
    return DatasetFormatError(f"{where or path}: the file is compressed with {tool}, which dschat does not read here "
                              "(it reads JSON and JSON Lines compressed with gzip, bzip2 or xz, named so: x.jsonl.gz): "
                              + (plain_fix or f"decompress it ({decompress_command(path, tool)}) and give the file "
                                               "that writes"))


def _read_decompressed_as(kind, tool):
    """Whether a file of ``kind`` compressed with ``tool`` is read decompressed where its name says so (JSON and JSON
    Lines in gzip, bzip2 or xz: ``PACKED_JSON_EXTENSIONS``)."""
    return tool in PACKED_JSON_EXTENSIONS and kind in ("json", "jsonl")


def compressed_file_command(path, tool, kind):
    """The shell command that makes the file at ``path``, of ``kind`` and compressed with ``tool``, read: the name
    that says its compression, for one read decompressed (``_read_decompressed_as``), else its decompression
    (``decompress_command``)."""
    if _read_decompressed_as(kind, tool):
        return rename_command(path, named_compressed_with(path, PACKED_JSON_EXTENSIONS[tool]))
    return decompress_command(path, tool)


def folder_fix(commands, what, again="give the folder again"):
    """The words that tell a folder's fix: ``what`` to do, with the shell ``commands`` of every file of it that is
    not read as named, joined, then ``again``: told a file at a time, a folder of two such files took two runs."""
    return f"{what} ({' && '.join(commands)}) and {again}"


def decompress_command(path, tool):
    """The shell command that decompresses the file at ``path``, compressed with ``tool``, beside it. gunzip, unxz and
    unzstd refuse a file not named with their extension (x.csv holding gzip: `gunzip -k x.csv`, "unknown suffix --
    ignored"), and bunzip2 writes x.csv.out: such a file is named so first, and the plain file is written under its
    name. A name ending in another compression's extension (x.jsonl.gz holding zstd), or in the tool's own in capitals
    (unxz refuses .XZ), has it replaced, not added to: the plain file written is x.jsonl, not x.jsonl.gz (misnamed
    again). (unzip reads an archive of any name; it writes into the current folder, not the archive's, unless told:
    a folder's train.csv.zip was extracted where the command ran, and the folder given again was refused again.)
    Paths are quoted where the shell needs it (``rename_command``)."""
    extension, command = COMPRESSIONS[tool].extension, COMPRESSIONS[tool].decompress
    if tool == "zip":
        return f"{command} -d {shlex.quote(os.path.dirname(path) or '.')} {shlex.quote(path)}"
    if path.endswith(extension):
        return f"{command} {shlex.quote(path)}"
    packed = named_compressed_with(path, extension)
    return f"{rename_command(path, packed)} && {command} {shlex.quote(packed)}"


def rename_command(path, new):
    """The shell command that renames the file at ``path`` to ``new``: each path quoted where the shell would split or
    read it (``shlex.quote``: a space, a quote), so that the command can be pasted; an ordinary path is written as it
    is."""
    return f"mv {shlex.quote(path)} {shlex.quote(new)}"


def named_compressed_with(path, extension):
    """``path`` named with the compression ``extension``: a trailing compression extension of another (or in
    capitals) replaced, not added to (x.jsonl.zst holding gzip: x.jsonl.gz, not x.jsonl.zst.gz, whose .zst then
    hides its type)."""
    stem, last = os.path.splitext(path)
    return (stem if last.lower() in COMPRESSED_EXTENSIONS else path) + extension


def check_folder_not_compressed(folder, where=None):
    """A folder whose train data is compressed (Anthropic/hh-rlhf's helpful-base/train.jsonl.gz and test.jsonl.gz) is
    an error saying so, with the commands that write its split files plain, each told by the file's bytes
    (``plain_file_command``): it was "cannot tell what the folder holds" and, given TYPE:FOLDER, "the folder has no
    train.jsonl", neither of which is the fix. ``where``: how the error names the folder (``data_spec_where``: with the
    flag that gave it), else by itself."""
    names = [f"{split}{ext}{packed}" for split in ("train", *EVAL_SPLIT_NAMES) for ext in EXTENSION_TYPES
             for packed in COMPRESSED_EXTENSIONS]
    paths = [os.path.join(folder, name) for name in names if os.path.isfile(os.path.join(folder, name))]
    train = next((path for path in paths if os.path.basename(path).startswith("train.")), None)
    if train is None:
        return
    # each told by its bytes, not its name: train.csv.gz of xz, or plain text, was told `gunzip -k`, which refuses it
    held = {path: held_compression(path, COMPRESSED_EXTENSIONS[os.path.splitext(path)[1]]) for path in paths}
    commands = [plain_file_command(path, held[path]) for path in paths]
    # (the train file's own message, with the commands for all the folder's files)
    train_where = f"{where or folder}: its train data {os.path.basename(train)}"
    plain_fix = folder_fix(commands, "write its plain files")
    if held[train] is None:
        named = COMPRESSED_EXTENSIONS[os.path.splitext(train)[1]]
        raise misnamed_compressed_error(train, named, None, train_where, plain_fix=plain_fix)
    raise compressed_error(train, held[train], train_where, plain_fix=plain_fix)


def compressed_with(path, head=None):
    """The tool that compressed the file at ``path`` (``COMPRESSIONS``: told by its first HEAD_BYTES, ``head`` where
    read already: ``HashedFile.head``), else None."""
    return told_by_magic(COMPRESSIONS, _head_of(path) if head is None else head)


def _head_of(path):
    """The first HEAD_BYTES of the file at ``path``."""
    with open(path, "rb") as f:
        return f.read(HEAD_BYTES)


def check_bytes_read_as(kind, path, where=None, head=None, typed=False, fix=None):
    """A data file of ``kind`` whose first bytes say it is not read so (``bytes_not_read_as``) is an error saying
    what it is: compressed (``compressed_error``), read as text it was 'not UTF-8 text ... save the file as UTF-8'; or
    a binary table file of another kind (``binary_table_error``: a Parquet file named train.csv). ``where``: how the
    error names ``path``; ``head``: its first bytes where read already (``HashedFile.head``); ``typed``: the file was
    given as TYPE:PATH; ``fix``: the words that tell the fix, where not the file's own (a folder's: ``folder_fix``).
    A text file compressed (docs.txt.gz, read decompressed) that holds a binary table is told so
    (``packed_binary_table_error``)."""
    held = bytes_not_read_as(kind, path, head)
    if isinstance(held, BinaryTable):
        raise binary_table_error(path, kind, held, where, typed, fix)
    if isinstance(held, PackedBinaryTable):
        raise packed_binary_table_error(path, held.tool, held.table, kind, where, fix)
    if held is not None:
        raise compressed_error(path, held, where, kind, plain_fix=fix)


def bytes_not_read_as(kind, path, head=None):
    """What the file at ``path``, read as ``kind``, holds by its first bytes (``head`` where read already) that is not
    read so, else None: the tool it is compressed with (``compressed_with``), but JSON named so (``PACKED_JSON``:
    train.jsonl.gz, read decompressed, ``open_data_file``) and text (datasets' text reader decompresses it: the
    PackedBinaryTable it is where it is a binary table decompressed, ``packed_binary_table_of``); or the BinaryTable it
    is, of another kind (``binary_table_of``)."""
    if kind in ("json", "jsonl") and data_file_extensions(path)[1]:
        return None
    head = _head_of(path) if head is None else head
    tool = compressed_with(path, head)
    if tool and kind == "text":
        return packed_binary_table_of(path, tool)
    if tool:
        return tool
    table = binary_table_of(path, head)
    return table if table is not None and table.kind != kind else None


def read_as_command(kind, path):
    """The shell command that makes the file at ``path`` read, where its bytes say it is not read as ``kind``
    (``bytes_not_read_as``), else None: its decompression or name (``compressed_file_command``), or a binary table's
    (``binary_table_command``)."""
    held = bytes_not_read_as(kind, path)
    if isinstance(held, BinaryTable):
        return binary_table_command(path, held)
    if isinstance(held, PackedBinaryTable):
        return packed_binary_table_command(path, held.tool, held.table)
    return None if held is None else compressed_file_command(path, held, kind)


def binary_table_of(path, head=None):
    """The BinaryTable the file at ``path`` is, told by its first bytes (``head`` where read already) and its last
    (``is_binary_table``), else None."""
    name = told_by_magic(BINARY_TABLES, _head_of(path) if head is None else head)
    return BINARY_TABLES[name] if name and is_binary_table(path, BINARY_TABLES[name]) else None


def is_binary_table(path, table, opener=open):
    """Whether the file at ``path``, whose first bytes are ``table``'s magic, ends as a whole file of that format does
    (``ends_as_binary_table``): a CSV whose header begins "PAR1," or "FEA1," (text) was refused as a Parquet or
    Feather file. An Arrow IPC stream (``schema_first``) is one where it starts with an Arrow schema
    (``starts_an_arrow_stream``). ``opener``: what opens the file, a decompressing one (gzip.open) for a compressed
    file's table, read through to its end (its stream has no end to seek from)."""
    with opener(path, "rb") as f:
        if table.schema_first:
            return starts_an_arrow_stream(f)
        tail = len(table.magic) + FOOTER_LENGTH_BYTES
        if opener is open:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(size - tail, 0))
            last = f.read()
        else:
            size, last = 0, b""
            for block in iter(lambda: f.read(1 << 20), b""):
                size, last = size + len(block), (last + block)[-tail:]
        return ends_as_binary_table(table, size, last)


# Parquet, Arrow IPC and Feather v1 files end with their footer's (or metadata's) length, 4 bytes little-endian, then
# their magic
FOOTER_LENGTH_BYTES = 4


def ends_as_binary_table(table, size, last):
    """Whether a file of ``size`` bytes that starts with ``table``'s magic and ends with the bytes ``last`` ends as
    that format writes: its magic after a footer length that fits between the two magics. By the magic alone, a text
    that begins and ends with "PAR1" (a CSV's first column and last cell, a gzipped docs.txt.gz) was a Parquet file;
    its footer length would be four text characters' bytes (0x09090909 at least: 151 MB), more than a text holds
    short of that size."""
    magic = table.magic
    if len(last) < len(magic) + FOOTER_LENGTH_BYTES or not last.endswith(magic):
        return False
    footer = int.from_bytes(last[-len(magic) - FOOTER_LENGTH_BYTES:-len(magic)], "little")
    return 0 < footer <= size - 2 * len(magic) - FOOTER_LENGTH_BYTES


# A binary table compressed with ``tool`` (a Parquet file gzipped as docs.txt.gz)
PackedBinaryTable = collections.namedtuple("PackedBinaryTable", "tool table")


def packed_binary_table_of(path, tool):
    """The PackedBinaryTable the file at ``path``, compressed with ``tool``, is decompressed, told as a plain file
    is, by its first bytes and its last (read through: ``is_binary_table``), else None: a text's first bytes may be a
    table's magic (docs.txt.gz beginning "PAR1"), not its last too. None too where its data does not decompress, which
    its read says, or dschat has no module for ``tool`` (zstd, zip)."""
    module = COMPRESSIONS[tool].module
    if module is None:
        return None
    try:
        with module.open(path, "rb") as f:
            name = told_by_magic(BINARY_TABLES, f.read(HEAD_BYTES))
        table = name and BINARY_TABLES[name]
        return PackedBinaryTable(tool, table) if table and is_binary_table(path, table, module.open) else None
    except DECOMPRESSION_ERRORS:
        return None


def starts_an_arrow_stream(f):
    """Whether the binary file ``f``, read from its start, begins with an Arrow IPC stream's schema message, as pyarrow
    reads it (it reads that message alone): by either framing (``ARROW_STREAM_START``), closed or not."""
    import pyarrow
    import pyarrow.ipc

    try:
        pyarrow.ipc.open_stream(f)
    except (pyarrow.ArrowException, OSError):  # (pyarrow's "Invalid flatbuffers message" is an OSError)
        return False
    return True


def binary_table_error(path, kind, table, where=None, typed=False, fix=None):
    """The error for the file at ``path``, read as ``kind`` (None: its name tells no type, x.arrow), that is the binary
    ``table`` (a BinaryTable): one dschat reads is told the name to give it (train.csv: ``mv train.csv
    train.parquet``, in ``compressed_error``'s words), or, named so already or given as TYPE:PATH (``typed``: renamed,
    the path given was a file not found), the type to give; another is told the command that names it so and writes
    it as Parquet (``binary_table_command``), after its ``advice`` (an Arrow IPC stream: the save_to_disk folder it is
    from, read as disk:FOLDER). ``where``: how the error names ``path``; ``fix``: the words that tell the fix, where
    not the file's own (a folder's: ``folder_fix``)."""
    said = f"{where or path}: the file is {table.what}" + (f", not {kind}" if kind else "")
    if fix:
        return DatasetFormatError(f"{said}: {fix}")
    if table.kind is not None and (typed or binary_table_path(path, table) == path):
        return DatasetFormatError(f"{said}: give it as {table.kind}:{path}")
    return DatasetFormatError(f"{said}{binary_table_fix(path, table)}")


def binary_table_fix(path, table):
    """The words, after what the file at ``path`` is, that tell how the binary ``table`` it is gets read: the name to
    give one dschat reads, else that it does not read it and the command that writes it as Parquet
    (``binary_table_command``)."""
    command = binary_table_command(path, table)
    if table.kind is not None:
        return f": name it so ({command}), and it is read as {table.kind}"
    named = "" if binary_table_path(path, table) == path else "name it so and "
    return f", and dschat does not read it: {table.advice}{named}write it as Parquet, which it reads ({command})"


def binary_table_path(path, table):
    """``path`` named with ``table``'s extension in place of its own, and of its compression's, which it does not
    hold (train.csv: train.parquet, train.arrow; train.jsonl.gz: train.parquet)."""
    stem, extension = os.path.splitext(path)
    if extension.lower() in COMPRESSED_EXTENSIONS:
        return os.path.splitext(stem)[0] + table.extension
    return path if extension.lower() == table.extension else stem + table.extension


def binary_table_command(path, table):
    """The shell command that makes the file at ``path``, the binary ``table``, read by dschat: one it reads, named
    with its extension (``binary_table_path``); another, so named, then written beside as Parquet by pyarrow (its
    ``read``). Not the Parquet file alone: a dataset folder's train.csv left beside the train.parquet written was
    "the folder holds train.parquet and train.csv: keep one", and given again, the same error."""
    named = binary_table_path(path, table)
    commands = [rename_command(path, named)] if named != path else []
    if table.kind is None:
        parquet = os.path.splitext(named)[0] + ".parquet"
        code = (f"import pyarrow.feather, pyarrow.ipc, pyarrow.parquet; "
                f"pyarrow.parquet.write_table({table.read.format(path=repr(named))}, {parquet!r})")
        commands.append(f"python -c {shlex.quote(code)}")
    return " && ".join(commands)


def check_not_a_packed_binary_table(path, head):
    """A JSON file read decompressed (``open_data_file``: train.jsonl.gz) whose decompressed first bytes (``head``)
    are a binary table's magic (``told_by_magic``) is an error saying what it is, with the commands that make it read
    (``packed_binary_table_command``): read as text, a Parquet file compressed with gzip was "line 1: not UTF-8 text".
    It is one as a text file compressed is (``packed_binary_table_of``): by its decompressed last bytes too, or an
    Arrow stream's schema. By its first bytes alone, four bytes "PAR1" gzipped were told to be a Parquet file and
    given commands that fail on it: not JSON, but no table either (its JSON check says where it fails)."""
    if told_by_magic(BINARY_TABLES, head) is None or \
            EXTENSION_TYPES.get(data_file_extensions(path)[0].lower()) not in ("json", "jsonl"):
        return
    held = packed_binary_table_of(path, COMPRESSED_EXTENSIONS[data_file_extensions(path)[1].lower()])
    if held is not None:
        raise packed_binary_table_error(path, held.tool, held.table, "json")


def packed_binary_table_error(path, tool, table, kind, where=None, fix=None):
    """The error for the file at ``path``, read decompressed as ``kind`` (JSON named so: train.jsonl.gz; text:
    docs.txt.gz), that is the binary ``table`` compressed with ``tool``: what it is, and the commands that make it read
    (``packed_binary_table_command``). ``where``: how the error names ``path``; ``fix``: the words that tell the fix,
    where not the file's own (a folder's: ``folder_fix``)."""
    read_as = "JSON" if kind in ("json", "jsonl") else kind
    said = f"{where or path}: the file is {table.what} compressed with {tool}, not {read_as}"
    if fix:
        return DatasetFormatError(f"{said}: {fix}")
    plain = os.path.basename(binary_table_path(path, table))
    command = packed_binary_table_command(path, tool, table)
    if table.kind is not None:
        return DatasetFormatError(f"{said}: decompress it to {plain} ({command}), and it is read as {table.kind}")
    return DatasetFormatError(f"{said}, and dschat does not read it: {table.advice}decompress it to {plain} and "
                              f"write it as Parquet, which it reads ({command})")


def packed_binary_table_command(path, tool, table):
    """The shell command that makes the file at ``path``, the binary ``table`` compressed with ``tool`` (a Parquet
    train.jsonl.gz), read: named with the table's extension and the tool's (train.parquet.gz: gunzip refuses a name
    without its extension, and would write train.jsonl), decompressed (``decompress_command``: train.parquet), and,
    for one dschat does not read, written as Parquet (``binary_table_command``)."""
    plain = binary_table_path(path, table)
    packed = plain + COMPRESSIONS[tool].extension
    commands = [rename_command(path, packed), decompress_command(packed, tool), binary_table_command(plain, table)]
    return " && ".join(command for command in commands if command)


# A JSON or JSON Lines file's check that passed (``checked_json``) is kept by the file's content (its sha256), in
# datasets' cache beside the kept hashes: the check reads ~50 MB of text a second, and read it again every run where
# datasets' load is its Arrow cache's (allenai/c4's en, ~800 GB of text: ~5 h of CPU a process). JSON_CHECK_VERSION:
# bumped when what the checks accept, or what they give (``_check_as_kept``), changes, so an older pass is not taken.
# (By hand, not by the code's digest as a split's records' pass: every edit of dschat.data would check c4 again.)
JSON_CHECK_MEMO_FOLDER, JSON_CHECK_VERSION = "dschat_json_checked", 1


def checked_json(kind, path, key_orders, hashed):
    """(record lines, HashedFile): ``check_jsonl_lines`` (``kind`` "jsonl") or ``check_json_document`` ("json") of the
    file at ``path``, its objects' key orders gathered into ``key_orders``; or, where that check passed for the same
    content before (of this process or an earlier one), what it gave then, the file not read (its record lines read
    again only for an error that names one: ``RecordLinesOnDemand``). A pass is kept only where later processes find
    the file's hash without reading it (``shared_digest``: a hub blob, or a hash kept under the file's stamp), and that
    hash is still the one the check was looked up by: a file written while it was checked keeps nothing, and is hashed
    again (the HashedFile given back): ``load_file`` keys its load's Arrow cache by it, which, keyed by the hash found
    before the check, cached the new content under the old content's name. ``hashed``: the file's
    (``file_digest_and_stamp``: ``load_file``'s load's cache key too, found once). Processes checking a file that keeps
    its pass at once (a node's ranks on a first run) take turns (``_memo_bucket_lock``): the first checks it, the
    others read what it kept (or, where it failed, check it themselves: a bad file keeps nothing)."""
    digest = hashed.sha256
    memo = _json_check_memo_path(kind, path, digest)
    kept = _kept_json_check(memo)
    if kept is None:
        # (no turns where nothing will be kept: each process checks as before, not one after another)
        with _memo_bucket_lock(memo) if shared_digest(path).sha256 == digest else contextlib.nullcontext():
            kept = _kept_json_check(memo)  # (kept by another process while this one waited)
            if kept is None:
                check = check_jsonl_lines if kind == "jsonl" else check_json_document
                record_lines = check(path, key_orders, text_encoding(path, hashed.head))
                shared = shared_digest(path)  # (its stamp now: the kept pass's, no stat)
                as_read = _hashed_as_read(path, hashed, shared.stamp)  # (written since it was hashed: hashed again)
                if as_read is hashed and shared.sha256 == digest:  # (``hashed`` itself: not written since)
                    _keep_passed_check(memo, [(path, shared.stamp)], _check_as_kept(record_lines, key_orders))
                return record_lines, as_read
    key_orders.add_kept(kept["key_orders"])
    return _record_lines_kept(kept["lines"], path), hashed


def _json_check_memo_path(kind, path, digest):
    """Where a passed check of a file of ``kind``, compressed as its name says (read decompressed:
    ``open_data_file``), of the content ``digest``, is kept."""
    name = hashlib.sha256(json.dumps([JSON_CHECK_VERSION, kind, data_file_extensions(path)[1].lower(),
                                      digest]).encode()).hexdigest()
    return os.path.join(_datasets_cache_folder(JSON_CHECK_MEMO_FOLDER), name[:2], name)


def _check_as_kept(record_lines, key_orders):
    """What a passed check gave, as JSON: its record lines as [first, count] where they run without a gap (a range:
    ``compact_lines``), as {"count": N} where not (read again where asked for: ``RecordLinesOnDemand``), None for a
    JSON array (records have no lines); and the key orders gathered."""
    lines = None if record_lines is None else [record_lines.start, len(record_lines)] \
        if isinstance(record_lines, range) else {"count": len(record_lines)}
    return {"lines": lines, "key_orders": key_orders.as_json()}


def _record_lines_kept(lines, path):
    """The record lines of ``_check_as_kept``'s ``lines`` for the file at ``path``."""
    if lines is None:
        return None
    if isinstance(lines, dict):
        return RecordLinesOnDemand(path, lines["count"])
    first, count = lines
    return range(first, first + count)


def _kept_json_check(memo):
    """The passed check kept at ``memo`` (``_check_as_kept``'s dict), else None (none kept, or not readable)."""
    try:
        with open(memo, encoding="utf-8") as f:
            kept = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) and {"lines", "key_orders"} <= kept.keys() else None


def _keep_passed_check(memo, files, kept):
    """Write a passed check (a JSON file's; a split's records') at ``memo`` whole (``atomic_file``), the paths and
    stamps of the checked ``files`` ((path, stamp) pairs; a stamp None: the file's now) on its second line, as a kept
    hash's, for pruning to remove it once any of them is gone or written (``prune_kept_digests``; a copy of the content
    elsewhere then checks it again). A cache folder not writable keeps nothing."""
    with contextlib.suppress(OSError):
        entry = json.dumps([[os.path.abspath(path), *(stamp or _stat_stamp(os.stat(path)))] for path, stamp in files])
        with atomic_file(memo) as f:
            f.write(f"{json.dumps(kept)}\n{entry}")  # (ASCII: as pruning reads it)
    _prune_now_and_then(os.path.dirname(os.path.dirname(memo)))  # (its memo folder: the JSON checks' or records')


# A split's records that passed ``LocalDataset._validate`` (every record read through the accessors: ~7 s for 100 MB
# of JSON Lines on 2 CPU cores, more where a mixed-type column is decoded from JSON text each record) are kept as
# passed by the content of the split's files, the reader's settings and the code of dschat.data
# (``_records_check_memo``): a later run of the same data reads none of them again.
RECORDS_CHECK_MEMO_FOLDER = "dschat_records_checked"


def _records_check_memo(kind, digests, settings):
    """Where the pass of ``LocalDataset._validate`` over the records of files of ``kind`` loaded by the sha256s
    ``digests`` (``_split_digests``), read by a reader of ``settings`` (JSON), is kept; None for a save_to_disk folder
    (not a file hashed) or no files."""
    if kind == "disk" or not digests:
        return None
    import datasets
    import pyarrow

    key = json.dumps([_data_code_digest(), datasets.__version__, pyarrow.__version__, kind, digests, settings],
                     sort_keys=True, default=repr)
    name = hashlib.sha256(key.encode()).hexdigest()
    return os.path.join(_datasets_cache_folder(RECORDS_CHECK_MEMO_FOLDER), name[:2], name)


def _split_digests(kind, paths):
    """The sha256s of a split's files ``paths`` of ``kind`` (``file_digest``), taken before it is loaded: what its
    records' pass is kept by (``_records_check_memo``). Taken after, they were those of a write during the load (an
    eval file's during the train split's walk), and the records loaded before it kept their pass under the written
    content's hash. None for a save_to_disk folder (not a file hashed)."""
    return None if kind == "disk" else [file_digest(path) for path in paths]


def _hashes_shared(paths, digests):
    """Whether later processes find the hashes of the files ``paths`` without reading them (``shared_digest``), and
    they are still ``digests``, those the files were loaded by: else what is kept by them would not be found, or would
    be of other content (a file written since, as ``checked_json``'s)."""
    return all(shared_digest(path).sha256 == digest for path, digest in zip(paths, digests, strict=True))


@functools.cache
def _data_code_digest():
    """The sha256 of dschat.data's modules' source: what a record passes is decided all over them and changes with
    them, and a version bumped by hand would be forgotten, a record the new code refuses let through."""
    folder, digest = os.path.dirname(os.path.abspath(__file__)), hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()


class RecordLinesOnDemand(Sequence):
    """The record line numbers of a JSON Lines file whose records are not on lines without a gap, its check kept
    (``checked_json``): their count is known, and the numbers are read from the file (``record_text_lines``) only when
    one is asked for (an error naming a record's line)."""

    def __init__(self, path, count):
        self.path, self.count, self._lines = path, count, None

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        if self._lines is None:
            self._lines = [line_number for line_number, _ in record_text_lines(self.path)]
        return self._lines[index]


def load_file(kind, path):
    """(datasets.Dataset, record line numbers or None) for one local file or save_to_disk folder; a JSON file named
    compressed (x.jsonl.gz, a hub download's SUBSET/train.jsonl.gz), checked as it is decompressed, a line at a time
    (``open_data_file``), as a plain one is, then read by datasets' json loader, which decompresses it too. A JSON
    file's check that passed for its content before is not made again (``checked_json``)."""
    record_lines = header = None
    # (its load's key, and a JSON file's check's: found once, again only where the file was written while it was
    # checked; its first bytes (compressed? a binary table? its text's encoding) read in the same open, a compressed
    # file or a binary table of another type refused by them before it is read whole: ``check_bytes_read_as``)
    hashed = file_digest_and_stamp(path, check_head=lambda head: check_bytes_read_as(kind, path, head=head))
    if hashed.head is None:  # (a hub blob: its hash is its name, the file not opened)
        check_bytes_read_as(kind, path)
    key_orders = _KeyOrders()  # (a JSON file's: gathered as it is checked, its one parse in Python)
    if kind in ("json", "jsonl"):
        record_lines, hashed = checked_json(kind, path, key_orders, hashed)
    elif kind == "csv":
        header, record_lines, read_stamp = csv_record_lines(path, hashed.head)
        hashed = _hashed_as_read(path, hashed, read_stamp)
    builder = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}[kind]
    # (datasets would fail with its own wording; a CSV's rows are counted where the csv module could not read it)
    if (record_lines is not None and not record_lines) or (record_lines is None and _table_rows(kind, path) == 0):
        raise DatasetFormatError(f"{path}: no records ({_why_no_records(kind, path)})")
    try:
        options = _csv_options(path, header) if kind == "csv" else \
            {"encoding": text_encoding(path, hashed.head)} if builder == "json" else {}
        data = load_content_keyed(builder, path, hashed.sha256, **options)
    except Exception as err:  # pyarrow/datasets errors do not name the file; wrap them so they do
        if kind == "csv" and caused_by(err, UnicodeDecodeError):
            raise not_utf8_error(path) from err  # (pandas names the byte's offset, not its line)
        raise DatasetFormatError(f"{path}: could not be read as {kind}: {_error_text(err)}") from err
    if builder == "json":
        data = _as_written(kind, path, data, key_orders, hashed)
    if kind == "csv":
        data = _with_lf_line_ends(data)
    if record_lines is not None and len(record_lines) != len(data):  # (read otherwise than counted: say record numbers)
        record_lines = None
    return data, record_lines


def _why_no_records(kind, path):
    """Why a file holds no records: it is empty (no bytes), has only blank lines (spaces, tabs and line ends: it was
    said to be empty, and a CSV to have a header), or is a CSV of a header or a parquet file without rows."""
    if holds_no_bytes(path):
        return "the file is empty"
    if kind != "parquet" and only_blank_lines(path):
        return "it has only blank lines"
    return {"csv": "it has a header but no rows", "parquet": "it has no rows"}.get(kind, "the file is empty")


def only_blank_lines(path):
    """Whether a text file holds only whitespace after its byte-order mark (read a block at a time; a compressed
    file's text: ``open_data_file``)."""
    with open_data_file(path) as f:
        if f.read(1 << 16).removeprefix(b"\xef\xbb\xbf").strip():
            return False
        return not any(block.strip() for block in iter(lambda: f.read(1 << 16), b""))


def load_content_keyed(builder, path, digest=None, **options):
    """``load_dataset(builder)``'s train split of the file at ``path``, its Arrow cache keyed by the file's content
    (``digest``, where the caller has it: ``file_digest``).

    datasets keys the Arrow cache of a local file by its path and modification time only: a file edited with its
    time kept (``touch -r``, ``cp -p``, a rewrite within the file system's time resolution) was read back as its
    old records, under a tokenized-data cache key made from the new content. The content hash as the config name
    gives each content a cache of its own."""
    from datasets import load_dataset

    digest = digest or file_digest(path)
    return load_dataset(builder, name=f"content-{digest[:16]}", data_files={"train": path}, split="train", **options)


# A CSV written with ", " between its cells (by hand): a quoted cell after the space was read as text up to its next
# comma, quotes and all, so 'Q, "Yes, sure"' was the chosen answer '"Yes' and the rejected one 'sure"' (or a line of
# too many fields)
CSV_SPACING = {"skipinitialspace": True}


def check_csv_header(path, header):
    """A CSV header (``header``: its cells) that names a column twice is an error: pandas reads the second as
    "NAME.1", an extra column, and that column's text would silently go unread."""
    check_separated_by_commas(path, header)
    seen = {}
    for number, name in enumerate(map(_column_name, header), 1):
        if name in seen:
            raise DatasetFormatError(f"{path}: the header names column {name!r} twice (columns {seen[name]} and "
                                     f"{number}); give each column its own name")
        seen[name] = number


def check_separated_by_commas(path, header):
    """A header that is one column holding ";" or a tab is an error: a file separated by them (Excel's CSV where the
    decimal mark is a comma) read as one column, and the error said to name the fields with --data_fields."""
    separator = next((mark for mark in (";", "\t") if len(header) == 1 and mark in header[0]), None)
    if separator is not None:
        raise DatasetFormatError(f"{path}: the header is one column, {header[0]!r}: the file is separated by "
                                 f"{separator!r}, not commas; save it as comma-separated CSV")


def csv_record_lines(path, head=None):
    """(the header's cells, the lines (1-based) where its records start, the file's stamp after the read) of a CSV
    file, read once, as pandas reads them: after the header, a quoted cell may span lines, blank lines (and lines of
    spaces alone) are skipped, before the header too. The header is checked as soon as it is read
    (``check_csv_header``); a row that repeats it, or a record with more cells than it, is an error
    (``check_not_a_header``, ``check_no_extra_cells``). The lines are None, and the header where it was not reached, if
    the csv module cannot read the file (the loader says why). ``head``: the file's first bytes where read already
    (``HashedFile.head``: its encoding told by them, ``text_encoding``). The stamp (``FileStamp``, of the file open:
    no stat more) tells a write since the file was hashed (``_hashed_as_read``)."""
    import csv

    starts, start, header = [], 1, None
    with open(path, newline="", encoding=text_encoding(path, head)) as f:
        try:
            lines = _LastLineRead(f)
            reader = csv.reader(lines, **CSV_SPACING)
            for row in reader:
                if row and lines.last.strip():  # (a row's last line is blank only where the row is that line alone)
                    starts.append(start)
                    if header is None:
                        header = row
                        check_csv_header(path, header)
                    else:
                        check_not_a_header(path, start, row, header)
                        check_no_extra_cells(path, start, row, header)
                start = reader.line_num + 1
        except (UnicodeDecodeError, csv.Error):
            starts = None
        stamp = _stat_stamp(os.fstat(f.fileno()))
    return header, None if starts is None else starts[1:], stamp


def _hashed_as_read(path, hashed, read_stamp):
    """``hashed`` (the file's HashedFile, found before it was read: a CSV's record lines, a JSON file's check,
    ``checked_json``), or where the file's stamp when read (``read_stamp``) is another (written since), its hash found
    again: the load's Arrow cache is keyed by it (``load_content_keyed``), and keyed by the hash found before the
    read, it cached the new content under the old content's name. (A hub blob, hashed by its name, has no stamp: its
    hash is its name's.)"""
    if hashed.stamp is None or read_stamp == hashed.stamp:
        return hashed
    return file_digest_and_stamp(path)


class _LastLineRead:
    """A file's lines as the csv module reads them, keeping the last one read: a line of spaces alone is a blank line,
    which pandas skips (the header is the first line that is not), where the csv module reads it as one empty cell,
    as it reads a quoted empty cell (a record to pandas). A first line of spaces was the header [''], and every record
    'N cells, where the header names 1 columns'."""

    def __init__(self, lines):
        self.lines, self.last = lines, ""

    def __iter__(self):
        return self

    def __next__(self):
        self.last = next(self.lines)
        return self.last


def check_not_a_header(path, line, row, header):
    """A record that is the header again is an error: CSV files joined as they are (``cat a.csv b.csv``) put the second
    one's header among the records, where it was trained on as a record ("prompt" answered with "chosen"). Called for
    every record: its cells are compared only where it has the header's length and first name (each cell of each
    record was stripped and compared, a Python loop over every cell of a large file)."""
    if len(row) != len(header) or _column_name(row[0].lstrip("\ufeff")) != _column_name(header[0]):
        return
    if [_column_name(cell.lstrip("\ufeff")) for cell in row] == [_column_name(cell) for cell in header]:  # (its BOM)
        raise DatasetFormatError(f"{path} line {line}: the row repeats the header ({','.join(header)}); CSV files "
                                 "joined with their headers? remove it")


def check_no_extra_cells(path, line, row, header):
    """A record with more cells than the header names is an error: pandas took the first record's extra cells for an
    index column and read every record's cells under the next names (an unquoted comma in the first record made each
    prompt its chosen answer's text, without a word), and refused a later record's with "Expected 3 fields in line 5,
    saw 4" (no file named). Empty cells after the last (a delimiter ending a line) are no cells, on any line
    (``_csv_options`` reads the header's columns alone)."""
    if len(row) > len(header) and any(cell.strip() for cell in row[len(header):]):
        raise DatasetFormatError(f"{path} line {line}: {len(row)} cells, where the header names {len(header)} columns; "
                                 "quote a cell holding a comma (\"a, b\")")


def _table_rows(kind, path):
    """The number of records of a CSV or parquet file, or None (another kind, or not readable as this one: the
    loader says why)."""
    try:
        if kind == "csv":
            import pandas as pd

            return len(pd.read_csv(path, nrows=1, dtype=str, keep_default_na=False, **CSV_SPACING))
        if kind == "parquet":
            import pyarrow.parquet as pq

            return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # noqa: BLE001 (an empty CSV without a header, a damaged file: left to the loader's error)
        return 0 if kind == "csv" and os.path.getsize(path) == 0 else None
    return None


def _csv_options(path, header):
    """load_dataset's options for a CSV file: its cells are text, only an empty cell is missing (pandas would also read
    "NA", "None", "nan", ... as null), its columns are named as ``_column_name`` reads the header (``header``: its
    cells as ``csv_record_lines`` read them; None where the csv module could not, and pandas reads it), and the spaces
    after a comma are not the next cell's (``CSV_SPACING``)."""
    import pandas as pd

    if header is None:
        header = pd.read_csv(path, nrows=0, **CSV_SPACING).columns
    # (an empty header cell: named as pandas names it)
    names = [_column_name(cell) or f"Unnamed: {number}" for number, cell in enumerate(header)]
    # (usecols: a later line's empty cells after the last column, a comma ending it, are left out as the first
    # line's are; csv_record_lines refused non-empty ones)
    return {"features": _csv_text_features(names), "keep_default_na": False, "na_values": [""], "names": names,
            "header": 0, "index_col": False, "usecols": list(range(len(names))), **CSV_SPACING}



def _column_name(header_cell):
    """A CSV header cell's column name, without the spaces around it: a header written "prompt, chosen, rejected"
    named its columns " chosen" and " rejected", which no field is (and --data_fields cannot name), so its answers
    went unread ("has prompts but no answers")."""
    return header_cell.strip() or header_cell


def _csv_text_features(names):
    """Every CSV column as a string (CSV has no types: "5" or "007" is text, not a number)."""
    from datasets import Features, Value

    return Features({name: Value("string") for name in names})


def _with_lf_line_ends(data):
    """A CSV's text cells with "\\n" line ends: a quoted cell of a file written on Windows (Excel, ``to_csv`` there)
    keeps the file's "\\r\\n" inside it, which made a "Be brief.\\r\\n\\r\\nHuman: ..." prompt one user message (its
    system message and turns read as its text), cut a transcript's turns wherever a turn's text says "Human:" and
    trained the "\\r"s. The columns holding one are found by arrow's vectorised search: reading every cell into Python
    (``data[name]``, row by row) took seconds a column on a large file, most often one that holds none."""
    import pyarrow.compute as pc

    columns = [name for name in data.column_names
               if pc.any(pc.match_substring(data.data.column(name), "\r\n")).as_py()]
    if not columns:
        return data
    return data.map(_lf_cells, batched=True, fn_kwargs={"columns": columns}, desc="Reading CRLF line ends as LF")


def _lf_cells(batch, columns):
    return {name: [with_lf_line_ends(value) if value else value for value in batch[name]] for name in columns}


def _error_text(err):
    """The messages along an exception's cause chain ("An error occurred while generating the dataset" alone
    says nothing about what is wrong with the file)."""
    messages, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        message = str(err).strip() or type(err).__name__
        if message not in messages:
            messages.append(message)
        err = err.__cause__ or err.__context__
    return ": ".join(messages)


def _has_json_feature(feature):
    """Whether a feature is or holds datasets' ``Json`` type (its mixed-type columns; older datasets have no such
    type and fail on mixed columns themselves)."""
    try:
        from datasets import Json
    except ImportError:
        return False
    if isinstance(feature, Json):
        return True
    if isinstance(feature, dict):
        return any(_has_json_feature(value) for value in feature.values())
    if isinstance(feature, (list, tuple)):
        return any(_has_json_feature(value) for value in feature)
    inner = getattr(feature, "feature", None)
    return inner is not None and _has_json_feature(inner)


def _json_records(kind, path):
    """The records of a JSON/JSONL file as the json module reads them (the file was checked already). A .json of JSON
    Lines (``_starts_as_json_lines``: c4's shards) is read as JSON Lines, as its check reads it, not parsed whole
    first and failing."""
    with open_data_file(path, text_encoding(path)) as f:
        text = f.read()
    if kind == "json" and not _starts_as_json_lines(path):
        try:
            document = json.loads(text)
            return [document] if isinstance(document, dict) else document  # one JSON Lines record
        except json.JSONDecodeError:
            pass  # JSON Lines in a .json file (check_json_document accepted it)
    # "\n" only, as check_jsonl_lines reads the file: splitlines() would also split at U+2028, U+0085, ... which
    # JSON allows raw inside strings (ensure_ascii=False writes them so)
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def _as_written(kind, path, data, key_orders, hashed):
    """A JSON or JSON Lines file's ``data`` (datasets') with its columns of mixed types and those whose objects datasets
    reordered (``key_orders``, the file's as it was checked: ``_KeyOrders.reordered_columns``) as the file writes them
    (``_exact_json_dataset``); ``hashed``: the file's HashedFile, which ``data`` was loaded under."""
    mixed = any(_has_json_feature(feature) for feature in data.features.values())
    structs = [name for name, feature in data.features.items() if _holds_struct(feature)]
    if not mixed and not (structs and _json_type_available()):  # (a datasets without Json: as Arrow's, said there)
        return data
    # (the file is read again only where rebuilt: its key orders were gathered by its check's parse, and a large file
    # of messages was parsed a second time, whole or a line at a time, to look for a reordered object)
    reordered = key_orders.reordered_columns(data.features, structs)
    if not mixed and not reordered:
        return data
    return _exact_json_dataset(kind, path, data, also=reordered, hashed=hashed)


def _holds_struct(feature):
    """Whether a feature is or holds an Arrow struct (datasets' dict of features: a column of JSON objects)."""
    if isinstance(feature, dict):
        return True
    if isinstance(feature, (list, tuple)):
        return any(_holds_struct(value) for value in feature)
    inner = getattr(feature, "feature", None)
    return inner is not None and _holds_struct(inner)


# A list's items in a place of ``_KeyOrders`` (an object's keys are text, never None)
LIST_ITEM = None


class _KeyOrders:
    """The orders in which a JSON file's objects write their keys, column by column and place by place (the keys and
    list items that lead to an object), gathered by the parse that checks the file: ``reordered_columns`` says which
    columns datasets reordered, and a file of none is not parsed again.

    Arrow keeps one struct per column, its keys in the order it met them first: a later record's object of the same
    keys in another order came back in the first one's, so a tool call's arguments {"unit": "f", "city": "Rome"} were
    trained as {"city": "Rome", "unit": "f"} (``arguments | tojson``), and tool schemas' properties so too."""

    def __init__(self):
        self.orders = {}  # column -> {place: {the keys of an object there, in the order written}}

    def add(self, record):
        """The key orders of a parsed record's objects (its text, numbers and lists of them are passed over)."""
        for name, value in record.items():
            if isinstance(value, (dict, list)):
                self._add(self.orders.setdefault(name, {}), (), value)

    def _add(self, places, place, value):
        if isinstance(value, dict):
            places.setdefault(place, set()).add(tuple(value))
            for key, item in value.items():
                if isinstance(item, (dict, list)):
                    self._add(places, place + (key,), item)
        else:
            inside = place + (LIST_ITEM,)
            for item in value:
                if isinstance(item, (dict, list)):
                    self._add(places, inside, item)

    def as_json(self):
        """The orders gathered, as JSON ({column: [[place, [keys, ...]], ...]}: ``checked_json`` keeps them). A place's
        orders are sorted: a set's order follows how it was filled, so the process that checked a file and one that
        read the kept check would write the same orders in different orders."""
        return {name: [[list(place), [list(keys) for keys in sorted(orders)]] for place, orders in places.items()]
                for name, places in self.orders.items()}

    def add_kept(self, kept):
        """Gather the orders ``as_json`` wrote."""
        for name, places in kept.items():
            for place, orders in places:
                self.orders.setdefault(name, {}).setdefault(tuple(place), set()).update(map(tuple, orders))

    def reordered_columns(self, features, names):
        """The columns among ``names`` (of datasets' ``features``) of which an object writes its keys in another order
        than datasets keeps."""
        return {name for name in names for place, orders in self.orders.get(name, {}).items()
                if _keys_reordered(orders, _feature_at(features[name], place))}


def _feature_at(feature, place):
    """The feature of the objects at ``place`` (``_KeyOrders``) of a column of ``feature``, else None."""
    for step in place:
        if step is LIST_ITEM:  # (a list of structs: [feature] or a List/Sequence's .feature)
            listed = isinstance(feature, (list, tuple)) and feature
            feature = feature[0] if listed else getattr(feature, "feature", None)
        else:
            feature = feature.get(step) if isinstance(feature, dict) else None
        if feature is None:
            return None
    return feature


def _keys_reordered(orders, feature):
    """Whether one of the key ``orders`` of objects of a struct ``feature`` is not the struct's."""
    return isinstance(feature, dict) and any(list(keys) != _struct_keys_among(feature, set(keys)) for keys in orders)


def _struct_keys_among(feature, keys):
    return [key for key in feature if key in keys]


def _exact_json_dataset(kind, path, data, also=(), hashed=None):
    """The file's records with every value exactly as written, for a file with mixed-type columns (and the columns
    ``also``, of objects datasets reordered); ``data``: datasets' load of the file (its features: its columns, in its
    order); ``hashed``: the file's HashedFile where its load has it (else found here).

    For a column whose values have different types in different records (e.g. a string in most records and
    a number in one), datasets infers a ``Json`` feature, which stores a string that is itself valid JSON
    as that JSON: the string "1" comes back as the number 1, "null" as None. Such columns are rebuilt here
    from the json module's records, each value JSON-encoded, so strings stay strings and a bad value is
    reported at its own record.

    The columns rebuilt, and only they, are kept in datasets' cache (``Dataset.from_generator``, memory-mapped) under
    a key of the file's content, how it is read and dschat.data's code (``_exact_json_cache_key``), the others taken
    from datasets' load (``data``, kept in its cache already): the parse and the build, 5-9 s of each 7.5-14 s warm
    load of 100 MB of JSON Lines on 2 busy CPU cores (``bench/data_warm_load.py``), were made by every load, though
    the file's check and its datasets load were kept by its content; and kept whole, every column, the file was kept
    twice in datasets' cache (neither copy pruned). A file written while it is parsed keeps nothing
    (``_WrittenWhileParsed``). The dataset's own fingerprint is its rows' alone
    (``_exact_json_rows_fingerprint``): a hub download's (``hub_data_fingerprint``) is what a step's checkpoints
    record of its data, and one that changed with dschat.data's code had the finished steps trained on it trained
    again after an upgrade, as if the hub cache held another revision.
    """
    from datasets import Dataset, Features, Json

    exact = _exact_json_features(data.features, also)
    rebuilt = Features({name: feature for name, feature in exact.items() if isinstance(feature, Json)})
    hashed = hashed or file_digest_and_stamp(path)  # (a load's own, where given: the file not opened again)
    rows = functools.partial(_exact_json_rows, kind, path, rebuilt, hashed.stamp)
    fingerprint = _exact_json_rows_fingerprint(kind, path, hashed.sha256, exact)
    try:
        columns = Dataset.from_generator(rows, features=rebuilt, fingerprint=_exact_json_cache_key(fingerprint))
    except Exception as err:  # (datasets wraps what the generator raises)
        if not caused_by(err, _WrittenWhileParsed):
            raise
        # (written meanwhile, rarely: the file as it is now, parsed again, kept nowhere, every column of it: ``data``
        # is of the content before)
        return Dataset.from_list(list(_exact_json_rows(kind, path, exact, None)), features=exact)
    exact_data = _with_columns_of(data, columns)
    exact_data._fingerprint = fingerprint  # (its rows' alone, not datasets' ops': see above; maps cache in the key's
    # folder, by code too: ``_with_columns_of``)
    return exact_data


def _with_columns_of(data, columns):
    """``data`` with its columns that ``columns`` (a Dataset of as many rows) holds taken from ``columns``, in
    ``data``'s order. ``columns``' file is the first of its cache files: datasets' ``map`` caches in the first one's
    folder, under a fingerprint of the rows alone (``_exact_json_dataset``), and in ``data``'s folder (datasets' load,
    not keyed by dschat.data's code) a map of rows rebuilt by other code was served the old rows' result."""
    from datasets import concatenate_datasets

    joined = concatenate_datasets([columns, data.remove_columns(columns.column_names)], axis=1)
    return joined.select_columns(data.column_names)


def _exact_json_features(features, also):
    """datasets' ``features`` of a JSON file with its mixed-type columns and those of ``also`` as ``Json``: their
    values are JSON-encoded by ``_exact_json_rows``."""
    from datasets import Features, Json

    return Features({name: Json() if _has_json_feature(feature) or name in also else feature
                     for name, feature in features.items()})


class _WrittenWhileParsed(Exception):
    """The file was written while ``_exact_json_rows`` parsed it: its rows are not the content it was hashed as."""


def _exact_json_rows(kind, path, features, stamp):
    """The records of the JSON file at ``path`` as rows of ``features``' columns (``_exact_json_features``), a Json
    column's values JSON-encoded. ``stamp``: the file's where it was hashed (None: not compared); where it has another
    after the parse, _WrittenWhileParsed, before a row is given (kept under that hash, they would be another
    content's)."""
    from datasets import Json

    records = _json_records(kind, path)
    if stamp is not None and _stat_stamp(os.stat(path)) != stamp:
        raise _WrittenWhileParsed(path)
    encoded = {name for name, feature in features.items() if isinstance(feature, Json)}
    for record in records:
        yield {name: _json_text(record.get(name)) if name in encoded else record.get(name) for name in features}


def _json_text(value):
    return None if value is None else json.dumps(value, ensure_ascii=False)


def _exact_json_rows_fingerprint(kind, path, digest, features):
    """What the rows ``_exact_json_dataset`` rebuilds are made from: the file's content's sha256 (``digest``) and how it
    is read (its kind, its compression by name, the ``features`` rebuilt); not the code that makes them
    (``_exact_json_cache_key``), as a file's sha256 is what local data is recorded by."""
    key = json.dumps([kind, data_file_extensions(path)[1].lower(), digest, features.to_dict()], default=repr)
    return hashlib.sha256(key.encode()).hexdigest()


def _exact_json_cache_key(rows_fingerprint):
    """The fingerprint that ``_exact_json_dataset`` keeps a file's rebuilt records under in datasets' cache: their
    ``_exact_json_rows_fingerprint``, dschat.data's code and the versions of datasets and pyarrow that wrote them."""
    import datasets
    import pyarrow

    key = json.dumps([_data_code_digest(), datasets.__version__, pyarrow.__version__, rows_fingerprint])
    return hashlib.sha256(key.encode()).hexdigest()


def load_saved_dataset(path):
    """(train, eval or None) from a save_to_disk folder (DatasetDict or a single Dataset)."""
    from datasets import DatasetDict, load_from_disk

    # load_from_disk's FileNotFoundError would end the run in a traceback instead of a usage error
    if not os.path.exists(path):
        raise MissingInputError(f"{path} does not exist")
    if not _is_saved_dataset(path):
        raise DatasetFormatError(f"{path}: not a save_to_disk folder (it has no dataset_dict.json or state.json)")
    try:
        saved = load_from_disk(path)
    except FileNotFoundError as err:  # e.g. a data file of the save is missing
        raise DatasetFormatError(f"{path}: an incomplete save_to_disk folder: {_error_text(err)}") from err
    if not isinstance(saved, DatasetDict):
        return saved, None
    if "train" not in saved:
        raise DatasetFormatError(f"{path}: the saved DatasetDict has no 'train' split (it has {list(saved)})")
    eval_names = [name for name in EVAL_SPLIT_NAMES if name in saved]
    if len(eval_names) > 1:  # (a hub dataset's train/validation/test: the others were left out without a word)
        from dschat.utils.dist import print_rank_0

        print_rank_0(f"[dschat.data] {path}: evaluating on its {eval_names[0]!r} split; "
                     f"{' and '.join(map(repr, eval_names[1:]))} not read")
    return saved["train"], saved[eval_names[0]] if eval_names else None


def _lists_of_objects(data):
    """{column: value} of the lists of objects of a dataset of one record (a JSON object on one line), else {}."""
    if len(data) != 1:
        return {}
    return {name: value for name, value in data[0].items() if isinstance(value, list) and value and
            all(isinstance(item, dict) for item in value)}


def load_split_files(kind, paths):
    """(Dataset, record places) of a split's files: one file (``load_file``), or a split's shards read as one dataset,
    in their order, their records' places a ``ShardPlaces``."""
    if len(paths) == 1:
        return load_file(kind, paths[0])
    from datasets import concatenate_datasets

    parts = _json_columns_alike(kind, paths, [load_file(kind, path) for path in paths])
    try:
        data = concatenate_datasets([part for part, _ in parts])
    except ValueError as err:  # (columns or types that differ between the shards)
        data = _joined_with_text_alike([part for part, _ in parts])
        if data is None:
            raise DatasetFormatError(f"{files_where(paths)}: the shards of one split hold different columns or "
                                     f"types: {err}") from err
    return data, ShardPlaces(paths, [lines for _, lines in parts], [len(part) for part, _ in parts])


def _joined_with_text_alike(parts):
    """The shards joined with their text columns of one type (one tool writes text as large_string, another as
    string), else None."""
    from datasets import concatenate_datasets

    try:
        return concatenate_datasets([_large_strings_as_strings(part) for part in parts])
    except ValueError:
        return None


def _large_strings_as_strings(data):
    """``data`` with its text columns of arrow's large_string (pandas' to_parquet writes them so) as string (datasets'
    own): shards written by the two would not join."""
    from datasets import Features, Value

    large = {name: Value("string") for name, feature in data.features.items() if feature == Value("large_string")}
    return data.cast(Features({**data.features, **large})) if large else data


def _json_columns_alike(kind, paths, parts):
    """The shards' (data, lines) with a column of mixed types in any shard (datasets' ``Json`` feature,
    ``_exact_json_dataset``) read so in every one: one number among a shard's strings made its column Json there and
    string in the others, and the shards would not join ("the features can't be aligned") where the record holding
    it is its record's error, as in one file. So too a column of objects whose structs differ between the shards (in
    their keys' order alone, the shards joined in the first one's: ``_KeyOrders``)."""
    mixed = {name for part, _ in parts for name, feature in part.features.items() if _has_json_feature(feature)}
    mixed |= _structs_differing(part for part, _ in parts)
    if not mixed or kind not in ("json", "jsonl"):
        return parts
    return [(part if all(_has_json_feature(part.features[name]) for name in mixed if name in part.features) else
             _exact_json_dataset(kind, path, part, also=mixed), lines)
            for path, (part, lines) in zip(paths, parts)]


def _structs_differing(datasets):
    """The struct columns whose Arrow types differ between ``datasets`` (a struct's type has its keys' order, which
    datasets' feature dicts compare without)."""
    types = {}
    for data in datasets:
        for name, feature in data.features.items():
            if _holds_struct(feature):
                types.setdefault(name, set()).add(str(data.data.schema.field(name).type))
    return {name for name, kinds in types.items() if len(kinds) > 1}


class ShardPlaces:
    """Where the records of a split read from several shard files are: record I of the whole is record I - (the
    records of the shards before) of its shard, and its errors name that file and line."""

    def __init__(self, paths, lines, sizes):
        self.paths, self.lines = paths, lines
        self.starts = [sum(sizes[:number]) for number in range(len(sizes))]

    def where(self, index):
        from bisect import bisect_right

        number = bisect_right(self.starts, index) - 1
        return record_where(self.paths[number], index - self.starts[number], self.lines[number])


def record_where(path, index, record_lines):
    """"FILE line N (record I)" where the line of record I is known, else "FILE record I" (a split in shards: the
    shard's, ``ShardPlaces``)."""
    if isinstance(record_lines, ShardPlaces):
        return record_lines.where(index)
    return f"{path} line {record_lines[index]} (record {index})" if record_lines else f"{path} record {index}"


def keeps_nulls(source):
    """Whether the files of ``source`` give back the nulls in a record's objects as written, and none that it lacks:
    JSON and JSON Lines (datasets reads a column of objects whose keys differ between records as its Json type,
    ``_exact_json_dataset``: exactly) and CSV (text); not parquet or save_to_disk folders, whose Arrow structs give back
    a key another record's object has as null (``without_none_values``), nor JSON read by a datasets without the Json
    type (as structs too). A source mixing them (train.jsonl beside eval.parquet) is read as Arrow's."""
    kinds = {source.kind, source.eval_type}
    return kinds <= {"csv"} or (kinds <= {"json", "jsonl", "csv"} and _json_type_available())


def _json_type_available():
    try:
        from datasets import Json  # noqa: F401
    except ImportError:
        return False
    return True
