"""The flags README.md and the docs' instructions name are dschat's: a flag renamed or dropped in a parser (a step's,
train.py's, a tool's) left the docs telling users to type one that fails at its first parse. bench/*.py commands are
checked against their scripts in test_bench_commands.py."""
import argparse
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# docs whose commands run dschat's own scripts (docs/benchmarks.md and docs/scaling.md quote bench/*.py's)
DOCS = ("README.md", "docs/models.md", "docs/tiny_default.md", "docs/rank_change_resume.md")
# other programs' flags the docs quote (pytest-xdist's, hf download's, the deepspeed launcher's) and placeholders
NOT_DSCHATS = {"--dist", "--maxprocesses", "--repo-type", "--local-dir", "--include", "--num_gpus", "--FLAG",
               "--stepN-args"}
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


# The command lines the docs show (README's ``` blocks, the docs' indented ones), each parsed by the parser of the
# script it runs: the test above finds a flag in any of dschat's parsers, so a command giving chat.py a flag of
# prompt_eval's, or step 3's flag to --step1-args, passed it and failed at its user's first parse.
SCRIPT_PARSERS = {"chat.py": ("dschat.tools.chat", "build_parser"),
                  "training/step3_ppo/eval.py": ("dschat.tools.ppo_eval", "build_parser"),
                  "training/step2_rm/rw_eval.py": ("dschat.tools.rw_eval", "build_parser"),
                  "training/step1_sft/prompt_eval.py": ("dschat.tools.prompt_eval", "build_parser"),
                  "training/step1_sft/main.py": ("dschat.args", "step1_parser"),
                  "training/step2_rm/main.py": ("dschat.args", "step2_parser"),
                  "training/step2_dpo/main.py": ("dschat.args", "step2_dpo_parser"),
                  "training/step3_ppo/main.py": ("dschat.args", "step3_parser")}
SHELL_VARIABLE = re.compile(r"\$(\w+)")


def command_blocks(text):
    """The lines of each ``` block and each indented block of ``text``, joined over backslash line ends."""
    blocks, block, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            if block and block[-1].endswith("\\"):
                block[-1] = block[-1][:-1] + " " + line.strip()
            else:
                block.append(line.strip())
            continue
        if block:
            blocks.append(block)
        block = []
    return blocks + [block] if block else blocks


def documented_commands(text):
    """(script, its arguments) of each `python SCRIPT` / `deepspeed [launcher flags] SCRIPT` command of ``text``'s
    blocks, with a block's VAR="..." settings put in for $VAR (other variables: a placeholder value); a command with
    an elided part ("...", "<step's main.py>") is left out, and "[--optional flags]" are taken as given."""
    for block in command_blocks(text):
        settings = {}
        for line in block:
            assignment = re.fullmatch(r'(\w+)="(.*)"', line)
            if assignment:
                settings[assignment[1]] = assignment[2]
                continue
            for command in line.split("&&"):
                command = SHELL_VARIABLE.sub(lambda m: settings.get(m[1], "PLACEHOLDER"), command.strip())
                if not command.startswith(("python ", "deepspeed ")) or "<" in command:
                    continue
                words = shlex.split(command.replace("[", "").replace("]", ""), comments=True)
                if "..." in words:
                    continue
                script = next((word for word in words if word.endswith(".py")), None)
                if script:
                    yield script, words[words.index(script) + 1:]


def parse_error(parse, argv, capsys):
    """argparse's error message for ``argv``, or None where ``parse`` takes it."""
    try:
        parse(argv)
    except SystemExit as stop:
        return capsys.readouterr().err.strip().splitlines()[-1] if stop.code else None
    return None


def test_every_documented_command_parses_with_its_own_script(monkeypatch, capsys):
    import importlib

    from dschat.pipeline import recipe_steps, step_extra_args, step_parser

    monkeypatch.syspath_prepend(str(REPO))
    import train

    failures, scripts = [], set()
    for doc in DOCS:
        for script, argv in documented_commands((REPO / doc).read_text()):
            scripts.add(script)
            if script == "train.py":
                error = parse_error(train.parse_args, argv, capsys)
                if error is None:  # each --stepN-args string by its step's parser
                    args = train.parse_args(argv)
                    for step in recipe_steps(args.recipe, args.step)[0]:
                        error = error or parse_error(step_parser(step, args.recipe)().parse_args,
                                                     step_extra_args(step, args), capsys)
            else:
                module, factory = SCRIPT_PARSERS[script]
                error = parse_error(getattr(importlib.import_module(module), factory)().parse_args, argv, capsys)
            if error:
                failures.append(f"{doc}: {script} {shlex.join(argv)}: {error}")
    assert not failures, failures
    assert scripts == {"train.py", *SCRIPT_PARSERS}, scripts  # (every entry point's commands were found and parsed)


def is_said_default(default):
    """A default --help should say: not a switch's (a bool), nor none. By type, since 0 == False and 1 == True."""
    return default is not None and not isinstance(default, bool) and not (isinstance(default, (list, str))
                                                                          and not default)


def test_each_tool_flag_says_its_default_in_its_help(monkeypatch):
    """train.py's and a tool's --help give each flag's default (ppo_eval's --num_prompts, --seed, ... come from the
    policy's run, else the parser's): eval.py's --num_prompts, rw_eval's --num_pairs, train.py's --actor-model and
    others printed none, so what a flag left out meant could not be read off --help. (A default of 0 or 1 was
    skipped as if a switch's: it compared equal to False or True; rw_eval's --num_padding_at_beginning said none.)"""
    from dschat.tools import chat, ppo_eval, prompt_eval, rw_eval

    parsers = {"train.py": train_py_parser(monkeypatch), **{tool.__name__: tool.build_parser()
                                                            for tool in (chat, ppo_eval, prompt_eval, rw_eval)}}
    unsaid = [f"{name}: {action.option_strings[-1]}" for name, parser in parsers.items() for action in parser._actions
              if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
              and is_said_default(action.default) and "default" not in action.help.lower()]
    assert not unsaid, unsaid
    run_defaults = {action.option_strings[-1]: action.help for action in ppo_eval.build_parser()._actions
                    if action.dest in (*ppo_eval.STEP3_DATA_FLAGS, "num_prompts", "max_new_tokens")}
    assert all("the policy's run's" in run_defaults[flag] for flag in
               ("--data_path", "--data_split", "--seed", "--num_prompts", "--max_new_tokens",
                "--max_prompt_seq_len", "--per_device_generation_batch_size")), run_defaults


def test_each_step_flag_says_its_default_in_its_help():
    """The steps' --help gives each flag's default (a switch's, off, aside): --learning_rate, --seed, --output_dir and
    others printed none; one whose help says it already is not said twice."""
    from dschat import args

    for factory in (args.step1_parser, args.step2_parser, args.step2_dpo_parser, args.step3_parser):
        parser = factory()
        formatter = parser._get_formatter()
        for action in parser._actions:
            if (action.help != argparse.SUPPRESS and action.default not in (None, argparse.SUPPRESS, "", [])
                    and not isinstance(action.default, bool)):
                said = formatter._get_help_string(action) % {**vars(action), "prog": parser.prog}
                assert said.lower().count("default") >= 1, (factory.__name__, action.option_strings, said)
    help_text = " ".join(args.step1_parser().format_help().split())
    assert "Peak learning rate. (default: 0.001)" in help_text and "(default: output/step1_sft)" in help_text
    assert "(default: tiny)" in help_text  # (a list default as written on the command line)
