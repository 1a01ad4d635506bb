"""Edge cases of the tools for trained models (chat.py, rw_eval, ppo_eval) met after training."""
import json
import re
import shutil
from pathlib import Path
from unittest import mock

import pytest

from dschat.errors import MissingInputError, UsageError
from dschat.tools.common import find_policy_path, find_reward_model_path


def _model_folder(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("text", ['{"policy": "step1', "[1, 2]"])
def test_a_damaged_report_json_is_an_error_naming_it_not_a_traceback(tmp_path, text):
    """A run folder whose report.json is cut short or edited into no object: chat.py, prompt_eval, ppo_eval and rw_eval
    failed with json's JSONDecodeError (or AttributeError) traceback."""
    _model_folder(tmp_path / "step1_sft")
    (tmp_path / "report.json").write_text(text)
    for find in (find_policy_path, find_reward_model_path):
        with pytest.raises(UsageError, match="report.json"):
            find(str(tmp_path))


@pytest.mark.parametrize("value", [3, ["/tmp/rm"], {"path": "/tmp/rm"}])
def test_a_report_json_whose_reward_model_is_no_string_is_an_error_naming_it(tmp_path, value):
    """A hand-edited report.json whose "reward_model" is a number, list or object ended in os.path's TypeError."""
    _model_folder(tmp_path / "step2_rm")
    (tmp_path / "report.json").write_text(json.dumps({"reward_model": value}))
    with pytest.raises(UsageError, match=r'report.json: its "reward_model" is'):
        find_reward_model_path(str(tmp_path))


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A tiny reward model saved the way step 2 saves it."""
    import torch

    from dschat.models.checkpoint import save_reward_model
    from dschat.models.loading import load_tokenizer
    from dschat.models.reward_model import create_critic_model
    from dschat.tiny.presets import create_tiny_model

    root = tmp_path_factory.mktemp("edge_models")
    policy = create_tiny_model("tiny-llama", root / "policy")
    torch.manual_seed(0)
    save_reward_model(create_critic_model(policy, None), load_tokenizer(policy), str(root / "rm"))
    return str(root / "rm")


def test_a_tiny_preset_given_as_the_reward_model_is_refused_with_its_flag_before_any_model_loads(reward_model,
                                                                                                   monkeypatch):
    """ppo_eval --reward_model tiny-opt loaded the policy (and rw_eval its tokenizer) before "tiny-opt: not a reward
    model", an error that named no flag: a preset's folder was checked only once the model loaded, as a hub name's."""
    from dschat.tools import ppo_eval, rw_eval

    for tool in (ppo_eval, rw_eval):
        monkeypatch.setattr(tool, "load_scoring_reward_model", lambda *a, **k: pytest.fail("a model loaded first"))
    monkeypatch.setattr(ppo_eval, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    monkeypatch.setattr("dschat.models.loading.load_tokenizer", lambda *a, **k: pytest.fail("a tokenizer loaded"))
    policy = str(Path(reward_model).parent / "policy")
    with pytest.raises(UsageError, match="^--reward_model tiny-opt: not a reward model"):
        ppo_eval.main(["--policy", policy, "--reward_model", "tiny-opt"])
    with pytest.raises(UsageError, match="^--model_name_or_path tiny-llama: not a reward model"):
        rw_eval.main(["--model_name_or_path", "tiny-llama", "--prompt", "Say hi.", "--answer", "hi"])


def test_rw_eval_counts_a_tie_half_and_says_so(reward_model, tmp_path, capsys, monkeypatch):
    """Scores alike (an untrained head) were an accuracy of 0.000, as if the model always preferred the rejected
    answer, and each pair's "higher: rejected"."""
    from dschat.tools import rw_eval

    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps({"prompt": "Name a color.", "chosen": c, "rejected": r}) + "\n"
                                  for c, r in (("red", "blue"), ("green", "no"))))
    monkeypatch.setattr(rw_eval, "score_sequences", lambda model, tokenizer, sequences, batch_size:
                        [0.25] * len(sequences))
    result = rw_eval.main(["--model_name_or_path", reward_model, "--pairs_file", str(pairs_file)])
    assert result["accuracy"] == 0.5 and result["ties"] == 2
    out = capsys.readouterr().out
    assert "higher: neither (a tie)" in out and "accuracy 0.500 over 2 pairs (2 tied, each counted half)" in out


def test_rw_eval_with_every_pair_skipped_reports_no_accuracy_rather_than_zero(reward_model, tmp_path, capsys):
    """Prompts too long for --max_seq_len: every pair is skipped, and rw_eval printed "accuracy 0.000 over 0 pairs;
    mean score chosen +0.0000, rejected +0.0000", a model that is always wrong; step 2 reports no score then."""
    from dschat.tools import rw_eval

    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text(json.dumps({"prompt": "Name three colors. " * 10, "chosen": "RED", "rejected": "red"}) + "\n")
    result = rw_eval.main(["--model_name_or_path", reward_model, "--pairs_file", str(pairs_file),
                           "--max_seq_len", "16"])
    assert result["pairs"] == [] and result["skipped"] == {"prompt too long": 1}
    assert result["accuracy"] is None and result["chosen_mean_score"] is None
    out = capsys.readouterr().out
    assert "accuracy 0.000" not in out
    assert "no pairs scored, so no accuracy; skipped as in step 2: 1 prompt too long" in out


def test_ppo_eval_checks_its_output_json_path_before_any_model_loads(tmp_path, monkeypatch):
    """--output_json naming a folder (or a path through a file) failed with IsADirectoryError / FileExistsError
    after every policy had been evaluated, the results unsaved."""
    from dschat.tools import ppo_eval

    def no_evaluation(*args, **kwargs):
        raise AssertionError("evaluated before the --output_json path was checked")

    monkeypatch.setattr(ppo_eval, "evaluate_model", no_evaluation)
    monkeypatch.setattr(ppo_eval, "check_reward_model_reads", lambda *a: None)  # (the stub folders hold no tokenizer)
    policy, rm = _model_folder(tmp_path / "policy"), _model_folder(tmp_path / "rm")
    (rm / "value_head.safetensors").write_bytes(b"")  # (what marks a reward model's folder)
    (tmp_path / "a_file").write_text("")
    for path, said in ((tmp_path, "a folder; give a file to write"), (tmp_path / "a_file" / "eval.json", "is a file")):
        with pytest.raises(UsageError, match=f"--output_json .*{said}"):
            ppo_eval.main(["--policy", str(policy), "--reward_model", str(rm), "--output_json", str(path)])
    with pytest.raises(AssertionError, match="evaluated before"):  # a new file in new folders is fine
        ppo_eval.main(["--policy", str(policy), "--reward_model", str(rm),
                       "--output_json", str(tmp_path / "new" / "eval.json")])


def test_a_mistyped_tiny_preset_given_to_a_tool_is_an_error_at_once():
    """chat.py --path tiny-lama (prompt_eval's, rw_eval's, ppo_eval's model flags too) went to the hub: offline, a
    minute of retries, then "no such folder here, and loading it as a Hugging Face hub name failed"; the training
    steps say at once that no preset is named so."""
    from dschat.tools.common import flag_path

    with pytest.raises(UsageError, match=r"^--path tiny-lama: no such tiny preset \(they are tiny-llama, "):
        flag_path("--path", find_policy_path, "tiny-lama")
    with pytest.raises(UsageError, match="dschat/tiny-gtp2: no such tiny preset"):
        find_reward_model_path("dschat/tiny-gtp2")
    assert find_policy_path("tiny-llama") == "tiny-llama" and find_policy_path("dschat/tiny-opt") == "dschat/tiny-opt"


def test_a_hub_name_not_in_the_cache_given_to_a_tool_offline_is_an_error_at_once():
    """chat.py --path facebook/opt-1.3bb (a typo) with no network and HF_HUB_OFFLINE unset waited 48 s through the hub
    client's retries; offline (HF_HUB_OFFLINE=1, the tests'), the name is said with the flag before anything loads."""
    from dschat.tools.common import flag_path

    with pytest.raises(UsageError, match=r"^--path acme/opt-1\.3bb: no such folder here, nor a model of that name in "
                                         r"the Hugging Face hub cache, and HF_HUB_OFFLINE is set"):
        flag_path("--path", find_policy_path, "acme/opt-1.3bb")
    with pytest.raises(UsageError, match=r"^--reward_model acme/rm: no such folder here"):
        flag_path("--reward_model", find_reward_model_path, "acme/rm")


def test_ppo_eval_scores_a_moved_run_with_the_reward_model_in_its_folder(tmp_path):
    """A train.py run folder moved elsewhere (as the README allows): eval.py --policy NEW took the reward model at
    the path step 3 recorded, in the old folder, and stopped with "--reward_model OLD/step2_rm: no such folder", a
    flag not given; a copy scored with the original's reward model. The run's own step2_rm is used when it is the
    model step 3 recorded (its run id)."""
    from dschat.tools import ppo_eval

    old, new = tmp_path / "old_run", tmp_path / "new_run"
    _model_folder(new / "step3_ppo" / "actor")
    rm = _model_folder(new / "step2_rm")
    (rm / "training_args.json").write_text(json.dumps({"step": "step2", "run_id": "rm-run", "flags": {}}))
    (rm / "metrics.json").write_text("{}")

    def record(rm_run_id):
        (new / "step3_ppo" / "training_args.json").write_text(json.dumps(
            {"step": "step3", "world_size": 1, "cwd": str(tmp_path / "elsewhere"),
             "inputs": {str(old / "step2_rm"): rm_run_id},
             "flags": {"data_path": ["tiny"], "output_dir": str(old / "step3_ppo"),
                       "critic_model_name_or_path": str(old / "step2_rm")}}))
        return ppo_eval.parse_args(["--policy", str(new)]).reward_model

    assert record("rm-run") == str(rm)
    assert record("another-run") == str(old / "step2_rm")  # (not the model step 3 trained against: as recorded)


