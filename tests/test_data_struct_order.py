"""JSON objects read as written: Arrow keeps one struct per column, its keys in the order it met them first."""
import json

import pytest

from dschat.data.local import LocalDataset
from dschat.data.sources import resolve_local_spec


def call(arguments):
    return {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def schema(properties):
    return {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {name: {"type": "string"} for name in properties}}}}


def record(question, arguments):
    """A function-calling record whose messages have the same keys in every record (one Arrow struct)."""
    return {"messages": [{"role": "user", "content": question, "tool_calls": None},
                         {"role": "assistant", "content": "", "tool_calls": [call(arguments)]}],
            "tools": [schema(list(arguments))]}


def read(tmp_path, kind, rows):
    path = tmp_path / f"calls.{kind}"
    text = json.dumps(rows) if kind == "json" else "".join(json.dumps(row) + "\n" for row in rows)
    path.write_text(text)
    raw = LocalDataset(resolve_local_spec(f"{kind}:{path}"), None, 0, -1, {})
    return raw, list(raw.raw_datasets["train"])


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_objects_whose_keys_another_record_orders_otherwise_are_read_as_written(tmp_path, kind):
    """A later record's call arguments {"unit", "city"} came back in the first one's order {"city", "unit"} (and its
    tool schema's properties so): the chat template writes them (``arguments | tojson``) in the order it gets them,
    so the model trained on a call the file does not hold."""
    rows = [record("Weather in Paris?", {"city": "Paris", "unit": "c"}),
            record("Weather in Rome, in F?", {"unit": "f", "city": "Rome"})]
    raw, samples = read(tmp_path, kind, rows)
    answer = raw.get_chosen_text(samples[1])  # (the call itself: the trained answer)
    assert list(answer.tool_calls[0]["function"]["arguments"]) == ["unit", "city"]
    assert list(raw.get_tools(samples[1])[0]["function"]["parameters"]["properties"]) == ["unit", "city"]
    assert list(raw.get_tools(samples[0])[0]["function"]["parameters"]["properties"]) == ["city", "unit"]
    assert samples[0]["messages"][0]["tool_calls"] is None  # (the nulls as written: none added, none dropped)


def test_objects_of_one_key_order_stay_datasets_own_columns(tmp_path):
    rows = [record("Weather in Paris?", {"city": "Paris", "unit": "c"}),
            record("Weather in Rome?", {"city": "Rome", "unit": "f"})]
    raw, samples = read(tmp_path, "jsonl", rows)
    from datasets import Json

    assert not any(isinstance(feature, Json) for feature in raw.raw_datasets["train"].features.values())
    assert list(samples[1]["messages"][1]["tool_calls"][0]["function"]["arguments"]) == ["city", "unit"]


def test_shards_whose_objects_order_their_keys_otherwise_are_read_as_written(tmp_path):
    """A split in shards, each of one key order: the shards were joined in the first one's order."""
    folder = tmp_path / "download" / "data"
    folder.mkdir(parents=True)
    for name, row in (("train-00000-of-00002", record("Paris?", {"city": "Paris", "unit": "c"})),
                      ("train-00001-of-00002", record("Rome?", {"unit": "f", "city": "Rome"})),
                      ("test-00000-of-00001", record("Oslo?", {"city": "Oslo", "unit": "c"}))):
        (folder / f"{name}.jsonl").write_text(json.dumps(row) + "\n")
    raw = LocalDataset(resolve_local_spec(f"jsonl:{tmp_path / 'download'}"), None, 0, -1, {})
    calls = [raw.get_chosen_text(sample).tool_calls for sample in raw.raw_datasets["train"]]
    assert [list(call[0]["function"]["arguments"]) for call in calls] == [["city", "unit"], ["unit", "city"]]


