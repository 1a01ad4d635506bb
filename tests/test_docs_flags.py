"""The flags README.md and the docs' instructions name are dschat's: a flag renamed or dropped in a parser (a step's,
train.py's, a tool's) left the docs telling users to type one that fails at its first parse. bench/*.py commands are
checked against their scripts in test_bench_commands.py."""
import argparse
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# docs whose commands run dschat's own scripts (docs/benchmarks.md and docs/scaling.md quote bench/*.py's)
DOCS = ("README.md", "docs/tiny_default.md", "docs/rank_change_resume.md")
# other programs' flags the docs quote (pytest-xdist's, hf download's, the deepspeed launcher's) and placeholders
NOT_DSCHATS = {"--dist", "--maxprocesses", "--repo-type", "--local-dir", "--num_gpus", "--FLAG", "--stepN-args"}
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def train_py_parser(monkeypatch):
    """train.py's parser, which its parse_args builds and parses with at once."""
    from dschat.args import SaidOnceParser

    monkeypatch.syspath_prepend(str(REPO))
    import train

    built = {}

    def keep(parser, *args, **kwargs):
        built["parser"] = parser
        raise SystemExit(0)

    monkeypatch.setattr(SaidOnceParser, "parse_known_args", keep)
    try:
        train.parse_args([])
    except SystemExit:
        pass
    return built["parser"]


def dschat_flags(monkeypatch):
    from dschat import args
    from dschat.tools import chat, ppo_eval, prompt_eval, rw_eval

    parsers = [args.step1_parser(), args.step2_parser(), args.step2_dpo_parser(), args.step3_parser(),
               chat.build_parser(), ppo_eval.build_parser(), prompt_eval.build_parser(), rw_eval.build_parser(),
               train_py_parser(monkeypatch)]
    return {option for parser in parsers for action in parser._actions
            if not isinstance(action, argparse._HelpAction) for option in action.option_strings}


def test_every_flag_the_docs_name_is_one_of_dschats(monkeypatch):
    known = dschat_flags(monkeypatch)
    unknown = [f"{doc}:{number}: {flag}" for doc in DOCS
               for number, line in enumerate((REPO / doc).read_text().splitlines(), 1)
               for flag in FLAG.findall(line) if flag not in known and flag not in NOT_DSCHATS]
    assert not unknown, unknown