def test_the_warning_of_an_unfinished_model_is_said_once(tmp_path, capsys):
    """rw_eval and ppo_eval look their model up for the run's defaults and again to load it: the warning of an
    interrupted step's folder was printed twice, word for word."""
    from dschat.tools import ppo_eval

    actor = _model_folder(tmp_path / "step3_ppo" / "actor")
    (actor.parent / "training_args.json").write_text(json.dumps({"step": "step3", "flags": {"data_path": ["tiny"]}}))
    ppo_eval.parse_args(["--policy", str(tmp_path)])  # (no metrics.json: unfinished)
    assert capsys.readouterr().err.count("is an unfinished step output") == 1


def test_text_that_is_not_utf8_is_refused_with_a_message_and_the_chat_goes_on(reward_model, capsys):
    """A Latin-1 byte ("caf\\xe9", from a terminal or a piped file) reaches Python as a lone surrogate: the tokenizer
    failed on it with "TypeError: TextEncodeInput must be Union[...]", ending an interactive chat, and chat.py
    --prompt, rw_eval's --prompt/--answer and prompt_eval's --prompts the same way."""
    from dschat.tools import chat, prompt_eval, rw_eval
    from dschat.tools.common import load_policy

    latin1 = b"caf\xe9".decode("utf-8", "surrogateescape")  # (as sys.argv and sys.stdin read it)
    model, tokenizer = load_policy(str(Path(reward_model).parent / "policy"), "cpu")  # (the fixture's)
    session = chat.ChatSession(model, tokenizer, {"max_new_tokens": 2, "do_sample": False})
    said = []
    lines = iter([latin1, "hello", "quit"])
    chat.run_interactive(session, read=lambda prompt: next(lines), write=said.append)
    assert "(not answered: the message is not UTF-8 text (byte 0xe9) at character 4: give it in UTF-8" in said[1]
    assert said[2].startswith("Assistant:") and [m["content"] for m in session.history[::2]] == ["hello"]
    with pytest.raises(UsageError, match="^--prompt is not UTF-8 text"):
        chat.main(["--path", "tiny-llama", "--prompt", latin1])
    for flags in (["--prompt", latin1, "--answer", "ok"], ["--prompt", "hi", "--answer", latin1]):
        with pytest.raises(UsageError, match=f"^{flags[flags.index(latin1) - 1]} is not UTF-8 text"):
            rw_eval.main(["--model_name_or_path", reward_model, *flags])
    with pytest.raises(UsageError, match="^--prompts is not UTF-8 text"):
        prompt_eval.main(["--model_name_or_path_baseline", "tiny-llama", "--model_name_or_path_finetune", "tiny-llama",
                          "--prompts", latin1])


def test_a_line_that_is_not_utf8_under_a_strict_utf8_locale_is_refused_and_the_chat_goes_on(reward_model):
    """Under a UTF-8 locale (en_US.UTF-8; here PYTHONIOENCODING=utf-8) stdin decodes strictly: a Latin-1 line raised
    UnicodeDecodeError in input(), a traceback (exit 1) that ended the chat. Only the C/POSIX locale read it as
    surrogates, which the chat refuses with a message."""
    out, err = _chat_utf8_piped(reward_model, b"caf\xe9\nhello\nquit\n", status=2, stderr=True)
    assert "(not answered: the message is not UTF-8 text (byte 0xe9) at character 4" in out
    assert "Human: hello\nAssistant:" in out
    assert err.endswith("error: standard input line 1: not answered (said above as \"(not answered: ...)\"; the chat "
                        "went on with the other messages)\n")  # (piped: a script sees it in the exit status)


def _chat_utf8_piped(reward_model, stdin, status=0, stderr=False):
    """chat.py's output (and stderr) for ``stdin`` piped under a UTF-8 locale (PYTHONIOENCODING=utf-8), with the tiny
    policy beside ``reward_model``; it must exit with ``status``."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, str(repo / "chat.py"), "--path", str(Path(reward_model).parent / "policy"),
                           "--greedy", "--max_new_tokens", "2"], input=stdin, cwd=repo, env=env, capture_output=True,
                          timeout=180)
    assert proc.returncode == status, proc.stderr.decode("utf-8", "replace")[-2000:]
    out = proc.stdout.decode("utf-8", "replace")
    return (out, proc.stderr.decode("utf-8", "replace")) if stderr else out


def test_a_byte_order_mark_at_the_start_of_piped_input_is_not_part_of_the_first_message(reward_model):
    """A file saved with a UTF-8 byte-order mark (Notepad, PowerShell) kept it in the first message: its first line
    'quit' did not quit (the chat answered it, and the next line), and the model saw the mark."""
    out = _chat_utf8_piped(reward_model, b"\xef\xbb\xbfquit\nhello\n")
    assert out.endswith("Human: quit\n") and "Assistant:" not in out


def test_chat_with_its_standard_input_closed_says_so_before_the_model_loads(monkeypatch, capsys):
    """chat.py started with stdin closed (`<&-`) loaded the model, then ended in "AttributeError: 'NoneType' object has
    no attribute 'isatty'"."""
    import sys

    import dschat.tools.chat as chat

    monkeypatch.setattr(sys, "stdin", None)
    monkeypatch.setattr(chat, "load_policy", lambda *a, **k: pytest.fail("the model loaded first"))
    with pytest.raises(SystemExit) as ended:
        chat.main(["--path", "tiny-llama"])
    assert ended.value.code == 2 and "no standard input to read messages from" in capsys.readouterr().err


def test_prompt_eval_refuses_an_empty_prompt():
    """prompt_eval --prompts "" (or blanks) answered an empty Human turn, where chat.py and rw_eval refuse it."""
    from dschat.tools import prompt_eval

    for blank in ("", "   \n"):
        args = prompt_eval.build_parser().parse_args(["--model_name_or_path_baseline", "tiny-llama",
                                                      "--model_name_or_path_finetune", "tiny-llama",
                                                      "--prompts", "Say hi.", blank])
        with pytest.raises(UsageError, match="^--prompts: a prompt is empty"):
            prompt_eval.select_records(args)