def test_a_jsonl_file_of_objects_is_searched_for_reordered_keys_a_line_at_a_time(tmp_path, monkeypatch):
    """Every JSON Lines file with a column of objects (messages) was read whole a second time, as the json module's
    objects, to look for a reordered one: a large file of messages held its records twice over in memory (beside
    the text and its lines) where datasets' own columns were kept. It is read a line at a time now; only a file
    with a reordered object (or a column of mixed types) is read whole, to be rebuilt."""
    from dschat.data import reading

    def read_whole(kind, path):
        raise AssertionError(f"{path} read whole")

    monkeypatch.setattr(reading, "_json_records", read_whole)
    same = [record("Weather in Paris?", {"city": "Paris", "unit": "c"}),
            record("Weather in Rome?", {"city": "Rome", "unit": "f"})]
    _, samples = read(tmp_path, "jsonl", same)
    assert list(samples[1]["messages"][1]["tool_calls"][0]["function"]["arguments"]) == ["city", "unit"]

    monkeypatch.undo()  # (a reordered one: read whole and rebuilt, as written)
    other = [same[0], record("Weather in Rome, in F?", {"unit": "f", "city": "Rome"})]
    raw, samples = read(tmp_path, "jsonl", other)
    assert list(raw.get_chosen_text(samples[1]).tool_calls[0]["function"]["arguments"]) == ["unit", "city"]


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_a_json_file_of_objects_is_parsed_once_where_no_object_is_reordered(tmp_path, monkeypatch, kind):
    """The key-order search parsed every JSON file with a column of objects (messages) a second time after its check
    had parsed it (a JSON Lines file a line at a time, a .json file whole): the check gathers the key orders in its
    own parse now. A file with a reordered object is still read again, to be rebuilt as written."""
    from dschat.data import reading

    parsed = []

    class CountingJson:
        def __getattr__(self, name):
            return getattr(json, name)

        def loads(self, text, **options):
            parsed.append(text.strip())
            return json.loads(text, **options)

    monkeypatch.setattr(reading, "json", CountingJson())
    same = [record("Weather in Paris?", {"city": "Paris", "unit": "c"}),
            record("Weather in Rome?", {"city": "Rome", "unit": "f"})]
    _, samples = read(tmp_path, kind, same)
    written = (tmp_path / f"calls.{kind}").read_text().strip()
    assert parsed == (written.split("\n") if kind == "jsonl" else [written])
    assert list(samples[1]["messages"][1]["tool_calls"][0]["function"]["arguments"]) == ["city", "unit"]

    parsed.clear()  # (a reordered one deep inside: found by the one parse, then read again and rebuilt)
    other = [same[0], record("Weather in Rome, in F?", {"unit": "f", "city": "Rome"})]
    raw, samples = read(tmp_path, kind, other)
    assert len(parsed) > (2 if kind == "jsonl" else 1)
    assert list(raw.get_chosen_text(samples[1]).tool_calls[0]["function"]["arguments"]) == ["unit", "city"]
    assert list(raw.get_chosen_text(samples[0]).tool_calls[0]["function"]["arguments"]) == ["city", "unit"]


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_records_without_an_object_inside_are_not_walked_for_key_orders(tmp_path, monkeypatch, kind):
    """A flat file's records (text, numbers, lists of them) hold no object whose keys datasets could reorder: walking
    each one for its key orders cost ~10% of reading a flat file (50k records). Only a record with an object inside
    is walked (a .json array's records, where one has), and one reordered among flat records still reads as written."""
    from dschat.data import reading

    walked = []
    add = reading._KeyOrders.add
    monkeypatch.setattr(reading._KeyOrders, "add", lambda self, row: (walked.append(row), add(self, row))[1])
    flat = [{"prompt": f"Question {i}?", "chosen": f"Yes {i}.", "tags": ["a", ["b"]], "score": i} for i in range(3)]
    path = tmp_path / f"flat.{kind}"
    path.write_text(json.dumps(flat) if kind == "json" else "".join(json.dumps(row) + "\n" for row in flat))
    data, _ = reading.load_file(kind, str(path))
    assert walked == [] and data[2]["prompt"] == "Question 2?"

    rows = flat + [{**flat[0], "meta": {"city": "Paris", "unit": "c"}},
                   {**flat[1], "meta": {"unit": "f", "city": "Rome"}}]
    path.write_text(json.dumps(rows) if kind == "json" else "".join(json.dumps(row) + "\n" for row in rows))
    data, _ = reading.load_file(kind, str(path))
    assert walked == (rows[3:] if kind == "jsonl" else rows)  # (a .json array's objects are counted as a whole)
    assert list(data[4]["meta"]) == ["unit", "city"] and list(data[3]["meta"]) == ["city", "unit"]
