"""The command lines that README.md, docs/*.md and the scripts' own docstrings quote for bench/*.py and
tests/scripts/*.py: each names flags, variants, model shapes, checks and cases that the script's parser takes. A flag
or variant renamed in a script leaves the docs' commands failing at their first parse, found only on a device call;
plot.py's commands name result files that must be there, and be bench/generation.py's."""
import argparse
import ast
import glob
import importlib
import itertools
import re
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
BENCH = REPO / "bench"
FOLDERS = {"bench": BENCH, "tests/scripts": REPO / "tests" / "scripts"}

# a launcher (with its own options and environment variables before it), then bench/<script>.py and its arguments
LAUNCHER = r"(?:\w+=\S*\s+)*(?:python3?|torchrun|deepspeed)(?:\s+--?[\w-]+(?:[ =](?:\d+|\{[\d,]+\}))?)*"
COMMAND = re.compile(rf"(?<![\w/.]){LAUNCHER}\s+(bench|tests/scripts)/(\w+)\.py(?![\w.])(.*)")
# where a quoted command ends: a comment, a table cell, a second command, a redirection, prose in parentheses
COMMAND_END = re.compile(r"\s#|[|;`]|&&|\s\d?>|\s\(")


def snippets(path):
    """(line number, text) of the code in ``path``: a Markdown file's indented code blocks and inline code (which
    may run over a line break), a script's module docstring; continuation lines joined."""
    text = path.read_text()
    if path.suffix == ".py":
        docstring = ast.get_docstring(ast.parse(text), clean=False) or ""
        start = text.index(docstring.splitlines()[0]) if docstring else 0
        first_line = text.count("\n", 0, start) + 1
        lines = [(first_line + i, line) for i, line in enumerate(docstring.splitlines())]
    else:
        lines = [(text.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " "))
                 for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text)]
        lines += [(i + 1, line) for i, line in enumerate(text.splitlines()) if line.startswith("    ")]
    joined, pending = [], None
    for number, line in lines:
        if pending is not None:
            number, line = pending[0], pending[1] + " " + line.strip()
        if line.endswith("\\"):
            pending = (number, line[:-1])
            continue
        pending = None
        joined.append((number, line))
    return joined


def expansions(word):
    """A word with ``{a,b}`` alternatives as the shell expands it: each alternative in turn."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if not m:
        return [word]
    return [w for alternative in m.group(1).split(",")
            for w in expansions(word[:m.start()] + alternative + word[m.end():])]


def argvs(script, rest):
    """The argument lists a quoted command stands for: usage notation dropped (``...``, the brackets of an optional
    part and an upper-case placeholder inside them: ``[CHECK ...]``; ``--out DIR`` stays, DIR a value).
    plot.py's braces name several files (the shell's expansion); elsewhere, e.g. ``--tp {1,2,4,8}``, they are
    alternatives, one command each."""
    words = [(w.strip("[]"), w != w.strip("[]")) for w in shlex.split(COMMAND_END.split(rest)[0])]
    words = [w for w, optional in words if w not in ("", "...") and not (optional and re.fullmatch(r"[A-Z_]+", w))]
    if script == "plot":
        return [[w for word in words for w in expansions(word)]]
    return [list(argv) for argv in itertools.product(*(expansions(word) for word in words))]


def quoted_commands():
    sources = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
               *(path for folder in FOLDERS.values() for path in sorted(folder.glob("*.py")))]
    found = {}
    for path in sources:
        for number, line in snippets(path):
            for m in COMMAND.finditer(line):
                script = f"{m.group(1)}/{m.group(2)}"
                for argv in argvs(m.group(2), m.group(3)):
                    found.setdefault((script, tuple(argv)), f"{path.relative_to(REPO)}:{number}")
    return [(where, script, list(argv)) for (script, argv), where in found.items()]


COMMANDS = quoted_commands()


class Parsed(Exception):
    pass


def script_module(script, monkeypatch):
    """``script``, e.g. "bench/plot", imported from its folder."""
    folder, name = script.rsplit("/", 1)
    monkeypatch.syspath_prepend(str(FOLDERS[folder]))
    return importlib.import_module(name)


def parse(script, argv, monkeypatch, capsys):
    """The script's own parsing of ``argv`` (its main, stopped once its parser has read the arguments): the parsed
    arguments, or the parser's error."""
    module = script_module(script, monkeypatch)
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    try:
        if script == "bench/graph_equality":  # (its check and family names are checked after the parser's read)
            monkeypatch.setattr(argparse.ArgumentParser, "parse_args", original)
            return module.parse_checks(argv)
        module.main()
    except Parsed as parsed:
        return parsed.args[0]
    except SystemExit as error:
        pytest.fail(f"{script}.py {shlex.join(argv)}: {capsys.readouterr().err.strip() or error}")
    pytest.fail(f"{script}.py read no arguments with argparse")


def test_the_docs_quote_commands_of_every_benchmark_they_describe():
    """(the extraction itself: a change of the docs' layout that hid their commands would pass the test below)"""
    scripts = {script for _, script, _ in COMMANDS}
    assert {f"bench/{name}" for name in ("generation", "ppo_iteration", "tensor_parallel", "graph_equality", "plot",
                                         "decode_attention", "sampling", "logprob_delta")} <= scripts, scripts
    assert {"tests/scripts/pipeline_gpu", "tests/scripts/mixed_precision_lora_gpu"} <= scripts, scripts
    assert len(COMMANDS) > 100
    # (docs/scaling.md's inline `torchrun --nproc_per_node {4,8} ... --tp {1,2,4,8} ...`: one command per --tp)
    assert ("bench/tensor_parallel", ["--model", "opt-30b", "--batches", "16", "--stages", "3", "--tp", "8", "--graph",
                                      "1", "--repeats", "1"]) in [(script, argv) for _, script, argv in COMMANDS]


# The tenth session's variant options, renamed since: its commands stay as run (the doc says what they are now), and
# generation.py's error names the new spelling. Likewise a script renamed since (the doc says so where it is quoted).
RENAMED = {"holes0", "holes2"}
RENAMED_SCRIPTS = {"tests/scripts/align_overflow_gpu": "tests/scripts/align_overflow_fp16"}


@pytest.mark.parametrize("where, script, argv", COMMANDS, ids=[f"{w} {s}" for w, s, _ in COMMANDS])
def test_a_quoted_command_names_flags_and_names_its_script_takes(where, script, argv, monkeypatch, capsys):
    script = RENAMED_SCRIPTS.get(script, script)
    if script == "bench/generation" and any(f"_{old}" in word for word in argv for old in RENAMED):
        with pytest.raises(pytest.fail.Exception, match=r"_holes\d is now"):
            parse(script, argv, monkeypatch, capsys)
        return
    args = parse(script, argv, monkeypatch, capsys)
    if script == "tests/scripts/pipeline_gpu":  # (checked after its parser's read)
        cases = script_module(script, monkeypatch).CASES
        assert set(args.cases.split(",")) <= set(cases), f"{where}: pipeline_gpu.py has the cases {cases}"
    if script == "bench/plot":  # the result files are there, and generation.py's (a glob matching none: an error too)
        plot = script_module(script, monkeypatch)
        paths = [path for pattern in args.results for path in sorted(glob.glob(str(REPO / pattern)))]
        assert len(paths) >= len(args.results), f"{where}: no file for one of {args.results}"
        assert plot.load_rows(paths, set(filter(None, args.skip.split(",")))), where