def test_a_record_count_given_with_prompts_on_the_command_line_is_refused(reward_model, monkeypatch, capsys):
    """prompt_eval --prompts a b c --num_prompts 1 answered all three, and rw_eval --prompt --answer --num_pairs 3
    scored as without it: the count, which only counts a data file's records, was ignored, unsaid. Refused before any
    model loads; without the texts the counts still work (prompt_eval's --num_prompts on the embedded data)."""
    from dschat.tools import prompt_eval, rw_eval

    monkeypatch.setattr(prompt_eval, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    monkeypatch.setattr(rw_eval, "load_scoring_reward_model", lambda *a, **k: pytest.fail("a model loaded first"))
    models = ["--model_name_or_path_baseline", "tiny-llama", "--model_name_or_path_finetune", "tiny-llama"]
    for main, argv, flag in ((prompt_eval.main, [*models, "--prompts", "a", "b", "--num_prompts", "1"],
                              "--num_prompts"),
                             (rw_eval.main, ["--model_name_or_path", reward_model, "--prompt", "Say hi.", "--answer",
                                             "hi", "--num_pairs=3"], "--num_pairs")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        assert f"{flag} counts the records taken from a data file" in capsys.readouterr().err
    args = prompt_eval.build_parser().parse_args([*models, "--num_prompts", "2"])
    assert len(prompt_eval.select_records(args)[0]) == 2


@pytest.mark.parametrize("flag", ["--max_prompt_seq_len", "--per_device_generation_batch_size"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_ppo_eval_checks_its_sizes_when_parsing(flag, value, capsys):
    """--max_prompt_seq_len / --per_device_generation_batch_size 0 or negative were refused by step 3's checks only
    once every model had loaded ("error: max_prompt_seq_len: expected a positive integer"), without the flag's --."""
    from dschat.tools import ppo_eval

    with pytest.raises(SystemExit):
        ppo_eval.build_parser().parse_args(["--policy", "x", flag, value])
    assert f"argument {flag}: expected a positive integer" in capsys.readouterr().err


def test_a_training_checkpoint_given_as_the_model_is_said_to_be_one(tmp_path):
    """chat.py --path out/step1_sft/checkpoints/model/step_0000010 (a --save_interval checkpoint) said only "no model
    in this folder: expected a model folder (config.json) or a train.py output folder"."""
    from dschat.tools.common import flag_path

    out = _model_folder(tmp_path / "step1_sft")
    (out / "training_args.json").write_text(json.dumps({"step": "step1", "flags": {}}))
    for inside in ("checkpoints", "checkpoints/model/step_0000010"):
        (out / inside).mkdir(parents=True, exist_ok=True)
        with pytest.raises(UsageError, match=f"^--path {out / inside}: a training checkpoint .*not a saved model: the "
                                             f"step saves its model in {out} when it finishes"):
            flag_path("--path", find_policy_path, str(out / inside))
    (tmp_path / "elsewhere" / "checkpoints").mkdir(parents=True)  # a folder so named, of no step: as before
    with pytest.raises(UsageError, match="no model in this folder"):
        find_policy_path(str(tmp_path / "elsewhere" / "checkpoints"))


def test_a_mistyped_step_folder_given_to_a_tool_names_the_one_meant(tmp_path):
    """chat.py --path out/step1_sf said "no such folder", where the steps' own flags add "did you mean
    out/step1_sft?"."""
    _model_folder(tmp_path / "step1_sft")
    with pytest.raises(UsageError, match=f"step1_sf: no such folder \\(did you mean {tmp_path / 'step1_sft'}\\?\\)"):
        find_policy_path(str(tmp_path / "step1_sf"))


@pytest.mark.parametrize("tool", ["chat", "ppo_eval", "prompt_eval", "rw_eval"])
def test_a_tool_started_on_several_ranks_is_refused_before_it_loads_anything(tool, monkeypatch):
    """Under `deepspeed --num_gpus 2 eval.py ...` each rank ran the whole tool, printing (and writing) its results
    once per rank."""
    import importlib

    main = importlib.import_module(f"dschat.tools.{tool}").main
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("sys.argv", [f"{tool}.py"])
    with pytest.raises(UsageError, match=rf"{tool}\.py runs in one process: start it with python, not a launcher of 2 "
                                         r"ranks \(each would run it whole\)"):
        main(["--help"])  # (refused before its flags are even read)


@pytest.mark.parametrize("launcher", ["openmpi (mpirun)", "mvapich/mpich (hydra)", "slurm (srun)"])
def test_a_tool_started_by_a_launcher_that_sets_no_world_size_is_refused_too(launcher, monkeypatch):
    """`mpirun -np 2 eval.py`, or `srun eval.py` in a job of several tasks: no WORLD_SIZE, and each rank ran the
    whole tool."""
    from dschat.tools.prompt_eval import main
    from test_dist import RANKS_OF_LAUNCHERS, launched_as

    launched_as(monkeypatch, RANKS_OF_LAUNCHERS[launcher])
    monkeypatch.setattr("sys.argv", ["prompt_eval.py"])
    with pytest.raises(UsageError, match=r"prompt_eval\.py runs in one process: start it with python, not a launcher "
                                         r"of 2 ranks"):
        main(["--help"])


def test_a_transcript_prompt_ending_with_an_empty_human_turn_is_said_to_be_empty():
    """ "Human:" alone was refused as "the transcript must end with a 'Human:' turn", which it does."""
    from dschat.tools.records import prompt_record

    with pytest.raises(UsageError, match="the transcript must end with a non-empty 'Human:' turn"):
        prompt_record("Human:")


NO_SYSTEM_TEMPLATE = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                      "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_a_prompt_the_models_chat_template_refuses_is_an_error_naming_it_not_jinjas_traceback(tmp_path):
    """A system message (a transcript "Be brief.\\n\\nHuman: ...") to a model whose template refuses one (Gemma's):
    prompt_eval failed with jinja's TemplateError traceback after the baseline had answered, rw_eval once the reward
    model had loaded, chat.py --prompt once its model had; training data names such a record."""
    import torch

    from dschat.models.checkpoint import save_reward_model
    from dschat.models.loading import load_tokenizer
    from dschat.models.reward_model import create_critic_model
    from dschat.tiny.presets import create_tiny_model
    from dschat.tools import chat, prompt_eval, rw_eval

    policy = create_tiny_model("tiny-llama", tmp_path / "policy")
    tokenizer = load_tokenizer(policy)
    tokenizer.chat_template = NO_SYSTEM_TEMPLATE
    tokenizer.save_pretrained(policy)
    torch.manual_seed(0)
    save_reward_model(create_critic_model(policy, None), load_tokenizer(policy), str(tmp_path / "rm"))
    prompt = "Be brief.\n\nHuman: Name a color.\n\nAssistant:"
    said = r"the prompt of turns system, user, for .*: the tokenizer's chat template refuses them \(System role.*first " \
           r"user message: 'Name a color.'"
    with pytest.raises(UsageError, match=said), \
            mock.patch.object(prompt_eval, "load_policy", side_effect=AssertionError("a model loaded first")):
        prompt_eval.main(["--model_name_or_path_baseline", policy, "--model_name_or_path_finetune", policy,
                          "--prompts", prompt, "--max_new_tokens", "2"])
    with pytest.raises(UsageError, match=said):
        rw_eval.main(["--model_name_or_path", str(tmp_path / "rm"), "--prompt", prompt, "--answer", "Red."])
    with pytest.raises(UsageError, match=said), \
            mock.patch.object(chat, "load_policy", side_effect=AssertionError("a model loaded first")):
        chat.main(["--path", policy, "--prompt", prompt])


def test_rw_eval_given_no_pair_names_the_file_in_one_line(reward_model, tmp_path):
    """A prompts-only or SFT-only file has nothing to score: argparse's usage block said "no records with both a chosen
    and a rejected answer" without naming the file (which the step-2 run's training_args.json may have chosen)."""
    from dschat.errors import UsageError
    from dschat.tools import rw_eval

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name a color."}) + "\n" + json.dumps({"prompt": "Say hi."}) + "\n")
    with pytest.raises(UsageError, match=rf"--pairs_file {prompts}: none of its 2 records read has both a chosen and "
                                         "a rejected answer"):
        rw_eval.main(["--model_name_or_path", reward_model, "--pairs_file", str(prompts)])


@pytest.mark.parametrize("tool, argv", [
    ("chat", ["--path", "tiny-llama", "--prompt", "Say hi."]),
    ("chat", ["--path", "tiny-llama"]),
    ("prompt_eval", ["--model_name_or_path_baseline", "tiny-llama", "--model_name_or_path_finetune", "tiny-llama"]),
    ("rw_eval", ["--model_name_or_path", "RM", "--prompt", "Say hi.", "--answer", "hi"]),
    ("ppo_eval", ["--policy", "tiny-llama", "--reward_model", "RM"]),
])
def test_a_tool_started_with_its_output_closed_says_so_before_any_model_loads(tool, argv, reward_model, monkeypatch):
    """Started with stdout closed (`>&-`), Python has no sys.stdout and print writes nowhere: chat.py --prompt,
    prompt_eval and rw_eval lost their results with exit status 0, and interactive chat ended in "RuntimeError:
    input(): lost sys.stdout"."""
    import importlib
    import sys

    from dschat.errors import UsageError

    module = importlib.import_module(f"dschat.tools.{tool}")
    for loader in ("load_policy", "load_scoring_reward_model"):
        if hasattr(module, loader):
            monkeypatch.setattr(module, loader, lambda *a, **k: pytest.fail("a model loaded first"))
    monkeypatch.setattr(sys, "stdout", None)
    with pytest.raises(UsageError, match="no standard output to print .* to \\(it is closed\\)"):
        module.main([arg.replace("RM", reward_model) for arg in argv])


def test_ppo_eval_with_its_output_closed_writes_its_output_json(reward_model, monkeypatch, tmp_path):
    """--output_json holds the results: a closed stdout is no reason to refuse."""
    import sys

    from dschat.tools import ppo_eval

    monkeypatch.setattr(sys, "stdout", None)
    monkeypatch.setattr(ppo_eval, "evaluate_model", lambda path, *a, **k: ({"path": path, "prompts": 0,
                                                                            "examples": []}, None))
    ppo_eval.main(["--policy", "tiny-llama", "--reward_model", reward_model, "--output_json",
                   str(tmp_path / "out.json")])
    assert json.loads((tmp_path / "out.json").read_text())["policy"]["path"] == "tiny-llama"


def test_the_chat_banner_names_each_word_that_ends_the_chat():
    """'exit' ended the chat as 'quit' did, but the banner named 'quit' alone; it names both, and each ends it."""
    from dschat.tools import chat

    for word in chat.QUIT_COMMANDS:
        said = []
        chat.run_interactive(None, read=lambda prompt: word, write=said.append)  # (ends before the session is asked)
        assert said == ["Chat with the model. 'clear' starts a new conversation, 'quit' or 'exit' ends the chat."]


def test_a_run_rewarded_by_a_function_alone_is_said_to_have_no_reward_model(tmp_path):
    """rw_eval given a GRPO run's folder (step 3 rewarded by --reward_fn, --reward_model_weight 0: no step 2) said
    "no model in this folder: expected ... step2_rm", as if step 2's output were missing; it says the run trained
    with its reward function and has no reward model. A run whose step 3 had a reward model still says the first."""
    _model_folder(tmp_path / "step1_sft")
    _model_folder(tmp_path / "step3_ppo" / "actor")
    record = tmp_path / "step3_ppo" / "training_args.json"
    record.write_text(json.dumps({"step": "step3", "flags": {"reward_fn": "tiny", "reward_model_weight": 0}}))
    with pytest.raises(MissingInputError, match=r"its step 3 was rewarded by the reward function tiny alone "
                                                r"\(--reward_model_weight 0\), so the run has no reward model"):
        find_reward_model_path(str(tmp_path))
    record.write_text(json.dumps({"step": "step3", "flags": {"reward_fn": "tiny", "reward_model_weight": 1.0}}))
    with pytest.raises(MissingInputError, match="no model in this folder: expected .*step2_rm"):
        find_reward_model_path(str(tmp_path))


def _step2_run_on_one_file(reward_model, tmp_path, monkeypatch):
    """(a step2_rm folder whose run read one file, tmp_path/pairs.jsonl of 60 pairs, with --data_split 2,4,4 and
    --seed 7; the list rw_eval's scored sequences go to, in place of the model's scores)"""
    (tmp_path / "pairs.jsonl").write_text("".join(
        json.dumps({"prompt": f"Name color {i}.", "chosen": f"red {i}", "rejected": f"no {i}"}) + "\n"
        for i in range(60)))
    return _step2_run_reading(reward_model, tmp_path, "jsonl:pairs.jsonl", monkeypatch)


def check_scored_step2s_held_out_pairs(result, scored, reward_model, tmp_path):
    """rw_eval's ``result`` scored (``scored``: the chosen ids its reward model saw) exactly the held-out pairs of
    _step2_run_reading's step-2 run on Dahoas/rm-static (its --data_split 2,4,4 and --seed 7), as step 2 evaluated."""
    from dschat.data import create_prompt_dataset
    from dschat.models.loading import load_tokenizer

    _, held_out = create_prompt_dataset(0, ["Dahoas/rm-static"], "2,4,4", str(tmp_path / "cache"), 2, 7,
                                        load_tokenizer(reward_model), 64)
    step2_pairs = sorted(list(map(int, held_out[i]["chosen_input_ids"])) for i in range(len(held_out)))
    assert len(result["pairs"]) == len(step2_pairs) > 0
    assert sorted(scored[:len(result["pairs"])]) == step2_pairs


def _step2_run_reading(reward_model, run, data_path, monkeypatch):
    """(run/step2_rm: a copy of ``reward_model`` whose recorded run, in ``run``, read ``data_path`` with --data_split
    2,4,4 and --seed 7; the list rw_eval's scored sequences go to, in place of the model's scores)"""
    import shutil

    from dschat.steps.common import RUN_ARGS_FILE
    from dschat.tools import rw_eval

    trained = run / "step2_rm"
    shutil.copytree(reward_model, trained)
    (trained / RUN_ARGS_FILE).write_text(json.dumps({"step": "step2", "cwd": str(run), "flags": {
        "data_path": [data_path], "data_split": "2,4,4", "seed": 7, "max_seq_len": 64}}))
    scored = []
    monkeypatch.setattr(rw_eval, "score_sequences", lambda model, tokenizer, sequences, batch_size:
                        scored.extend(sequences) or [0.0] * len(sequences))
    return trained, scored


def _step2_held_out_chosen(reward_model, tmp_path):
    """The chosen sequences of the pairs step 2 holds out of that run's file, sorted (create_prompt_dataset's)."""
    from dschat.data import create_prompt_dataset
    from dschat.models.loading import load_tokenizer

    _, held_out = create_prompt_dataset(0, [f"jsonl:{tmp_path / 'pairs.jsonl'}"], "2,4,4", str(tmp_path / "cache"), 2,
                                        7, load_tokenizer(reward_model), 64)
    return sorted(list(map(int, held_out[i]["chosen_input_ids"])) for i in range(len(held_out)))


def test_rw_eval_scores_the_pairs_step_2_held_out_of_its_one_file(reward_model, tmp_path, capsys, monkeypatch):
    """A step-2 run on one file (no eval file): rw_eval took that file as its --pairs_file and scored all of it (or its
    first --num_pairs), pairs step 2 trained on among them, an accuracy unlike the one step 2 reported. It scores the
    pairs step 2 evaluated on now: phase 2's share, by the run's --data_split, of the 10% its --seed holds out."""
    from dschat.tools import rw_eval

    trained, scored = _step2_run_on_one_file(reward_model, tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path / "step2_rm")  # (the run's file is found from its cwd, not this folder)
    result = rw_eval.main(["--model_name_or_path", str(trained), "--num_pairs", "0"])

    step2_pairs = _step2_held_out_chosen(reward_model, tmp_path)
    assert len(result["pairs"]) == len(step2_pairs) < 60
    assert sorted(scored[:len(result["pairs"])]) == step2_pairs  # (the chosen answers' sequences, then the rejected)
    out = capsys.readouterr().out
    assert "--data_split 2,4,4 --seed 7" in out and "step 2's held-out pairs" in out and "--seed 7 holds out" in out
    # given with --prompt, which reads no pairs, --data_split is an error
    with pytest.raises(SystemExit):
        rw_eval.main(["--model_name_or_path", str(trained), "--prompt", "Say hi.", "--answer", "hi",
                      "--data_split", "2,4,4"])
    assert "--data_split 2,4,4: it chooses step 2's held-out pairs" in capsys.readouterr().err


def test_rw_eval_scores_the_pairs_step_2_held_out_of_its_hub_named_local_copy(reward_model, tmp_path, capsys,
                                                                             monkeypatch):
    """A step-2 run on --data_path Dahoas/rm-static, read from its copy ./Dahoas/rm-static (save_to_disk, or the
    download) as training reads a hub name (raw_datasets.is_local_hub_copy): rw_eval took no --pairs_file from it
    (step2_run_defaults left out every hub name) and scored the embedded tiny pairs, not one of the run's. It scores
    step 2's held-out pairs of that copy now, read by the dataset's reader as step 2 read them; from another folder,
    whose Dahoas/rm-static is not the run's copy, it says where the copy is."""
    import shutil

    from datasets import Dataset, DatasetDict

    from dschat.tools import rw_eval

    rows = [{"prompt": f"\n\nHuman: Name color {i}.\n\nAssistant:", "response": f" red {i}", "chosen": f" red {i}",
             "rejected": f" no {i}"} for i in range(60)]
    run = tmp_path / "run"
    DatasetDict({"train": Dataset.from_list(rows[:40]), "test": Dataset.from_list(rows[40:])}).save_to_disk(
        str(run / "Dahoas" / "rm-static"))
    trained, scored = _step2_run_reading(reward_model, run, "Dahoas/rm-static", monkeypatch)
    monkeypatch.chdir(run)
    result = rw_eval.main(["--model_name_or_path", str(trained), "--num_pairs", "0"])
    check_scored_step2s_held_out_pairs(result, scored, reward_model, tmp_path)
    out = capsys.readouterr().out
    assert "--pairs_file Dahoas/rm-static --data_split 2,4,4 --seed 7" in out and "of its test split" in out
    # from another folder, the name is not the run's copy: said, with what to do
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=r"^the step-2 run read Dahoas/rm-static from its copy .*run/Dahoas/rm-static "
                                         r"\(from .*training_args\.json\), which the tools read by that name only in "
                                         r"the folder that holds it: run rw_eval in .*run, or give --pairs_file"):
        rw_eval.parse_args(["--model_name_or_path", str(trained)])
    # a run that read the hub (no copy in its folder) gives its name: the tools read the hub's data as training does
    shutil.rmtree(run / "Dahoas")
    assert rw_eval.parse_args(["--model_name_or_path", str(trained)])[0].pairs_file == "Dahoas/rm-static"


def test_rw_eval_and_prompt_eval_read_a_hub_datasets_download_in_the_hub_cache_as_step_2_does(reward_model, tmp_path,
                                                                                              capsys, monkeypatch):
    """`hf download --repo-type dataset Dahoas/rm-static` (the hub cache), offline: step 2 reads it by the dataset's
    name, but rw_eval --pairs_file Dahoas/rm-static and prompt_eval --prompts_file Dahoas/rm-static said "no local
    data file or folder there (the tools read local data; a hub dataset by name only in training)", and rw_eval
    scored the embedded tiny pairs for a step-2 run on it. The tools read a hub dataset's name through training's own
    reader now (get_raw_dataset): its test split, from the hub cache as step 2 read it."""
    from types import SimpleNamespace

    import pandas as pd
    from huggingface_hub import constants

    from dschat.tools import rw_eval
    from dschat.tools.prompt_eval import select_records

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "datasets--Dahoas--rm-static"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    data = repo / "snapshots" / ("0" * 40) / "data"
    data.mkdir(parents=True)
    rows = [{"prompt": f"\n\nHuman: Name color {i}.\n\nAssistant:", "response": f" red {i}", "chosen": f" red {i}",
             "rejected": f" no {i}"} for i in range(60)]
    pd.DataFrame(rows[:40]).to_parquet(data / "train-00000-of-00001-2a1d.parquet")
    pd.DataFrame(rows[40:]).to_parquet(data / "test-00000-of-00001-8c3f.parquet")
    monkeypatch.chdir(tmp_path)
    result = rw_eval.main(["--model_name_or_path", reward_model, "--pairs_file", "Dahoas/rm-static", "--num_pairs",
                           "0"])
    assert [pair["chosen"] for pair in result["pairs"]] == [f"red {i}" for i in range(40, 60)]
    assert "read from its download in the hub cache" in capsys.readouterr().out
    records, _ = select_records(SimpleNamespace(prompts=None, prompts_file="Dahoas/rm-static", data_fields="",
                                                num_prompts=3))
    assert [record.user_message for record in records] == [f"Name color {i}." for i in range(40, 43)]
    # a step-2 run on it: its held-out pairs, by its --data_split and --seed, as step 2 evaluated them
    run = tmp_path / "run"
    run.mkdir()
    trained, scored = _step2_run_reading(reward_model, run, "Dahoas/rm-static", monkeypatch)
    result = rw_eval.main(["--model_name_or_path", str(trained), "--num_pairs", "0"])
    check_scored_step2s_held_out_pairs(result, scored, reward_model, tmp_path)
    # where a folder of that name here would be read instead of the hub's data the run read, it is said
    (tmp_path / "Dahoas" / "rm-static").mkdir(parents=True)
    with pytest.raises(UsageError, match=r"^the step-2 run read Dahoas/rm-static from the hub \(from .*\), and the "
                                         r"folder Dahoas/rm-static here would be read by that name instead"):
        rw_eval.parse_args(["--model_name_or_path", str(trained)])


def test_rw_eval_and_prompt_eval_read_a_hub_dataset_without_an_eval_split_for_the_share_training_held_out(
        reward_model, tmp_path, capsys, monkeypatch):
    """Dahoas/synthetic-instruct-gptj-pairwise and openai/webgpt_comparisons have no eval split: training holds out
    the 10% of their train split its --seed chooses and trains on the rest, but rw_eval --pairs_file and prompt_eval
    --prompts_file read all of the train split, pairs and prompts the steps trained on among them. They read the
    share the training seed held out now: rw_eval's --seed (the step-2 run's by default), prompt_eval's without a seed
    the steps' default, said on stdout."""
    from types import SimpleNamespace

    from datasets import Dataset, DatasetDict

    from dschat.data.raw_datasets import get_raw_dataset
    from dschat.tools import rw_eval
    from dschat.tools.prompt_eval import select_records

    name = "Dahoas/synthetic-instruct-gptj-pairwise"
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"Name color {i}.", "chosen": f"red {i}", "rejected": f"no {i}"} for i in range(50)]
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(name)  # (read by its hub reader, as training does)

    def held_out_and_trained(seed):
        raw = get_raw_dataset(name, None, seed, -1)
        return [r["chosen"] for r in raw.get_eval_data()], {r["chosen"] for r in raw.get_train_data()}

    held_out, trained = held_out_and_trained(7)
    result = rw_eval.main(["--model_name_or_path", reward_model, "--pairs_file", name, "--num_pairs", "0", "--seed",
                           "7"])
    scored = [pair["chosen"] for pair in result["pairs"]]
    assert scored == held_out and len(scored) == 5 and not set(scored) & trained
    assert (f"5 records of {name} (the 10% of its train split --seed 7 holds out, which no step trains on)"
            in capsys.readouterr().out)
    # a step-2 run's model: the run's seed is the one that held its pairs out
    run = tmp_path / "run"
    run.mkdir()
    step2, _ = _step2_run_reading(reward_model, run, name, monkeypatch)
    assert rw_eval.parse_args(["--model_name_or_path", str(step2), "--pairs_file", name])[0].seed == 7
    # prompt_eval given no seed (and no run's): the steps' default one
    records, _ = select_records(SimpleNamespace(prompts=None, prompts_file=name, data_fields="", num_prompts=8))
    default_held_out, default_trained = held_out_and_trained(1234)
    assert [r.chosen for r in records] == default_held_out != held_out
    assert not {r.chosen for r in records} & default_trained
    assert "(the 10% of its train split the steps' default --seed 1234 holds out" in capsys.readouterr().out
    from dschat.tools.records import seed_holds_out  # (the same for the other hub dataset without an eval split)

    assert seed_holds_out("openai/webgpt_comparisons") and not seed_holds_out("stanfordnlp/SHP")


def test_prompt_eval_reads_the_share_its_fine_tuned_models_run_seed_held_out(tmp_path, capsys, monkeypatch):
    """prompt_eval --prompts_file of a hub dataset without an eval split read the share the steps' default --seed 1234
    holds out whatever seed the fine-tuned model trained with: a run with --seed 7 held out other rows, and trained on
    some of those compared as held-out prompts. It takes the seed the model's run recorded (said), or its --seed."""
    from datasets import Dataset, DatasetDict

    from dschat.data.raw_datasets import get_raw_dataset
    from dschat.run_layout import RUN_ARGS_FILE
    from dschat.tiny.presets import create_tiny_model
    from dschat.tools import prompt_eval

    name = "Dahoas/synthetic-instruct-gptj-pairwise"
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"Name color {i}.", "chosen": f"red {i}", "rejected": f"no {i}"} for i in range(50)]
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(name)
    sft = create_tiny_model("tiny-llama", tmp_path / "run" / "step1_sft")
    (tmp_path / "run" / "step1_sft" / RUN_ARGS_FILE).write_text(json.dumps({
        "step": "step1", "cwd": str(tmp_path), "flags": {"data_path": [name], "seed": 7}}))

    def held_out(seed):
        return [f"Name color {r['chosen'].split()[1]}." for r in get_raw_dataset(name, None, seed, -1).get_eval_data()]

    def compared(*flags):
        result = prompt_eval.main(["--model_name_or_path_baseline", sft, "--model_name_or_path_finetune",
                                   str(tmp_path / "run"), "--prompts_file", name, "--max_new_tokens", "1", *flags])
        return [messages[-1]["content"] for messages in result["prompts"]]

    assert held_out(7) != held_out(1234)
    assert compared() == held_out(7)
    out = capsys.readouterr().out
    assert (f"[prompt_eval] --seed 7: the fine-tuned model's run's (from {tmp_path / 'run' / 'step1_sft' / RUN_ARGS_FILE})"
            in out)
    assert "the 10% of its train split --seed 7 holds out" in out
    # a --seed given wins, and chooses the held-out rows: no "no effect on greedy decoding" for it
    assert compared("--seed", "1234") == held_out(1234)
    assert "no effect" not in capsys.readouterr().err
    # a PPO actor's run record is its step-3 folder's, above it
    from dschat.tools.common import model_run_record

    actor = tmp_path / "run" / "step3_ppo" / "actor"
    actor.mkdir(parents=True)
    (actor.parent / RUN_ARGS_FILE).write_text(json.dumps({"step": "step3", "flags": {"seed": 9}}))
    assert model_run_record(str(actor)) == ({"step": "step3", "flags": {"seed": 9}}, str(actor.parent / RUN_ARGS_FILE))


def test_rw_eval_says_an_answer_max_seq_len_cut_before_scoring_it(reward_model, tmp_path, capsys):
    """An answer longer than --max_seq_len is scored on its first tokens alone, as step 2 scores it: two answers alike
    up to the cut got the same score, and rw_eval printed each whole beside it without a word of the cut."""
    from dschat.tools import rw_eval

    long = "red, " * 40
    result = rw_eval.main(["--model_name_or_path", reward_model, "--prompt", "Name a color.", "--max_seq_len", "32",
                           "--answer", long + "and blue.", "--answer", long + "no.", "--answer", "red"])
    assert result["scores"][0] == result["scores"][1]  # (what the note is for: the ends differ, unread)
    kept, total = result["cut"][0]
    assert 0 < kept < total and result["cut"][2] is None
    out = capsys.readouterr().out
    assert f"score {result['scores'][0]:+.4f} (its first {kept} of {total} tokens: cut to fit --max_seq_len 32): " \
           f"{long}and blue." in out
    assert f"score {result['scores'][2]:+.4f}: red" in out

    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps({"prompt": "Name a color.", "chosen": c, "rejected": r}) + "\n"
                                  for c, r in ((long + "and blue.", "no"), ("red", "no"))))
    pairs = rw_eval.main(["--model_name_or_path", reward_model, "--pairs_file", str(pairs_file), "--max_seq_len", "32"])
    assert pairs["cut"] == 1 and len(pairs["pairs"]) == 2
    assert "; 1 pair scored with an answer cut to fit --max_seq_len 32 (as in step 2)" in capsys.readouterr().out


def test_ppo_eval_prints_no_examples_header_over_no_examples(capsys):
    """--num_examples 0 printed "=== policy (...): examples" with nothing under it, for each model."""
    from dschat.tools.ppo_eval import print_results

    result = {"path": "out/step1_sft", "prompts": 2, "reward_mean": 1.5, "examples": []}
    print_results({"policy": {**result, "examples": [{"prompt": "Hi", "answer": "Hello", "reward": 1.0}]},
                   "baseline": result})
    out = capsys.readouterr().out
    assert "=== policy (out/step1_sft): examples\n[reward +1.000] 'Hi'\n" in out
    assert "=== baseline" not in out and "baseline reward_mean +1.5000 over 2 prompts (out/step1_sft)" in out


def test_ppo_eval_prints_an_examples_rule_score_without_a_sign(capsys):
    """A rule score lies in [0, 1]: the summary printed it bare, each example with a sign ("rule +1.000")."""
    from dschat.tools.ppo_eval import print_results

    print_results({"policy": {"path": "out/step3_ppo", "prompts": 1, "reward_mean": -0.5, "rule_score_mean": 1.0,
                              "examples": [{"prompt": "Hi", "answer": "Hello", "reward": -0.5, "rule_score": 1.0}]}})
    out = capsys.readouterr().out
    assert "[reward -0.500, rule 1.000] 'Hi'\n" in out and "rule_score_mean 1.0000" in out


def test_rw_eval_data_split_given_with_the_runs_file_takes_the_runs_seed(reward_model, tmp_path, capsys, monkeypatch):
    """--pairs_file (the run's file) with --data_split took --seed 1234, not the step-2 run's 7 (its help says the
    run's): the 10% another seed holds out, pairs step 2 trained on among them, scored as its held-out pairs."""
    from dschat.tools import rw_eval

    trained, scored = _step2_run_on_one_file(reward_model, tmp_path, monkeypatch)
    pairs = tmp_path / "pairs.jsonl"
    result = rw_eval.main(["--model_name_or_path", str(trained), "--pairs_file", f"jsonl:{pairs}", "--data_split",
                           "2,4,4", "--num_pairs", "0"])
    assert "--seed 7 holds out" in capsys.readouterr().out
    step2_pairs = _step2_held_out_chosen(reward_model, tmp_path)
    assert sorted(scored[:len(result["pairs"])]) == step2_pairs
    # --seed given wins; without --data_split the run's seed is not taken (it chooses nothing there)
    assert rw_eval.parse_args(["--model_name_or_path", str(trained), "--pairs_file", f"jsonl:{pairs}",
                               "--data_split", "2,4,4", "--seed", "3"])[0].seed == 3
    assert rw_eval.parse_args(["--model_name_or_path", str(trained), "--pairs_file", f"jsonl:{pairs}"])[0].seed == 1234


def test_rw_eval_data_split_that_gives_step_2_nothing_is_an_error_naming_its_pairs_file(reward_model):
    """--data_split 1,0,0 was refused as giving step 2 "no share of --data_path", a flag rw_eval does not have."""
    from dschat.tools import rw_eval

    with pytest.raises(UsageError, match=r"^--data_split 1,0,0 gives phase 2 \(step 2's pairs\) no share of "
                                         "--pairs_file"):
        rw_eval.main(["--model_name_or_path", reward_model, "--data_split", "1,0,0"])
    with pytest.raises(UsageError, match="must have 3 parts"):
        rw_eval.main(["--model_name_or_path", reward_model, "--data_split", "1,1"])
    # a hub dataset's name is read as training reads it, with --data_split as without it: offline, and in neither
    # cache, it is training's error, naming the tool's flag
    for split in ([], ["--data_split", "2,4,4"]):
        with pytest.raises(MissingInputError, match=r"^--pairs_file Dahoas/rm-static: not in the datasets cache, and "
                                                    r"HF_HUB_OFFLINE is set"):
            rw_eval.main(["--model_name_or_path", reward_model, "--pairs_file", "Dahoas/rm-static", *split])
    from types import SimpleNamespace

    from dschat.tools.prompt_eval import select_records

    with pytest.raises(MissingInputError, match=r"^--prompts_file Dahoas/rm-static: not in the datasets cache"):
        select_records(SimpleNamespace(prompts=None, prompts_file="Dahoas/rm-static", data_fields="", num_prompts=8))


def test_a_mistyped_local_data_path_of_a_tool_is_no_such_file_not_a_hub_datasets_advice(reward_model, tmp_path,
                                                                                         monkeypatch):
    """rw_eval and prompt_eval (records.load_records, load_phase_held_out) said of a mistyped local folder "no local data
    ... a hub dataset by name only in training: give its download, hf download ..." (or, with --data_split, listed the
    hub datasets training knows), and of a missing file "data file not found" naming no flag. A path meant here is
    "no such file or folder", with its flag; a name (ORG/NAME) keeps the hub advice."""
    from types import SimpleNamespace

    from dschat.tools import rw_eval
    from dschat.tools.prompt_eval import select_records

    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "pairs.jsonl").write_text('{"prompt": "Q", "chosen": "A", "rejected": "B"}\n')
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for path in ("./pairs_dir/", "pairs_dir/", "runs/data/pairs", "pairs.jsonl", str(tmp_path / "pairs.jsonl"),
                 "~/missing.jsonl"):
        for split in ([], ["--data_split", "2,4,4"]):
            with pytest.raises(MissingInputError, match=rf"^--pairs_file {re.escape(path)}: no such file or folder$"):
                rw_eval.main(["--model_name_or_path", reward_model, "--pairs_file", path, *split])
        with pytest.raises(MissingInputError, match=rf"^--prompts_file {re.escape(path)}: no such file or folder$"):
            select_records(SimpleNamespace(prompts=None, prompts_file=path, data_fields="", num_prompts=8))
    # a ~ the shell left (--pairs_file=~/pairs.jsonl) names the file it meant
    with pytest.raises(MissingInputError, match=r"^--pairs_file ~/pairs.jsonl: no such file or folder \(the shell did "
                                                rf"not expand its ~, as after --flag= or a TYPE: prefix; give "
                                                rf"{tmp_path}/home/pairs.jsonl"):
        rw_eval.main(["--model_name_or_path", reward_model, "--pairs_file", "~/pairs.jsonl"])
    with pytest.raises(MissingInputError, match=r"^--pairs_file acme/pairs: no local data file or folder there, nor a "
                                                r"hub dataset dschat reads by name \(.*Dahoas/rm-static.*\): give its "
                                                r"download"):
        rw_eval.main(["--model_name_or_path", reward_model, "--pairs_file", "acme/pairs"])


def test_a_missing_typed_data_spec_of_a_tool_names_the_tools_flag(tmp_path, monkeypatch):
    """rw_eval's --pairs_file and prompt_eval's --prompts_file given jsonl:PATH that is not there said "jsonl:PATH: PATH
    does not exist", naming no flag (with --data_split as without it)."""
    from dschat.tools.records import load_phase_held_out, load_records

    monkeypatch.chdir(tmp_path)
    for spec in ("jsonl:./x.jsonl", "json:pairs/"):
        path = spec.partition(":")[2]
        said = rf"{re.escape(spec)}: {re.escape(path)}: no such file or folder$"
        with pytest.raises(MissingInputError, match=rf"^--prompts_file {said}"):
            load_records(spec, flag="--prompts_file")
        with pytest.raises(MissingInputError, match=rf"^--pairs_file {said}"):
            load_phase_held_out(spec, None, "2,4,4", 1234, 2, flag="--pairs_file")


def test_deepspeed_chats_local_jsonfile_missing_names_the_flag_that_gave_it(tmp_path, monkeypatch):
    """``local/jsonfile`` without data/train.json and data/eval.json here said "--data_path local/jsonfile ..." when
    the flag was rw_eval's --pairs_file (with --data_split or not) or prompt_eval's --prompts_file."""
    from dschat.data.raw_datasets import check_data_paths
    from dschat.tools.records import load_phase_held_out, load_records

    monkeypatch.chdir(tmp_path)
    said = r" local/jsonfile \(DeepSpeed-Chat's local data\) reads data/train.json and data/eval.json in the current " \
           rf"folder: {tmp_path}/data/train.json and {tmp_path}/data/eval.json not found; run from the folder"
    with pytest.raises(MissingInputError, match="^--prompts_file" + said):
        load_records("local/jsonfile", flag="--prompts_file")
    with pytest.raises(MissingInputError, match="^--pairs_file" + said):
        load_phase_held_out("local/jsonfile", None, "2,4,4", 1234, 2, flag="--pairs_file")
    with pytest.raises(MissingInputError, match="^--sft_only_data_path" + said):
        check_data_paths([], ["local/jsonfile"])


def test_a_name_that_is_no_data_reads_the_same_in_rw_eval_with_data_split_as_without(reward_model, tmp_path,
                                                                                     monkeypatch):
    """rw_eval --pairs_file nope (no file, no dataset of that name) said the tools' "--pairs_file nope: no local data
    ...", but with --data_split training's "unknown dataset 'nope' ... Known names ...", naming no flag."""
    from dschat.tools import rw_eval

    monkeypatch.chdir(tmp_path)
    said = []
    for split in ([], ["--data_split", "2,4,4"]):
        with pytest.raises(MissingInputError, match=r"^--pairs_file nope: no such file, folder or dataset") as error:
            rw_eval.main(["--model_name_or_path", reward_model, "--pairs_file", "nope", *split])
        said.append(str(error.value))
    assert said[0] == said[1]


def test_a_tools_data_name_close_to_a_known_one_is_told_it(tmp_path, monkeypatch):
    """A tool's data flag given Dahoas/rm-statik listed the known names without the one meant, where training's
    --data_path says it (``close_dataset_names_hint``)."""
    from dschat.tools.records import load_records

    monkeypatch.chdir(tmp_path)
    for name, meant in (("Dahoas/rm-statik", "Dahoas/rm-static"), ("tiny2", "tiny")):
        with pytest.raises(MissingInputError) as error:
            load_records(name, flag="--pairs_file")
        assert str(error.value).startswith(f"--pairs_file {name}: ") and \
            str(error.value).endswith(f" (did you mean {meant}?)"), str(error.value)
    with pytest.raises(MissingInputError) as error:
        load_records("acme/pairs", flag="--pairs_file")
    assert "did you mean" not in str(error.value)


def test_a_name_that_is_no_hub_dataset_is_not_told_to_download_it(tmp_path, monkeypatch):
    """The tools told a name that is no file and no hub dataset (``nope``) to "give its download, hf download
    --repo-type dataset NAME ...": the advice is for a hub dataset's name (ORG/NAME, as all dschat reads are)."""
    from dschat.tools.records import load_phase_held_out, load_records

    monkeypatch.chdir(tmp_path)
    for name in ("nope", "rm-static", "Dahoas/rm-static "):
        for read in (lambda: load_records(name, flag="--prompts_file"),
                     lambda: load_phase_held_out(name, None, "2,4,4", 1234, 2, flag="--prompts_file")):
            with pytest.raises(MissingInputError) as error:
                read()
            assert str(error.value).startswith(f"--prompts_file {name}: no such file, folder or dataset (the tools "
                                               "read local data")
            assert "hf download" not in str(error.value)
    # (an ORG/NAME keeps the advice; a hub dataset dschat knows is read as training reads it, and says so offline)
    with pytest.raises(MissingInputError, match=r"give its download, hf download --repo-type dataset NAME"):
        load_records("acme/pairs", flag="--prompts_file")
    with pytest.raises(MissingInputError, match=r"^--prompts_file Dahoas/rm-static: not in the datasets cache, and "
                                                r"HF_HUB_OFFLINE is set, so the hub is not asked; download it where"):
        load_records("Dahoas/rm-static", flag="--prompts_file")


def test_a_step_3_folder_given_as_the_reward_model_names_the_one_its_step_3_scored_with(tmp_path, monkeypatch):
    """rw_eval (or eval.py --reward_model) given <output>/step3_ppo said only "no model in this folder: expected ...
    one of step2_rm"; it names the reward model that step 3 scored with now (as the run read it: from its folder)."""
    _model_folder(tmp_path / "run" / "step2_rm")
    step3 = tmp_path / "run" / "step3_ppo"
    _model_folder(step3 / "actor")
    (step3 / "training_args.json").write_text(json.dumps({"step": "step3", "cwd": str(tmp_path), "flags": {
        "critic_model_name_or_path": "run/step2_rm"}}))
    monkeypatch.chdir(step3)  # (the run's relative path read from its own folder)
    with pytest.raises(MissingInputError, match=rf"^{step3}: step 3's output folder \(its actor and critic\), not a "
                                                rf"reward model: its step 3 scored with {tmp_path}/run/step2_rm; give "
                                                rf"that, or the run's output folder {tmp_path}/run$"):
        find_reward_model_path(str(step3))


def test_a_critic_free_step_3_folder_given_as_the_reward_model_names_what_its_step_3_scored_with(tmp_path):
    """A GRPO run's step3_ppo given to rw_eval (or eval.py --reward_model) said only "no model in this folder: expected
    ... one of step2_rm" where it was rewarded by a --reward_fn alone, and "(its actor and critic)" where it scored
    with a reward model though it has no critic. Either is said now, as for a step 3 with a critic."""
    step3 = tmp_path / "run" / "step3_ppo"
    _model_folder(step3 / "actor")
    record = step3 / "training_args.json"
    here = rf"^{step3}: step 3's output folder \(its actor: a critic-free grpo run\), not a reward model: "
    record.write_text(json.dumps({"step": "step3", "cwd": str(tmp_path), "flags": {
        "advantage_estimator": "grpo", "critic_model_name_or_path": "output/step2_rm", "reward_fn": "tiny",
        "reward_model_weight": 0}}))
    with pytest.raises(MissingInputError, match=here + r"its step 3 was rewarded by the reward function tiny alone "
                                                       r"\(--reward_model_weight 0\), so the run has no reward model"):
        find_reward_model_path(str(step3))
    record.write_text(json.dumps({"step": "step3", "cwd": str(tmp_path), "flags": {
        "advantage_estimator": "grpo", "critic_model_name_or_path": "output/step2_rm",
        "reward_model_name_or_path": "rm", "reward_fn": "tiny", "reward_model_weight": 0.5}}))
    with pytest.raises(MissingInputError, match=here + rf"its step 3 scored with rm; give that, or the run's output "
                                                       rf"folder {tmp_path}/run$"):
        find_reward_model_path(str(step3))


def test_rw_eval_data_split_without_pairs_file_after_a_run_on_several_files_is_an_error(reward_model, tmp_path):
    """A step-2 run on two files gives rw_eval no --pairs_file: --data_split then scored the embedded tiny data's share,
    printed as "step 2's held-out pairs", pairs of no file the run read."""
    import shutil

    from dschat.steps.common import RUN_ARGS_FILE
    from dschat.tools import rw_eval

    trained = tmp_path / "step2_rm"
    shutil.copytree(reward_model, trained)
    (trained / RUN_ARGS_FILE).write_text(json.dumps({"step": "step2", "cwd": str(tmp_path), "flags": {
        "data_path": ["jsonl:a.jsonl", "jsonl:b.jsonl"], "data_split": "2,4,4", "seed": 7}}))
    with pytest.raises(UsageError, match=r"^--data_split 2,4,4: the step-2 run read jsonl:.*a\.jsonl jsonl:.*b\.jsonl "
                                         r"\(from .*training_args\.json\), .* give --pairs_file"):
        rw_eval.parse_args(["--model_name_or_path", str(trained), "--data_split", "2,4,4"])
    # with --pairs_file, or without --data_split (the embedded held-out pairs, said so), it is read as asked
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Hi", "chosen": "Hello", "rejected": "No"}) + "\n")
    args = rw_eval.parse_args(["--model_name_or_path", str(trained), "--data_split", "2,4,4",
                               "--pairs_file", f"jsonl:{pairs}"])[0]
    assert args.pairs_file == f"jsonl:{pairs}" and args.seed == 7
    assert rw_eval.parse_args(["--model_name_or_path", str(trained)])[0].pairs_file is None


@pytest.mark.parametrize("returned,status", [(3, 3), (0, 0), ({"accuracy": 1.0}, 0), ({}, 0), (None, 0), (True, 0)])
def test_run_script_ends_with_the_int_main_returns_and_0_for_its_results(monkeypatch, returned, status):
    """run_script ignored what ``main`` returned, so no tool could set its exit status by returning a number; the
    tools' mains return their results (dicts, for notebooks), which are no status: only an int is one."""
    from dschat.utils import cli

    left = []
    monkeypatch.setattr(cli, "leave_process", left.append)  # (instead of ending this process)
    monkeypatch.setattr(cli, "end_distributed", lambda **_: None)  # (this test process's group is the next tests')
    cli.run_script(lambda: returned)
    assert left == [status]


def test_a_save_to_disk_copy_under_a_hub_name_is_read_by_the_tools_as_training_reads_it(tmp_path, monkeypatch,
                                                                                           capsys):
    """A save_to_disk folder under a hub dataset's name (./Dahoas/rm-static: DeepSpeed-Chat's offline copy), which
    training reads with that dataset's reader, was read by the tools as local data (a hub dataset's columns, SHP's,
    not read at all) and refused with --data_split ("no local data file or folder there"); its eval part, the hub's
    "test" split, was said to be "the 10% --seed holds out"."""
    from datasets import Dataset, DatasetDict

    from dschat.tools.records import load_phase_held_out, load_records

    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"\n\nHuman: Question {i}?\n\nAssistant:", "response": f" Answer {i}.",
             "chosen": f" Answer {i}.", "rejected": " No."} for i in range(30)]
    DatasetDict({"train": Dataset.from_list(rows[:20]),
                 "test": Dataset.from_list(rows[20:])}).save_to_disk("Dahoas/rm-static")
    records = load_records("Dahoas/rm-static", flag="--pairs_file")
    assert [r.chosen for r in records] == [f"Answer {i}." for i in range(20, 30)]
    assert "10 records of Dahoas/rm-static (its test split)" in capsys.readouterr().out
    held_out = load_phase_held_out("Dahoas/rm-static", None, "2,4,4", 1234, 2, flag="--pairs_file")
    assert len(held_out) == 4 and {r.chosen for r in held_out} <= {f"Answer {i}." for i in range(20, 30)}
    assert held_out[0].messages == [{"role": "user", "content": held_out[0].chosen.replace("Answer", "Question")
                                     .replace(".", "?")}]
    assert "phase 2's share by --data_split 2,4,4 of its test split" in capsys.readouterr().out

    shp = [{"history": f"Post {i}", "human_ref_A": f"A{i}", "human_ref_B": f"B{i}", "labels": i % 2}
           for i in range(6)]
    DatasetDict({"train": Dataset.from_list(shp[:3]), "validation": Dataset.from_list(shp[3:4]),
                 "test": Dataset.from_list(shp[4:])}).save_to_disk("stanfordnlp/SHP")
    (record,) = load_records("stanfordnlp/SHP", flag="--prompts_file")
    assert (record.messages, record.chosen, record.rejected) == ([{"role": "user", "content": "Post 3"}], "A3", "B3")
    assert "1 record of stanfordnlp/SHP (its validation split)" in capsys.readouterr().out


def test_a_save_to_disk_copy_under_a_hub_name_without_its_splits_is_an_error_naming_them(tmp_path, monkeypatch):
    """A save_to_disk copy ./Dahoas/rm-static without the test split its reader evaluates on (or a single Dataset)
    was a KeyError 'test' traceback, in training and in the tools alike."""
    from datasets import Dataset, DatasetDict

    from dschat.data.errors import DatasetFormatError
    from dschat.data.raw_datasets import get_raw_dataset
    from dschat.tools.records import load_records

    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": "\n\nHuman: Q?\n\nAssistant:", "response": " A.", "chosen": " A.", "rejected": " B."}] * 5
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk("Dahoas/rm-static")
    said = (r" Dahoas/rm-static: the save_to_disk copy here holds the split train, not test, which "
            r"Dahoas/rm-static's reader reads: save the DatasetDict of its train and test splits")
    with pytest.raises(DatasetFormatError, match="^--sft_only_data_path" + said):
        get_raw_dataset("Dahoas/rm-static", None, 0, -1, flag="--sft_only_data_path")
    with pytest.raises(DatasetFormatError, match="^--pairs_file" + said):
        load_records("Dahoas/rm-static", flag="--pairs_file")
    Dataset.from_list(rows).save_to_disk("stanfordnlp/SHP")
    with pytest.raises(DatasetFormatError, match=r"^--data_path stanfordnlp/SHP: the save_to_disk copy here holds one "
                                                 r"Dataset, no splits, not train and validation"):
        get_raw_dataset("stanfordnlp/SHP", None, 0, -1)
    shutil.rmtree("stanfordnlp/SHP")  # (load_from_disk would read the Dataset's files left beside a DatasetDict's)
    DatasetDict({"train": Dataset.from_list(rows), "test": Dataset.from_list(rows)}).save_to_disk("stanfordnlp/SHP")
    with pytest.raises(DatasetFormatError, match=r"holds the splits train, test, not validation"):
        get_raw_dataset("stanfordnlp/SHP", None, 0, -1)
    # a train-only dataset's copy needs its train split alone
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk("Dahoas/synthetic-instruct-gptj-pairwise")
    assert len(get_raw_dataset("Dahoas/synthetic-instruct-gptj-pairwise", None, 0, -1).get_eval_data()) == 1


def test_a_run_folder_whose_interrupted_step_saved_no_model_yet_names_that_step(tmp_path):
    """chat.py / eval.py given the folder of a train.py run interrupted in its first step 1 said "no model in this
    folder: expected ... holding one of ..., step1_sft" while step1_sft stood there (its training_args.json, no model
    yet); the error now names that folder and why it has no model. A step folder given itself says the same."""
    step1 = tmp_path / "step1_sft"
    step1.mkdir()
    (step1 / "training_args.json").write_text("{}")
    said = rf"; {re.escape(str(step1))} holds no model yet: its step was interrupted, or is still training"
    for given in (tmp_path, step1):
        with pytest.raises(MissingInputError, match=rf"no model in this folder: .*{said}"):
            find_policy_path(str(given))
    (step1 / "metrics.json").write_text("{}")  # (a finished step whose model was removed: not said to be training)
    with pytest.raises(MissingInputError, match="no model in this folder") as refused:
        find_policy_path(str(tmp_path))
    assert "holds no model yet" not in str(refused.value)


@pytest.mark.parametrize("tool, argv, named", [
    ("chat", ["--path", "tiny-llama", "--max-new-tokens", "5"], "--max-new-tokens: did you mean --max_new_tokens?"),
    ("ppo_eval", ["--policy", "tiny-llama", "--num-prompts", "3"], "--num-prompts: did you mean --num_prompts?"),
    ("prompt_eval", ["--model_name_or_path_baseline", "tiny-llama", "--num_prompt", "3"],
     "--num_prompt: did you mean --num_prompts?"),
    ("rw_eval", ["--model", "tiny-llama"], "--model: did you mean --model_name_or_path?")])
def test_a_mistyped_tool_flag_is_the_error_naming_the_flag_meant(tool, argv, named, capsys):
    """The tools' flags got no "did you mean", where the steps' do; and rw_eval.py --model X (a required flag's
    beginning: no abbreviations are taken) was told only that --model_name_or_path is required, prompt_eval.py's
    --num_prompt that --model_name_or_path_finetune is."""
    import importlib

    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(f"dschat.tools.{tool}").main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"unrecognized arguments: {' '.join(argv[-2:])}\n  {named}\n" in err, err
    assert "required" not in err


@pytest.mark.parametrize("tool, argv, how, meant", [
    ("rw_eval", ["-model_name_or_path", "tiny-llama"], "begins with one '-'", "--model_name_or_path"),
    ("rw_eval", ["\u2013model_name_or_path", "tiny-llama"], "begins with a typographic dash", "--model_name_or_path"),
    ("prompt_eval", ["--model_name_or_path_baseline", "tiny-llama", "\u2014model_name_or_path_finetune", "x"],
     "begins with a typographic dash", "--model_name_or_path_finetune"),
    ("chat", ["-path", "tiny-llama"], "begins with one '-'", "--path")])
def test_a_required_flag_typed_with_the_wrong_dash_is_told_before_it_is_missing(tool, argv, how, meant, capsys):
    """``rw_eval -model_name_or_path x`` (one "-", or a pasted en dash) was told only "the following arguments are
    required: --model_name_or_path": argparse checks the required flags before the hints, which name the flag the
    user typed with the wrong dash. The hint now comes first, as where the required flag is given."""
    import importlib

    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(f"dschat.tools.{tool}").main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and f"unrecognized arguments: {' '.join(argv[-2:])}\n  {argv[-2]}: {how}, not " \
           f"'--'; did you mean {meant}?\n" in err, err
    assert "required" not in err


def test_a_pasted_dash_value_of_a_flag_leaves_a_missing_required_flag_the_error(capsys):
    """The required flag's error stays where the misdashed token is a flag's value (argparse took it) and the
    required flag is not given: ``rw_eval --prompt \u2013x`` lacks --model_name_or_path."""
    from dschat.tools import rw_eval

    with pytest.raises(SystemExit):
        rw_eval.main(["--prompt", "\u2013x"])
    err = capsys.readouterr().err
    assert "the following arguments are required: --model_name_or_path" in err and "unrecognized" not in err, err


def test_a_hint_never_names_a_flag_the_tool_hides(capsys):
    """ppo_eval's --sft_only_data_path (step 3's shared flag, hidden from --help and refused) was the "did you mean" of
    --sft_only_data_pth: a hint named a flag the tool refuses."""
    from dschat.tools import ppo_eval

    with pytest.raises(SystemExit):
        ppo_eval.main(["--policy", "tiny-llama", "--sft_only_data_pth", "x"])
    err = capsys.readouterr().err
    assert "unrecognized arguments: --sft_only_data_pth x" in err and "sft_only_data_path" not in err, err


def test_a_pasted_dash_hint_never_names_a_flag_the_tool_hides(capsys):
    """ppo_eval's ``\u2013sft_only_data_path`` (a pasted en dash) was told "did you mean --sft_only_data_path?", the
    flag ppo_eval hides and refuses: the pasted dash's hint took any flag of the parser, the other hints only those
    --help shows (``long_flags``). One rule now; a shown flag is still named."""
    from dschat.tools import ppo_eval

    for given, meant in (("\u2013sft_only_data_path", None), ("\u2013num_prompts", "--num_prompts")):
        with pytest.raises(SystemExit):
            ppo_eval.main(["--policy", "tiny-llama", given, "1"])
        err = capsys.readouterr().err
        assert f"unrecognized arguments: {given} 1" in err and "--sft_only_data_path" not in err, err
        assert meant is None or f"{given}: begins with a typographic dash, not '--'; did you mean {meant}?" in err, err


def test_a_value_that_begins_with_dashes_is_still_the_missing_value_of_its_flag(capsys):
    """``--prompt --hi``: argparse's "expected one argument" (the way out: --prompt=--hi), not "--hi" as an unknown
    flag."""
    from dschat.tools import chat

    with pytest.raises(SystemExit):
        chat.main(["--path", "tiny-llama", "--prompt", "--hi"])
    err = capsys.readouterr().err
    assert "argument --prompt: expected one argument" in err and "unrecognized" not in err, err


@pytest.mark.parametrize("tool", ["chat", "rw_eval", "prompt_eval", "ppo_eval"])
def test_help_after_an_unknown_flag_is_still_the_help(tool, capsys):
    """``--max-new-tokens 5 --help``: argparse prints the help and exits 0 before it says any unknown flag; the
    early refusal of unknown flags had made it an error (status 2) that hid the help asked for."""
    import importlib

    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(f"dschat.tools.{tool}").build_parser().parse_args(["--max-new-tokens", "5", "--help"])
    out = capsys.readouterr().out
    assert stopped.value.code == 0 and "usage:" in out and "--seed" in out, out


def test_a_value_with_dashes_and_a_space_is_a_value_as_argparse_reads_it():
    """argparse takes a token with a space for a value even where it begins with "--" (a prompt "-- and you?" after
    the first of --prompts); the early refusal of unknown flags refused it as an unknown flag."""
    from dschat.tools import prompt_eval

    args = prompt_eval.build_parser().parse_args(["--model_name_or_path_baseline", "a", "--model_name_or_path_finetune",
                                                  "b", "--prompts", "Hi", "-- and you?"])
    assert args.prompts == ["Hi", "-- and you?"]


def test_the_tools_read_a_record_without_cwd_from_where_its_relative_output_dir_led(tmp_path, monkeypatch):
    """A training_args.json from before dschat recorded "cwd": rw_eval, ppo_eval and the reward model lookup read its
    relative paths from the folder the tool ran in, unlike train.py --resume (``record_cwd``): from another folder,
    rw_eval and ppo_eval took the step's relative data file as a file there (none: "no such file"), and a step-3
    folder given as the reward model named its reward model as typed. They read them from where its relative
    --output_dir led, as --resume does: one rule."""
    from types import SimpleNamespace

    from dschat.tools import ppo_eval, rw_eval

    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    (repo / "data").mkdir(parents=True)
    pairs = repo / "data" / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "Why?", "chosen": "Because.", "rejected": "No."}) + "\n")
    rm = _model_folder(repo / "output" / "step2_rm")
    (rm / "training_args.json").write_text(json.dumps({"step": "step2", "flags": {
        "output_dir": "output/step2_rm", "data_path": ["jsonl:data/pairs.jsonl"]}}))
    actor = _model_folder(repo / "output" / "step3_ppo" / "actor")
    (actor.parent / "training_args.json").write_text(json.dumps({"step": "step3", "world_size": 1, "flags": {
        "output_dir": "output/step3_ppo", "data_path": ["jsonl:data/pairs.jsonl"],
        "reward_model_name_or_path": "output/step2_rm"}}))
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    args = SimpleNamespace(pairs_file=None, prompt=None, data_split=None)
    assert rw_eval.step2_run_defaults(args, (str(rm), None))[0]["pairs_file"] == f"jsonl:{pairs}"
    parsed = ppo_eval.parse_args(["--policy", str(actor)])
    assert (parsed.data_path, parsed.reward_model) == ([f"jsonl:{pairs}"], str(rm))
    with pytest.raises(MissingInputError, match=rf"its step 3 scored with {re.escape(str(rm))}; give that"):
        find_reward_model_path(str(actor.parent))
