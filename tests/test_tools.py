"""The tools for trained models: chat.py, step-1 prompt_eval, step-2 rw_eval, step-3 ppo_eval (tiny models)."""
import copy
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dschat.data.formatting import format_answer, format_prompt
from dschat.models.checkpoint import save_reward_model
from dschat.models.loading import load_tokenizer
from dschat.models.reward_model import create_critic_model, load_reward_model
from dschat.steps.common import RUN_ARGS_FILE
from dschat.tiny.presets import create_tiny_model
from dschat.tiny.scorer import rule_score
from dschat.tools import ppo_eval, prompt_eval, rw_eval
from dschat.tools.chat import ChatSession, conversation_prompt, run_interactive
from dschat.tools.common import find_policy_path, flag_path, load_policy, parse_with_run_defaults
from dschat.tools.generation import decode_answers

REPO = Path(__file__).resolve().parents[1]
GREEDY = {"max_new_tokens": 6, "do_sample": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny policies with different random weights and a reward model saved the way step 2 saves it."""
    root = tmp_path_factory.mktemp("tool_models")
    policy = create_tiny_model("tiny-llama", root / "policy")
    baseline = create_tiny_model("tiny-llama", root / "baseline", seed=7)
    torch.manual_seed(0)  # the value head of a fresh reward model is random
    save_reward_model(create_critic_model(policy, None), load_tokenizer(policy), str(root / "rm"))
    return {"policy": policy, "baseline": baseline, "rm": str(root / "rm"), "root": root}


@pytest.fixture(scope="module")
def session(models):
    model, tokenizer = load_policy(models["policy"], device="cpu")
    return ChatSession(model, tokenizer, dict(GREEDY))


def run_chat(*args, stdin=None, stderr=False):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "chat.py"), *map(str, args)], input=stdin, cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (proc.stdout, proc.stderr) if stderr else proc.stdout


# --- chat ---

def test_run_folder_resolves_to_the_reported_policy_else_actor_dpo_sft(models, tmp_path):
    from dschat.report import build_report

    run = tmp_path / "run"
    for folder in ("step1_sft", "step3_ppo/actor", "step2_dpo"):
        (run / folder).mkdir(parents=True)
        (run / folder / "config.json").write_text("{}")
    assert find_policy_path(str(run)) == str(run / "step3_ppo" / "actor")  # no report: the fixed order
    for recipe, policy in (("dpo", "step2_dpo"), ("grpo", "step3_ppo/actor")):  # the last train.py run's recipe
        (run / "report.json").write_text(json.dumps(build_report(str(run), {}, recipe)))
        assert find_policy_path(str(run)) == str(run / policy)
    assert find_policy_path(models["policy"]) == models["policy"]


def test_a_finished_runs_reported_policy_that_is_gone_is_an_error_not_the_sft_model(tmp_path):
    """report.json names step3_ppo/actor and that folder was removed: the tools took step1_sft in its place, said by
    its path alone, so chat.py and eval.py answered with the SFT model as the run's result."""
    from dschat.errors import MissingInputError
    from dschat.report import build_report

    run = tmp_path / "run"
    for folder in ("step1_sft", "step3_ppo/actor"):
        (run / folder).mkdir(parents=True)
        (run / folder / "config.json").write_text("{}")
    (run / "report.json").write_text(json.dumps(build_report(str(run), {}, "ppo")))
    shutil.rmtree(run / "step3_ppo" / "actor")
    with pytest.raises(MissingInputError, match=re.escape(f"policy, {run / 'step3_ppo' / 'actor'} (report.json), "
                                                          "holds no model now")):
        find_policy_path(str(run))
    (run / "report.json").write_text(json.dumps({"unfinished": True, "policy": "step3_ppo/actor"}))
    assert find_policy_path(str(run)) == str(run / "step1_sft")  # a run still going: not written yet (warned of)


def test_an_unfinished_runs_policy_not_written_yet_is_its_sft_model_not_another_recipes_earlier_policy(tmp_path,
                                                                                                         capsys):
    """train.py --recipe ppo, then --recipe dpo into the same folder, interrupted in its step 2 (or still training):
    its report.json names step2_dpo, which holds no model yet, and the tools took the fixed order's step3_ppo/actor,
    the earlier PPO run's actor, made from the SFT model this run's step 1 has since replaced (write_unfinished_report
    names this run's policy so that the tools take this run's models, not an earlier run's). Now its SFT model."""
    from dschat.report import write_unfinished_report

    run = tmp_path / "run"
    for folder in ("step1_sft", "step3_ppo/actor"):
        (run / folder).mkdir(parents=True)
        (run / folder / "config.json").write_text("{}")
    (run / "step2_dpo").mkdir()
    (run / "step2_dpo" / RUN_ARGS_FILE).write_text(json.dumps({"step": "step2_dpo", "flags": {}}))  # (no model yet)
    write_unfinished_report(str(run), "dpo", [1, 2])
    assert find_policy_path(str(run)) == str(run / "step1_sft")
    path = flag_path("--path", find_policy_path, str(run))
    assert path == str(run / "step1_sft")
    assert (f"warning: --path {run}: its last train.py run did not finish (report.json says so): {path} may be from "
            "before it") in capsys.readouterr().err
    (run / "report.json").write_text(json.dumps({"policy": "step2_dpo"}))  # (a finished run's: its policy, gone)
    with pytest.raises(FileNotFoundError, match="holds no model now"):
        find_policy_path(str(run))
    (run / "report.json").unlink()  # no report: the fixed order, as before
    assert find_policy_path(str(run)) == str(run / "step3_ppo" / "actor")


@pytest.fixture
def report_reads(monkeypatch):
    """The report.json files read (``read_json_object``) during the test, once per read."""
    import dschat.utils.files

    reads = []
    read_json_object = dschat.utils.files.read_json_object

    def counted(path):
        if os.path.basename(path) == "report.json":
            reads.append(path)
        return read_json_object(path)

    monkeypatch.setattr(dschat.utils.files, "read_json_object", counted)
    return reads


def test_find_policy_path_reads_a_runs_report_once(tmp_path, report_reads):
    """find_policy_path read report.json three times (the reported policy, whether it is there, the fallbacks), each
    an open and a parse of the same file; once now, finished run or not."""
    run = tmp_path / "run"
    for folder in ("step1_sft", "step2_dpo"):
        (run / folder).mkdir(parents=True)
        (run / folder / "config.json").write_text("{}")
    # (a finished run's policy, there; an unfinished one's, not written yet: its SFT model)
    for report, found in (({"policy": "step2_dpo"}, "step2_dpo"),
                          ({"policy": "step3_ppo/actor", "unfinished": True}, "step1_sft")):
        (run / "report.json").write_text(json.dumps(report))
        report_reads.clear()
        assert find_policy_path(str(run)) == str(run / found)
        assert report_reads == [str(run / "report.json")], report


def test_a_flag_path_lookup_reads_a_runs_report_once(tmp_path, report_reads, capsys):
    """flag_path read report.json again once find_policy_path or find_reward_model_path had read it, for its warning
    of an unfinished run: two reads per lookup of a run folder. One now, the warning still said."""
    from dschat.errors import UsageError
    from dschat.models.reward_model import VALUE_HEAD_FILE
    from dschat.tools.common import find_reward_model_path

    run = tmp_path / "run"
    for folder in ("step1_sft", "step2_rm"):
        (run / folder).mkdir(parents=True)
        (run / folder / "config.json").write_text("{}")
    (run / "step2_rm" / VALUE_HEAD_FILE).write_text("")  # (a reward model's files, as the lookup checks them)
    (run / "report.json").write_text(json.dumps({"policy": "step3_ppo/actor", "unfinished": True}))
    for flag, find, found in (("--path", find_policy_path, "step1_sft"),
                              ("--model_name_or_path", find_reward_model_path, "step2_rm")):
        report_reads.clear()
        assert flag_path(flag, find, str(run)) == str(run / found)
        assert report_reads == [str(run / "report.json")], flag
        assert f"warning: {flag} {run}: its last train.py run did not finish" in capsys.readouterr().err
    (run / "report.json").write_text("{")  # (a damaged one: said with the flag, as when find read it)
    with pytest.raises(UsageError, match=f"^--path {re.escape(str(run / 'report.json'))} is not JSON"):
        flag_path("--path", find_policy_path, str(run))


def test_ppo_eval_reads_the_run_folders_report_once_for_its_sft_models_run(tmp_path, report_reads):
    """--policy RUN whose SFT model is the one taken (an unfinished --recipe dpo run): the lookup read report.json
    twice, sft_comparison_run once more (its policy picks the DPO step's flags over an older step 3's), and the
    DPO defaults once more (a held-out rule score of an older report). Once now, and the same run's flags taken."""
    run = tmp_path / "run"
    (run / "step1_sft").mkdir(parents=True)
    (run / "step1_sft" / "config.json").write_text("{}")
    for folder, step in (("step3_ppo", "step3"), ("step2_dpo", "step2_dpo")):  # (no DPO policy written yet)
        (run / folder).mkdir()
        (run / folder / RUN_ARGS_FILE).write_text(json.dumps({"step": step, "world_size": 1,
                                                              "flags": {"data_path": ["tiny"]}}))
    (run / "report.json").write_text(json.dumps({"policy": "step2_dpo", "unfinished": True}))
    defaults, source = ppo_eval.step3_run_defaults(ppo_eval.build_parser().parse_args(["--policy", str(run)]))
    assert source == str(run / "step2_dpo" / RUN_ARGS_FILE)
    assert report_reads == [str(run / "report.json")]


def counted_lookups(monkeypatch, module, name):
    """The values looked up through ``module``'s model finder ``name`` (find_policy_path, find_reward_model_path)."""
    looked_up, find = [], getattr(module, name)

    def counted(path, report=None):
        looked_up.append(path)
        return find(path, report)

    monkeypatch.setattr(module, name, counted)
    return looked_up


class StopBeforeLoading(Exception):
    pass


def test_ppo_eval_and_rw_eval_look_their_model_up_once(tmp_path, monkeypatch, report_reads):
    """ppo_eval's parse_args looked --policy up again after its run defaults had (step3_run_defaults), and rw_eval's
    main looked --model_name_or_path up again after parse_args had (step2_run_defaults): each lookup of a run folder
    read its report.json again, and a reward model's value head was checked again. One lookup each now, the flag's
    value the model found."""
    from dschat.models.reward_model import VALUE_HEAD_FILE

    run = tmp_path / "run"
    for folder in ("step3_ppo/actor", "step2_rm"):
        (run / folder).mkdir(parents=True)
        (run / folder / "config.json").write_text("{}")
    (run / "step2_rm" / VALUE_HEAD_FILE).write_text("")
    (run / "step3_ppo" / RUN_ARGS_FILE).write_text(json.dumps({"step": "step3", "world_size": 1,
                                                               "flags": {"data_path": ["tiny"], "seed": 7}}))
    (run / "report.json").write_text(json.dumps({"policy": "step3_ppo/actor"}))
    looked_up = counted_lookups(monkeypatch, ppo_eval, "find_policy_path")
    args = ppo_eval.parse_args(["--policy", str(run)])
    assert (args.policy, args.seed) == (str(run / "step3_ppo" / "actor"), 7)  # (the run's flags taken)
    assert looked_up == [str(run)] and report_reads == [str(run / "report.json")]

    report_reads.clear()
    looked_up = counted_lookups(monkeypatch, rw_eval, "find_reward_model_path")

    def stop(path, **kwargs):  # (the model is not loaded: the lookups are over by then)
        raise StopBeforeLoading(path)

    monkeypatch.setattr("dschat.models.loading.load_tokenizer", stop)
    with pytest.raises(StopBeforeLoading, match=re.escape(str(run / "step2_rm"))):
        rw_eval.main(["--model_name_or_path", str(run), "--prompt", "Say hi.", "--answer", "hi"])
    assert looked_up == [str(run)] and report_reads == [str(run / "report.json")]


def test_a_run_folder_whose_model_a_save_swap_left_beside_it_is_an_error_naming_it(tmp_path):
    """A save killed between the two renames of its folder swap leaves no step3_ppo/actor (or step2_rm), the finished
    model whole beside it (.actor.save-new): chat.py, prompt_eval and eval.py given the run's folder took the next of
    its folders, step1_sft, unsaid (or, with report.json, said only that the actor "holds no model now"), and rw_eval
    said "no model in this folder". Each now names the interrupted save and how to finish it."""
    from dschat.run_layout import save_swap_paths
    from dschat.tools.common import find_reward_model_path

    run = tmp_path / "run"
    for folder in ("step1_sft", "step2_rm", "step3_ppo/actor"):
        (run / folder).mkdir(parents=True)
        (run / folder / "config.json").write_text("{}")
    for folder in ("step3_ppo/actor", "step2_rm"):
        os.rename(run / folder, save_swap_paths(run / folder)[0])
    for report in (None, {"policy": "step3_ppo/actor"}):
        if report:
            (run / "report.json").write_text(json.dumps(report))
        for flag, find, folder in (("--path", find_policy_path, "step3_ppo/actor"),
                                   ("--model_name_or_path", find_reward_model_path, "step2_rm")):
            new = save_swap_paths(run / folder)[0]
            with pytest.raises(FileNotFoundError, match=re.escape(f"{flag} {run / folder}: no folder there now: a "
                                                                  "save that replaced it was interrupted between its "
                                                                  f"renames, and its finished copy is {new}")):
                flag_path(flag, find, str(run))


def test_a_folder_without_a_model_is_an_error_naming_it_and_a_dpo_run_is_found(models, tmp_path, monkeypatch,
                                                                               reachable_hub):
    with pytest.raises(FileNotFoundError, match="no model in this folder"):
        find_policy_path(str(tmp_path))  # e.g. train.py's output folder before any step wrote a model
    with pytest.raises(FileNotFoundError, match="no such folder"):
        find_policy_path(str(tmp_path / "not_there"))
    assert find_policy_path("facebook/opt-1.3b") == "facebook/opt-1.3b", "hub names pass through (the hub answers)"
    for typo in ("outptu/step1_sft", "step3_ppo/actor"):  # through a step's folder: a run's, never a hub name
        with pytest.raises(FileNotFoundError, match=f"{typo}: no such folder"):
            find_policy_path(typo)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "run" / "step1_sft").mkdir(parents=True)
    (tmp_path / "run" / "step1_sft" / "config.json").write_text("{}")
    assert find_policy_path("~/run") == str(tmp_path / "run" / "step1_sft"), "~ expanded"
    os.symlink(models["policy"], tmp_path / "step2_dpo")
    assert find_policy_path(str(tmp_path)) == str(tmp_path / "step2_dpo")


def test_a_name_that_is_no_folder_and_fails_on_the_hub_is_one_clear_error(monkeypatch):
    from dschat.models.loading import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as with no network: the hub client fails (here at once)
    with pytest.raises(FileNotFoundError, match=r"outptu: no such folder here, nor a model of that name in the Hugging "
                                                r"Face hub cache, and HF_HUB_OFFLINE is set, so the hub is not asked: "
                                                r"check the name or path"):
        load_tokenizer("outptu")


@pytest.mark.parametrize("tool, flag", [("chat", "--path"), ("ppo_eval", "--policy"), ("ppo_eval", "--baseline"),
                                        ("ppo_eval", "--reward_model"),
                                        ("prompt_eval", "--model_name_or_path_finetune"),
                                        ("rw_eval", "--model_name_or_path")])
def test_an_empty_model_path_is_an_error_naming_its_flag(tool, flag, models):
    """``--path "$OUT"`` with OUT unset: the empty name went to the hub client, whose error ("Repo id must use
    alphanumeric chars ...: ''") named no flag; ppo_eval left an empty --baseline or --reward_model out, unsaid."""
    from dschat.errors import UsageError
    from dschat.tools import chat

    argv = {"chat": ["--prompt", "hi"], "ppo_eval": ["--policy", models["policy"], "--reward_model", models["rm"]],
            "prompt_eval": ["--model_name_or_path_baseline", models["policy"]], "rw_eval": []}[tool]
    main = {"chat": chat.main, "ppo_eval": ppo_eval.main, "prompt_eval": prompt_eval.main, "rw_eval": rw_eval.main}
    with pytest.raises(UsageError, match=f"^{flag} '': an empty path"):
        main[tool]([*argv, flag, ""])


@pytest.mark.parametrize("tool, argv", [
    ("prompt_eval", ["--model_name_or_path_baseline", "a", "--model_name_or_path_finetune", "b", "--prompts_file"]),
    ("rw_eval", ["--model_name_or_path", "a", "--pairs_file"]),
    ("ppo_eval", ["--policy", "a", "--output_json"]),
])
def test_an_empty_file_flag_is_an_error_naming_it(tool, argv, capsys):
    """``--prompts_file "$DATA"`` with DATA unset was taken as not given: the tool read the embedded data instead (or
    ppo_eval saved no results), unsaid."""
    main = {"prompt_eval": prompt_eval.main, "rw_eval": rw_eval.main, "ppo_eval": ppo_eval.main}[tool]
    with pytest.raises(SystemExit) as stop:
        main([*argv, ""])
    assert stop.value.code == 2
    assert f"argument {argv[-1]}: an empty path (an unset shell variable?)" in capsys.readouterr().err


def test_a_peft_adapter_folder_is_an_error_that_says_so(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")  # PEFT's save_pretrained: adapter weights, no config.json
    with pytest.raises(FileNotFoundError, match="a PEFT adapter folder .*merge"):
        find_policy_path(str(tmp_path))


def gpt2_models(root):
    """A tiny GPT-2 policy and reward model: learned positions (a table of 512), where a longer sequence is an
    IndexError in the forward, not a drift."""
    policy = create_tiny_model("tiny-gpt2", root / "gpt2")
    save_reward_model(create_critic_model(policy, None), load_tokenizer(policy), str(root / "gpt2_rm"))
    return policy, str(root / "gpt2_rm")


def test_the_report_holds_only_the_recipes_steps(tmp_path):
    from dschat.report import build_report

    for folder, metrics in (("step1_sft", {"eval_loss": 0.7}), ("step2_rm", {"accuracy": 0.9}),
                            ("step3_ppo", {"eval_before": {"rule_score_mean": 0.5}, "iterations": 4})):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "metrics.json").write_text(json.dumps(metrics))
    ppo = build_report(str(tmp_path), {}, "ppo")
    assert ppo["rm_accuracy"] == 0.9 and ppo["step3_iterations"] == 4
    grpo = build_report(str(tmp_path), {}, "grpo")  # a GRPO run after a PPO run: the old reward model is not its
    assert grpo["rm_accuracy"] is None and grpo["step3_iterations"] == 4
    dpo = build_report(str(tmp_path), {}, "dpo")
    assert dpo["sft_eval_loss"] == 0.7 and "held_out" not in dpo and dpo["rm_accuracy"] is None


def test_the_report_carries_step_1s_eval_records_and_tokens(tmp_path):
    """Step 1 counts the held-out records and answer tokens its eval loss was taken over (as step 2 and DPO count
    their pairs), and report.json left them out: the run's report and summary say them too, and an SFT with no
    held-out records is said, not a missing line."""
    from dschat.report import build_report, summary_lines

    (tmp_path / "step1_sft").mkdir()
    metrics = {"eval_loss": 0.7, "perplexity": 2.01, "eval_records": 1, "eval_tokens": 9}
    (tmp_path / "step1_sft" / "metrics.json").write_text(json.dumps(metrics))
    report = build_report(str(tmp_path), {}, "ppo")
    assert report["sft_eval_records"] == 1 and report["sft_eval_tokens"] == 9
    assert "SFT eval loss: 0.7000 (perplexity 2.01) over 1 held-out record (9 scored tokens)" in summary_lines(report)
    metrics.update(eval_loss=None, perplexity=None, eval_records=0, eval_tokens=0)
    (tmp_path / "step1_sft" / "metrics.json").write_text(json.dumps(metrics))
    assert "SFT: no held-out records, so no eval loss" in summary_lines(build_report(str(tmp_path), {}, "ppo"))


def test_the_report_keeps_how_many_of_step_2s_pairs_trained_with_a_margin(tmp_path):
    """Step 2's count of training pairs with a margin was in its log alone: report.json and the summary keep it."""
    from dschat.report import build_report, summary_lines

    rm = {"accuracy": 0.75, "chosen_mean_score": 0.2, "rejected_mean_score": 0.1, "eval_pairs": 8,
          "train_margin_pairs": 24}
    (tmp_path / "step2_rm").mkdir()
    (tmp_path / "step2_rm" / "metrics.json").write_text(json.dumps(rm))
    report = build_report(str(tmp_path), {}, "ppo")
    assert report["rm_train_margin_pairs"] == 24
    assert "RM trained on 24 pairs with a margin, subtracted in its loss: -logsigmoid(chosen - rejected - margin)" \
        in summary_lines(report)


def test_the_report_says_the_tied_pairs_of_the_rm_and_dpo_accuracies(tmp_path):
    """A tie counts half in step 2's and DPO's accuracies, and the summary did not say how many pairs tied: an accuracy
    of 0.5 of a model that scores every pair alike read as chance. Where none tied, nothing is added."""
    from dschat.report import build_report, summary_lines

    dpo = {"reference_logp_accuracy": 0.5, "logp_accuracy": 0.75, "reward_accuracy": 0.5, "chosen_reward": 0.0,
           "rejected_reward": 0.0, "reward_margin": 0.0, "eval_loss": 0.69, "eval_pairs": 4, "reference_logp_ties": 4,
           "logp_ties": 0, "reward_ties": 2}
    rm = {"accuracy": 0.5, "chosen_mean_score": 0.1, "rejected_mean_score": 0.1, "eval_pairs": 8, "ties": 8}
    for folder, metrics in (("step2_rm", rm), ("step2_dpo", dpo)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "metrics.json").write_text(json.dumps(metrics))
    rm_line = next(line for line in summary_lines(build_report(str(tmp_path), {}, "ppo")) if line.startswith("RM "))
    assert rm_line == "RM held-out accuracy: 0.5000 (8 of 8 pairs tied, each counted half) (chosen 0.100 vs " \
                      "rejected 0.100)"
    lines = [line for line in summary_lines(build_report(str(tmp_path), {}, "dpo")) if line.startswith("DPO ")]
    assert "SFT 0.5000 (4 of 4 pairs tied, each counted half) -> DPO 0.7500" in lines[0] and lines[0].endswith("0.7500")
    assert "accuracy 0.5000 (2 of 4 pairs tied, each counted half); eval loss" in lines[1]
    assert not any("with a margin" in line for line in summary_lines(build_report(str(tmp_path), {}, "ppo")))
    rm.pop("ties")  # a run from before the ties were counted, or none tied: the line as it was
    (tmp_path / "step2_rm" / "metrics.json").write_text(json.dumps(rm))
    assert "RM held-out accuracy: 0.5000 (chosen 0.100 vs rejected 0.100)" in \
        summary_lines(build_report(str(tmp_path), {}, "ppo"))


def test_the_reports_and_tools_say_a_count_of_one_in_the_singular():
    """"1 pairs", "1 prompts": the report's, ppo_eval's and the resume lines' counts go through report.counted."""
    from dschat.report import dpo_summary_lines
    from dschat.tools.ppo_eval import summary_line

    dpo = {"reference_logp_accuracy": 1.0, "logp_accuracy": 1.0, "reward_accuracy": 0.5, "chosen_reward": 0.0,
           "rejected_reward": 0.0, "reward_margin": 0.0, "eval_loss": 0.69, "eval_pairs": 1, "reward_ties": 1,
           "held_out_rule_score": {"sft": {"rule_score": 0.5, "prompts": 1}, "dpo": {"rule_score": 0.6, "prompts": 1}}}
    lines = dpo_summary_lines(dpo)
    assert "(chosen answer more likely, 1 pair): " in lines[0] and "(1 of 1 pair tied, each counted half)" in lines[1]
    assert "held-out rule score of greedy answers (1 prompt): " in lines[2]
    assert "over 1 prompt (run/sft)" in summary_line("sft", {"prompts": 1, "path": "run/sft", "rule_score_mean": 0.5})
    assert "over 2 prompts (run/sft)" in summary_line("sft", {"prompts": 2, "path": "run/sft", "rule_score_mean": 0.5})


def test_a_critic_free_run_has_no_critic_loss_curve_or_panel(tmp_path, monkeypatch):
    from dschat import report

    (tmp_path / "step3_ppo").mkdir()
    (tmp_path / "step3_ppo" / "metrics.json").write_text(json.dumps({"iterations": 2}))
    rows = [{"reward": 0.5, "kl": 0.0, "actor_loss": 0.1}, {"reward": 0.6, "kl": 0.01, "actor_loss": 0.2}]
    (tmp_path / "step3_ppo" / "step3_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    panels = []
    monkeypatch.setattr(report, "plot_curves", lambda curve, path, *_: panels.append(sorted(curve)) or path)
    written = report.write_report(str(tmp_path), {}, "grpo")
    assert set(written["step3_curve"]) == {"reward", "kl", "actor_loss"} == set(panels[0])
    with_critic = [dict(r, critic_loss=0.3) for r in rows]
    (tmp_path / "step3_ppo" / "step3_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in with_critic))
    assert report.build_report(str(tmp_path), {}, "ppo")["step3_curve"]["critic_loss"] == [0.3, 0.3]


def test_a_grpo_runs_kl_loss_is_a_curve_and_a_panel_beside_its_k1_kl(tmp_path, monkeypatch):
    """GRPO's loss penalises k3 of the policy to the reference, logged as kl_loss; the report's curves and plot had
    only kl, the rollout's k1, which can fall below 0 while the penalised KL cannot."""
    from dschat import report

    (tmp_path / "step3_ppo").mkdir()
    (tmp_path / "step3_ppo" / "metrics.json").write_text(json.dumps({"iterations": 2}))
    rows = [{"reward": 0.5, "kl": -0.002, "kl_loss": 0.001, "actor_loss": 0.1},
            {"reward": 0.6, "kl": 0.01, "kl_loss": 0.012, "actor_loss": 0.2}]
    (tmp_path / "step3_ppo" / "step3_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    panels = []
    real_plot = report.plot_curves
    monkeypatch.setattr(report, "plot_curves", lambda curve, path, *rest: panels.append(curve) or path)
    written = report.write_report(str(tmp_path), {}, "grpo")
    assert written["step3_curve"]["kl_loss"] == [0.001, 0.012] and written["step3_curve"]["kl"] == [-0.002, 0.01]
    titles = []
    monkeypatch.setattr("matplotlib.axes.Axes.set_title", lambda ax, title, *a, **k: titles.append(title))
    real_plot(panels[0], str(tmp_path / "curves.png"), "GRPO")
    assert titles == ["reward", "kl", "kl_loss", "actor_loss"]


def test_the_curves_of_a_grpo_run_are_over_grpo_iterations(tmp_path, monkeypatch):
    """A GRPO run's step3_curves.png was labelled 'PPO iteration' under every panel, where its summary says 'GRPO: N
    iterations'."""
    from matplotlib.figure import Figure

    from dschat import report

    (tmp_path / "step3_ppo").mkdir()
    (tmp_path / "step3_ppo" / "metrics.json").write_text(json.dumps({"iterations": 2, "algorithm": "GRPO"}))
    rows = [{"reward": 0.5, "kl": 0.0, "actor_loss": 0.1}, {"reward": 0.6, "kl": 0.01, "actor_loss": 0.2}]
    (tmp_path / "step3_ppo" / "step3_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    labels, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: labels.extend(ax.get_xlabel() for ax in fig.axes)
                        or savefig(fig, *a, **k))
    written = report.write_report(str(tmp_path), {}, "grpo")
    assert written["plot"] and labels == ["GRPO iteration"] * 3


def test_the_curves_are_replaced_whole(tmp_path, monkeypatch):
    """step3_curves.png was drawn straight into its place: a run stopped while matplotlib wrote it (killed, a full
    disk) left the earlier run's plot cut short, an unreadable PNG."""
    from matplotlib.figure import Figure

    from dschat.report import plot_curves

    path = tmp_path / "step3_curves.png"
    curve = {"reward": [0.5, 0.6], "kl": [0.0, 0.01]}
    plot_curves(curve, str(path))
    earlier = path.read_bytes()

    def cut_short(fig, target, **kwargs):
        target.write(earlier[:100]) if hasattr(target, "write") else open(target, "wb").write(earlier[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", cut_short)
    with pytest.raises(OSError):
        plot_curves(curve, str(path))
    assert path.read_bytes() == earlier and os.listdir(tmp_path) == ["step3_curves.png"]


def test_a_report_without_step_3_does_not_read_an_interrupted_step_3s_log(tmp_path):
    """A DPO run (or --step 1 2) into a folder where a PPO run's step 3 was killed while writing a log line failed
    at its report with a JSONDecodeError: the report read step3_log.jsonl though it reports no step 3."""
    from dschat.report import build_report

    (tmp_path / "step1_sft").mkdir()
    (tmp_path / "step1_sft" / "metrics.json").write_text(json.dumps({"eval_loss": 0.7, "perplexity": 2.0}))
    (tmp_path / "step3_ppo").mkdir()  # no metrics.json: unfinished
    (tmp_path / "step3_ppo" / "step3_log.jsonl").write_text('{"iteration": 1, "reward": 0.5}\n{"iteration": 2, "re')
    for recipe, steps in (("dpo", [1, 2]), ("ppo", [1, 2])):
        report = build_report(str(tmp_path), {}, recipe, steps_run=steps)
        assert report["sft_eval_loss"] == 0.7 and "step3_curve" not in report


def test_a_report_without_step_3_removes_an_earlier_runs_curves(tmp_path):
    """train.py --recipe dpo (or --step 1) after a PPO run into the same folder left that run's step3_curves.png
    beside a report that holds no step 3, where it passed for this run's curves."""
    from dschat import report

    (tmp_path / "step3_ppo").mkdir()
    (tmp_path / "step3_ppo" / "metrics.json").write_text(json.dumps({"iterations": 1}))
    (tmp_path / "step3_ppo" / "step3_log.jsonl").write_text(json.dumps({"reward": 0.5, "kl": 0.0}) + "\n")
    assert report.write_report(str(tmp_path), {}, "ppo")["plot"] == str(tmp_path / "step3_curves.png")
    assert (tmp_path / "step3_curves.png").is_file()
    written = report.write_report(str(tmp_path), {}, "dpo", steps_run=[1, 2])
    assert "plot" not in written and not (tmp_path / "step3_curves.png").exists()


def test_the_report_leaves_out_later_steps_an_earlier_run_made_from_a_step_run_again(tmp_path):
    # train.py --step 1 after a full run: the step-2 and step-3 folders were made from the old SFT model
    from dschat.report import build_report, summary_lines

    for folder, metrics in (("step1_sft", {"eval_loss": 0.7, "perplexity": 2.0}), ("step2_rm", {"accuracy": 0.9}),
                            ("step3_ppo", {"eval_before": {"rule_score_mean": 0.5}, "iterations": 4})):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "metrics.json").write_text(json.dumps(metrics))
    for policy in ("step1_sft", "step3_ppo/actor"):
        (tmp_path / policy).mkdir(exist_ok=True)
        (tmp_path / policy / "config.json").write_text("{}")
    again = build_report(str(tmp_path), {}, "ppo", steps_run=[1])
    assert again["sft_eval_loss"] == 0.7 and again["rm_accuracy"] is None and "held_out" not in again
    assert again["policy"] == "step1_sft" and again["not_reported"] == ["step2_rm", "step3_ppo"]
    assert any(line.startswith("not reported: step3_ppo") for line in summary_lines(again))
    later = build_report(str(tmp_path), {}, "ppo", steps_run=[2, 3])  # steps after the ones run stay theirs
    assert later["rm_accuracy"] == 0.9 and later["policy"] == "step3_ppo/actor" and later["not_reported"] == []
    assert build_report(str(tmp_path), {}, "ppo", steps_run=[1, 3])["not_reported"] == ["step2_rm"]
    # another recipe's folders made from the old SFT model are said too (only folders that are there)
    assert build_report(str(tmp_path), {}, "grpo", steps_run=[1])["not_reported"] == ["step2_rm", "step3_ppo"]
    assert build_report(str(tmp_path), {}, "dpo", steps_run=[1])["not_reported"] == ["step2_rm", "step3_ppo"]
    assert build_report(str(tmp_path), {}, "dpo", steps_run=[1, 2])["not_reported"] == ["step2_rm", "step3_ppo"]
    assert build_report(str(tmp_path), {}, "dpo", steps_run=[2])["not_reported"] == []  # the same SFT model
    # --reward-model (not the tiny default): step 2 started from it, not from the SFT model, and stays this run's
    own = build_report(str(tmp_path), {}, "ppo", steps_run=[1], rm_from_sft=False)
    assert own["rm_accuracy"] == 0.9 and own["not_reported"] == ["step3_ppo"]
    assert build_report(str(tmp_path), {}, "ppo", steps_run=[1, 3], rm_from_sft=False)["not_reported"] == []
    # a trained reward model given to step 3: step2_rm is this run's only when it is that model
    given = build_report(str(tmp_path), {}, "ppo", steps_run=[3], rm_from_sft=False,
                         reward_model=str(tmp_path / "elsewhere"))
    assert given["rm_accuracy"] is None and given["not_reported"] == ["step2_rm"]
    itself = build_report(str(tmp_path), {}, "ppo", steps_run=[3], rm_from_sft=False,
                          reward_model=str(tmp_path / "step3_ppo" / ".." / "step2_rm"))
    assert itself["rm_accuracy"] == 0.9 and itself["not_reported"] == []


def test_scoring_with_a_folder_that_is_not_a_reward_model_is_an_error(models, reachable_hub):
    from dschat.tools.common import load_scoring_reward_model

    tokenizer = load_tokenizer(models["policy"])
    with pytest.raises(ValueError, match="not a reward model"):  # its value head would be new and random
        load_scoring_reward_model(str(models["policy"]), tokenizer, device="cpu")
    with pytest.raises(ValueError, match="not a reward model"):  # a preset's folder: no value head either
        load_scoring_reward_model("tiny-llama", tokenizer, device="cpu")
    assert load_scoring_reward_model(models["rm"], tokenizer, device="cpu").v_head.weight.abs().sum() > 0
    from dschat.tools.common import find_reward_model_path

    # a path that is no folder: said at once (was a minute of hub retries, or "not a reward model")
    with pytest.raises(FileNotFoundError, match="output/step2_rm: no such folder"):
        find_reward_model_path("output/step2_rm")
    assert find_reward_model_path("acme/rm") == "acme/rm", "a hub name is loaded as one (the hub answers)"
    assert find_reward_model_path(models["rm"]) == models["rm"]


def test_the_tools_name_the_flag_of_a_missing_model_before_any_model_loads(models, tmp_path, monkeypatch):
    """Before, a mistyped second model failed after the first had loaded and generated, without naming its flag."""
    import dschat.tools.common

    monkeypatch.setattr(dschat.tools.common, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    monkeypatch.setattr(prompt_eval, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=f"--model_name_or_path_finetune {missing}: no such folder"):
        prompt_eval.main(["--model_name_or_path_baseline", models["policy"], "--model_name_or_path_finetune", missing])
    with pytest.raises(FileNotFoundError, match=f"--baseline {missing}: no such folder"):
        ppo_eval.main(["--policy", models["policy"], "--baseline", missing, "--reward_model", models["rm"]])
    with pytest.raises(FileNotFoundError, match=f"--reward_model {missing}: no such folder"):
        ppo_eval.main(["--policy", models["policy"], "--reward_model", missing])
    with pytest.raises(FileNotFoundError, match=f"--model_name_or_path {missing}: no such folder"):
        rw_eval.main(["--model_name_or_path", missing])
    with pytest.raises(FileNotFoundError, match="pairs.jsonl"):  # read before the reward model loads
        monkeypatch.setattr(rw_eval, "load_scoring_reward_model", lambda *a, **k: pytest.fail("the model loaded"))
        rw_eval.main(["--model_name_or_path", models["rm"], "--pairs_file", str(tmp_path / "pairs.jsonl")])


def _half_moved_save(models, folder, reward):
    """A copy of the tiny policy (or reward model) in ``folder`` that a save of the other weights (``baseline``) was
    killed in part-way while it moved its files in one by one (the folder was the working directory, so it could not
    be swapped): new files beside old ones, the rest in the save's marked copy (``save_moving_path``). The folder and
    the model saved."""
    from dschat.models.checkpoint import save_causal_lm
    from dschat.models.loading import load_causal_lm
    from dschat.run_layout import save_moving_path

    shutil.copytree(models["rm" if reward else "policy"], folder)
    tokenizer = load_tokenizer(models["baseline"])
    model = (create_critic_model(models["baseline"], tokenizer) if reward
             else load_causal_lm(models["baseline"], tokenizer))
    replaces, real_replace = [0], os.replace

    def killed_at_the_third(*args, **kwargs):
        replaces[0] += 1
        if replaces[0] == 3:  # (the first is the record of the names; then one model file moved in, then the kill)
            raise KeyboardInterrupt
        return real_replace(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.chdir(folder)
        patch.setattr(os, "replace", killed_at_the_third)
        (save_reward_model if reward else save_causal_lm)(model, tokenizer, str(folder))
    assert os.path.isdir(save_moving_path(str(folder)))
    return str(folder), model


@pytest.mark.parametrize("load", ["load_tokenizer", "load_policy", "load_causal_lm", "create_hf_model",
                                  "load_reward_model", "create_critic_model", "chat", "prompt_eval", "rw_eval",
                                  "ppo_eval", "ppo_eval --reward_model"])
def test_a_folder_a_save_was_killed_moving_into_is_refused_by_every_loader_until_finished(load, models, tmp_path):
    """A save into a folder that cannot be swapped (a mount point, the working directory) moves its files in one by
    one; a kill part-way leaves new and old files mixed in it. Only the steps' checks refused it: a notebook's
    load_tokenizer, load_causal_lm or load_reward_model and the tools loaded the mix (the first model's weights under
    the second's config and tokenizer, or part of each's shards) as if it were a model. Each now refuses it, naming
    the folder and how to finish the save, after which it loads as the new save."""
    from transformers import AutoModelForCausalLM

    from dschat.errors import UsageError
    from dschat.models.checkpoint import finish_interrupted_save
    from dschat.models.loading import create_hf_model, load_causal_lm
    from dschat.tools import chat

    reward = load in ("load_reward_model", "create_critic_model", "rw_eval", "ppo_eval --reward_model")
    load = load.split()[0]  # (ppo_eval's policy, then its reward model)
    folder, saved = _half_moved_save(models, tmp_path / "model", reward)
    policy, rm = (models["policy"], folder) if reward else (folder, models["rm"])
    tokenizer = load_tokenizer(models["policy"])
    loads = {
        "load_tokenizer": lambda: load_tokenizer(folder),
        "load_policy": lambda: load_policy(folder, device="cpu"),
        "load_causal_lm": lambda: load_causal_lm(folder, tokenizer),
        "create_hf_model": lambda: create_hf_model(AutoModelForCausalLM, folder, tokenizer),
        "load_reward_model": lambda: load_reward_model(folder, tokenizer=tokenizer),
        "create_critic_model": lambda: create_critic_model(folder, tokenizer),
        "chat": lambda: chat.main(["--path", folder, "--prompt", "hi"]),
        "prompt_eval": lambda: prompt_eval.main(["--model_name_or_path_baseline", models["baseline"],
                                                 "--model_name_or_path_finetune", folder, "--num_prompts", "1"]),
        "rw_eval": lambda: rw_eval.main(["--model_name_or_path", folder, "--num_pairs", "2"]),
        "ppo_eval": lambda: ppo_eval.main(["--policy", policy, "--reward_model", rm, "--num_prompts", "2",
                                           "--max_new_tokens", "2"]),
    }
    with pytest.raises(UsageError, match=re.escape(folder) + r" holds part of a save interrupted while it moved its "
                                         r"files in one by one.*finish_interrupted_save"):
        loads[load]()
    finish_interrupted_save(folder)  # (what the message says: the save's move finished)
    loaded = load_reward_model(folder) if reward else load_causal_lm(folder, tokenizer)
    assert all(torch.equal(saved.state_dict()[name], weights) for name, weights in loaded.state_dict().items())


def test_a_policy_where_a_reward_model_belongs_is_refused_with_its_flag_before_any_model_loads(models, monkeypatch):
    """ppo_eval --reward_model and rw_eval --model_name_or_path given an SFT folder were refused without their flag,
    ppo_eval's after the policy had loaded."""
    import dschat.tools.common
    from dschat.errors import UsageError

    monkeypatch.setattr(dschat.tools.common, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    policy = models["policy"]
    with pytest.raises(UsageError, match=f"--reward_model {policy}: not a reward model"):
        ppo_eval.main(["--policy", policy, "--reward_model", policy])
    with pytest.raises(UsageError, match=f"--model_name_or_path {policy}: not a reward model"):
        rw_eval.main(["--model_name_or_path", policy])


def test_a_reward_model_where_a_policy_belongs_is_an_error(models):
    from dschat.errors import UsageError
    from dschat.models.loading import load_causal_lm

    tokenizer = load_tokenizer(models["policy"])
    with pytest.raises(UsageError, match="a reward model .*not a policy"):  # it would generate from a random LM head
        load_policy(models["rm"], device="cpu")
    with pytest.raises(UsageError, match="not a policy"):  # the steps' loader (SFT base, PPO actor, DPO policy)
        load_causal_lm(models["rm"], tokenizer)


def test_a_step3_critic_given_as_the_policy_is_said_to_be_the_critic(models, tmp_path):
    """chat.py --path <run>/step3_ppo/critic was refused as "a reward model (step 2's output)": step 3 saves its
    critic with the same files, so it is known by its place beside the actor."""
    from dschat.errors import UsageError
    from dschat.tools import chat

    step3 = tmp_path / "step3_ppo"
    shutil.copytree(models["rm"], step3 / "critic")
    (step3 / RUN_ARGS_FILE).write_text("{}")
    with pytest.raises(UsageError, match=f"^--path {re.escape(str(step3 / 'critic'))}: step 3's critic .*not a policy"):
        chat.main(["--path", str(step3 / "critic"), "--prompt", "hi"])
    step2 = tmp_path / "step2_rm"  # a folder of its own training_args.json: step 2's output
    shutil.copytree(models["rm"], step2)
    (step2 / RUN_ARGS_FILE).write_text("{}")
    with pytest.raises(UsageError, match=r"a reward model \(step 2's output\), not a policy"):  # (as before)
        chat.main(["--path", str(step2), "--prompt", "hi"])
    # saved elsewhere (a notebook's save_reward_model) and not marked a critic: either, as a critic of an older dschat
    with pytest.raises(UsageError, match=r"a reward model or critic \(a value-head model\), not a policy"):
        chat.main(["--path", models["rm"], "--prompt", "hi"])


def test_a_step3_critic_given_as_the_reward_model_is_warned_of(models, tmp_path, capsys):
    """rw_eval (and ppo_eval's --reward_model) scored with step 3's critic, saved with a reward model's files, as if it
    were the reward model, unsaid: its head learned PPO's value estimates, not step 2's rewards."""
    from dschat.tools import rw_eval

    step3 = tmp_path / "step3_ppo"
    shutil.copytree(models["rm"], step3 / "critic")
    (step3 / RUN_ARGS_FILE).write_text("{}")
    for path in (str(step3 / "critic"), models["rm"]):
        rw_eval.main(["--model_name_or_path", path, "--prompt", "Say hi.", "--answer", "hi"])
        warned = f"warning: {path}: step 3's critic (the value model PPO trains beside the actor), not a reward model"
        assert (warned in capsys.readouterr().err) == (path != models["rm"])


def test_step3_and_the_tools_say_a_critic_given_as_the_reward_model_in_the_same_sentence(models, tmp_path, capsys,
                                                                                          monkeypatch):
    """Step 3 (``warn_of_a_critic_as_reward_model``) and rw_eval/ppo_eval (``check_reward_model``) warned of the same
    thing, a step-3 critic scoring as the reward model, in two wordings; each keeps its own prefix and remedy."""
    from dschat.rlhf.config import warn_of_a_critic_as_reward_model
    from dschat.tools.common import check_reward_model

    critic = tmp_path / "step3_ppo" / "critic"
    shutil.copytree(models["rm"], critic)
    (critic.parent / RUN_ARGS_FILE).write_text("{}")
    sentence = (f"{critic}: step 3's critic (the value model PPO trains beside the actor), not a reward model: it "
                "scores with PPO's value estimates, not step 2's rewards (step 2's output folder, e.g. train.py's "
                "<output>/step2_rm, holds the reward model)")
    for warn, prefix in ((check_reward_model, "warning: "), (warn_of_a_critic_as_reward_model, "warning: step3: ")):
        monkeypatch.setattr("dschat.utils.cli._SAID", set())
        warn(str(critic))
        assert capsys.readouterr().err.startswith(prefix + sentence), warn.__name__


def test_a_step3_critic_on_the_hub_given_as_the_reward_model_is_warned_of_from_the_files_fetched_once(
        models, hub_cache, capsys, monkeypatch):
    """The tools warned of a critic given as the reward model only for a folder: a hub name's reward_model.json
    ("role": "critic", as a notebook's save_reward_model(engine.critic, ...) writes it) was left unread, as a second
    fetch of its files. Now read from the files the value-head check fetched, no hub request of its own."""
    from dschat.tools import rw_eval
    from dschat.tools.common import check_reward_model
    from helpers import hub_files_asked

    name = "acme/ppo-critic"
    snapshot = hub_cache(name, lambda folder: shutil.copytree(models["rm"], folder))
    meta = json.loads((snapshot / "reward_model.json").read_text())
    (snapshot / "reward_model.json").write_text(json.dumps({**meta, "role": "critic"}))
    asked = hub_files_asked(monkeypatch, name)
    warned = f"warning: {name}: step 3's critic (the value model PPO trains beside the actor), not a reward model"
    check_reward_model(name)
    assert warned in capsys.readouterr().err
    assert asked.count("config.json") == 1, asked
    monkeypatch.setattr("dschat.utils.cli._SAID", set())
    rw_eval.main(["--model_name_or_path", name, "--prompt", "Say hi.", "--answer", "hi"])  # (as it loads to score)
    assert warned in capsys.readouterr().err


def test_a_reward_model_as_the_second_policy_is_refused_with_its_flag_before_any_model_loads(models, monkeypatch):
    """ppo_eval's --baseline and prompt_eval's --model_name_or_path_finetune were refused only once that model loaded,
    after the first one had answered every prompt (a long wait with real models), and without their flag."""
    from dschat.errors import UsageError

    fail = lambda *a, **k: pytest.fail("a model loaded before the reward model was refused")  # noqa: E731
    monkeypatch.setattr(ppo_eval, "load_policy", fail)
    monkeypatch.setattr(prompt_eval, "load_policy", fail)
    with pytest.raises(UsageError, match=f"--baseline {re.escape(models['rm'])}: a reward model .*not a policy"):
        ppo_eval.main(["--policy", models["policy"], "--baseline", models["rm"], "--reward_model", models["rm"]])
    with pytest.raises(UsageError, match="--model_name_or_path_finetune .*: a reward model .*not a policy"):
        prompt_eval.main(["--model_name_or_path_baseline", models["policy"], "--model_name_or_path_finetune",
                          models["rm"], "--prompts", "Say hi."])


def test_ppo_eval_refuses_a_baseline_the_reward_model_cannot_read_before_any_model_loads(models, tmp_path,
                                                                                        monkeypatch):
    """A baseline whose tokenizer formats text otherwise than the reward model's was refused only after the policy
    had answered and been scored on every held-out prompt."""
    from dschat.errors import UsageError

    baseline = tmp_path / "templated"
    shutil.copytree(models["baseline"], baseline)
    config_file = baseline / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    config_file.write_text(json.dumps(config))
    monkeypatch.setattr(ppo_eval, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    with pytest.raises(UsageError, match=f"{re.escape(str(baseline))} .*chat template"):
        ppo_eval.main(["--policy", models["policy"], "--baseline", str(baseline), "--reward_model", models["rm"]])


def test_answer_text_drops_eot_what_follows_and_padding(session):
    tokenizer = session.tokenizer
    ids = tokenizer(" red, blue", add_special_tokens=False)["input_ids"]
    junk = tokenizer(" Human: more", add_special_tokens=False)["input_ids"]
    row = ids + [tokenizer.eos_token_id] + junk + [tokenizer.pad_token_id]
    assert decode_answers(tokenizer, torch.tensor([row])) == ["red, blue"]


def test_second_turn_prompt_holds_the_first_turn(session, models):
    tokenizer = session.tokenizer
    history = [{"role": "user", "content": "Name 3 colors."}, {"role": "assistant", "content": "red, blue, green"}]
    messages, prompt = conversation_prompt(history, "Say tea twice.", tokenizer)
    assert prompt == "\n\nHuman: Name 3 colors.\n\nAssistant: red, blue, green\n\nHuman: Say tea twice.\n\nAssistant:"
    assert messages == history + [{"role": "user", "content": "Say tea twice."}]

    session.clear()
    first = session.ask("Name 3 colors.")
    _, second_prompt = conversation_prompt(session.history, "Say tea twice.", tokenizer)
    assert second_prompt.startswith(f"\n\nHuman: Name 3 colors.\n\nAssistant: {first}\n\nHuman: Say tea twice.")
    session.ask("Say tea twice.")
    assert [m["role"] for m in session.history] == ["user", "assistant", "user", "assistant"]


def test_long_chat_forgets_oldest_exchanges_to_fit_the_context(session, monkeypatch):
    session.clear()
    session.history = [{"role": "user", "content": "old " * 60}, {"role": "assistant", "content": "x"},
                       {"role": "user", "content": "recent"}, {"role": "assistant", "content": "y"}]
    monkeypatch.setattr(session.model.config, "max_position_embeddings", 40)
    messages, prompt = session.next_prompt("now")
    assert "old" not in prompt and "recent" in prompt
    assert messages[-1] == {"role": "user", "content": "now"}
    lines, printed = iter(["now", "and now", "quit"]), []
    run_interactive(session, read=lambda _: next(lines), write=printed.append)
    notes = [p for p in printed if p.startswith("(the oldest")]
    assert notes and notes[0].startswith("(the oldest 1 exchange(s) no longer fit"), printed
    assert printed.index(notes[0]) == 1 and printed[2].startswith("Assistant: "), "said before its answer"


def test_ctrl_c_during_an_answer_stops_that_answer_and_the_chat_goes_on(session, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) while the model answered ended the whole chat (exit 130); at a terminal it now stops
    that answer, leaves the message out of the conversation and reads the next one. Piped input still ends."""
    from dschat.tools import chat

    answers = chat.generate_answers_and_cuts
    calls = []

    def interrupted_once(*args, **kwargs):
        calls.append(args[2])
        if len(calls) == 1:
            raise KeyboardInterrupt
        return answers(*args, **kwargs)

    monkeypatch.setattr(chat, "generate_answers_and_cuts", interrupted_once)
    session.clear()
    lines, printed = iter(["first", "second", "quit"]), []
    run_interactive(session, read=lambda _: next(lines), write=printed.append, interrupt_stops_answer=True)
    assert printed[1] == "(answer stopped: the message is left out of the conversation)"
    assert printed[2].startswith("Assistant: ") and len(calls) == 2
    assert [m["content"] for m in session.history if m["role"] == "user"] == ["second"]
    calls.clear()
    lines = iter(["first", "second", "quit"])
    with pytest.raises(KeyboardInterrupt):  # (piped input: no one to go on with)
        run_interactive(session, read=lambda _: next(lines), write=printed.append)


def test_max_new_tokens_filling_the_context_is_refused_once_before_the_model_loads(models, monkeypatch):
    """--max_new_tokens at the model's context length (or more) left no room for any prompt: interactive mode loaded
    the model, then refused each message in turn ("leaves room for 0"), and --prompt said so after the load."""
    import io

    from dschat.errors import UsageError
    from dschat.tools import chat

    context = json.loads(Path(models["policy"], "config.json").read_text())["max_position_embeddings"]
    monkeypatch.setattr(chat, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nhello\n"))
    for flags in ([], ["--prompt", "hi"]):
        with pytest.raises(UsageError, match=f"^--max_new_tokens {context}: the model's context is {context} tokens"):
            chat.main(["--path", models["policy"], "--max_new_tokens", str(context), *flags])


def test_a_multimodal_configs_context_is_its_text_configs(monkeypatch):
    """A multimodal config (Gemma-3's, which AutoModelForCausalLM loads whole) keeps its positions in its text config:
    chat.py and prompt_eval read no context from it, so --max_new_tokens filling it was not refused and a long chat
    forgot no exchange before generating past its positions. The tools' context is ``models.positions``' now, read
    as ``position_limit`` reads a model's table (which stops at a RoPE scaling's switch too, where the context does
    not)."""
    from types import SimpleNamespace as NS

    from transformers import Gemma3Config

    from dschat.errors import UsageError
    from dschat.models.positions import position_limit
    from dschat.tools.common import check_room_for_a_prompt, context_limit

    config = Gemma3Config()
    context = config.get_text_config().max_position_embeddings
    with pytest.raises(UsageError, match=f"^--max_new_tokens {context}: the model's context is {context} tokens"):
        check_room_for_a_prompt(config, context)
    assert context_limit(config) == position_limit(NS(config=config)) == context
    longrope = NS(max_position_embeddings=131072, rope_scaling={"rope_type": "longrope",
                                                                "original_max_position_embeddings": 4096})
    assert (context_limit(longrope), position_limit(NS(config=longrope))) == (131072, 4096)


def test_prompt_eval_max_new_tokens_filling_a_models_context_is_refused_before_any_model_loads(models, monkeypatch):
    """prompt_eval --max_new_tokens at a model's context length (or more) was refused only once both models had loaded
    and the first batch was encoded."""
    from dschat.errors import UsageError

    context = json.loads(Path(models["policy"], "config.json").read_text())["max_position_embeddings"]
    monkeypatch.setattr(prompt_eval, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    with pytest.raises(UsageError, match=f"^--max_new_tokens {context}: the baseline model's context is {context} "
                                         "tokens"):
        prompt_eval.main(["--model_name_or_path_baseline", models["policy"], "--model_name_or_path_finetune",
                          models["policy"], "--max_new_tokens", str(context), "--prompts", "hi"])


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gpt2"])
def test_prompt_eval_names_a_prompt_too_long_for_a_models_context_before_any_model_loads(preset, models, tmp_path,
                                                                                        monkeypatch):
    """A prompt that with --max_new_tokens is longer than a model's context: past GPT-2's learned positions an error
    naming no prompt once the model had loaded and answered the earlier batches, past Llama's rotary ones a warning and
    answers from positions it never learned. Now the prompt is named, as chat.py refuses such a message."""
    from dschat.errors import UsageError

    baseline = create_tiny_model(preset, tmp_path / preset)
    monkeypatch.setattr(prompt_eval, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text(json.dumps({"prompt": "Say hi."}) + "\n" + json.dumps({"prompt": "red " * 600}) + "\n")
    said = (rf"^--prompts_file {prompts_file}: prompt 2 takes \d+ tokens for the baseline model; with --max_new_tokens "
            "8 its context of 512 tokens leaves room for 504")
    with pytest.raises(UsageError, match=said):
        prompt_eval.main(["--model_name_or_path_baseline", baseline, "--model_name_or_path_finetune",
                          models["policy"], "--max_new_tokens", "8", "--prompts_file", str(prompts_file)])
    with pytest.raises(UsageError, match="^--prompts: prompt 1 takes .* with --max_new_tokens 500 .* room for 12$"):
        prompt_eval.main(["--model_name_or_path_baseline", models["policy"], "--model_name_or_path_finetune",
                          baseline, "--max_new_tokens", "500", "--prompts", "Name three colors. Reply in uppercase."])


def test_chat_prompt_flag_reads_a_transcript_as_prompt_eval_does(session, models, monkeypatch, capsys):
    """chat.py --prompt "Human: ... Assistant: ... Human: ..." was one user message ("\n\nHuman: Human: ..."), where
    prompt_eval's --prompts and rw_eval's --prompt read the turns: the same text gave the tools other prompts. A
    transcript's system message stays when the oldest exchanges are forgotten."""
    from dschat.errors import UsageError
    from dschat.tools import chat

    prompts = []
    monkeypatch.setattr(chat, "generate_answers_and_cuts", lambda *args: prompts.extend(args[2]) or (["ok"], [False]))
    chat.main(["--path", models["policy"], "--greedy", "--prompt",
               "Human: Name 3 colors.\n\nAssistant: red, blue, green\n\nHuman: Three more?"])
    assert prompts == ["\n\nHuman: Name 3 colors.\n\nAssistant: red, blue, green\n\nHuman: Three more?\n\nAssistant:"]
    assert capsys.readouterr().out == "ok\n"
    monkeypatch.setattr(chat, "load_policy", lambda *a, **k: (session.model, session.tokenizer))
    monkeypatch.setattr(session.model.config, "max_position_embeddings", 40)
    chat.main(["--path", models["policy"], "--greedy", "--max_new_tokens", "6", "--prompt",
               f"Human: {'old ' * 20}\n\nAssistant: x\n\nHuman: now"])
    assert prompts[-1] == "\n\nHuman: now\n\nAssistant:"
    said = capsys.readouterr()
    assert said.out == "ok\n" and "(the oldest 1 exchange(s) no longer fit the model's context" in said.err
    session.clear()
    monkeypatch.setattr(session.model.config, "max_position_embeddings", 40)
    session.history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "old " * 60},
                       {"role": "assistant", "content": "x"}]
    messages, prompt = session.next_prompt("now")
    assert prompt == "Be brief.\n\nHuman: now\n\nAssistant:" and messages[0]["role"] == "system"
    session.history = [{"role": "system", "content": "Be brief. " * 60}]
    with pytest.raises(UsageError, match="the model's context of 40 tokens"):
        session.next_prompt("now")


def test_chat_refuses_an_empty_prompt_flag(capsys):
    from dschat.tools.chat import main

    with pytest.raises(SystemExit):
        main(["--path", "tiny-gpt2", "--prompt", "  "])
    assert "--prompt: the message is empty" in capsys.readouterr().err


def test_a_message_longer_than_the_context_is_refused_and_the_chat_goes_on(session, monkeypatch):
    from dschat.errors import UsageError

    session.clear()
    monkeypatch.setattr(session.model.config, "max_position_embeddings", 40)
    with pytest.raises(UsageError, match="the model's context of 40 tokens"):
        session.next_prompt("word " * 60)  # generation would run past the last position
    lines, printed = iter(["word " * 60, "Say tea twice.", "quit"]), []
    run_interactive(session, read=lambda _: next(lines), write=printed.append)
    assert any(p.startswith("(not answered: ") for p in printed)
    assert sum(p.startswith("Assistant: ") for p in printed) == 1  # (the next message answered)
    assert [m["content"] for m in session.history if m["role"] == "user"] == ["Say tea twice."]


def test_piped_messages_left_unanswered_end_the_chat_with_an_error_a_terminals_do_not(session, models, monkeypatch,
                                                                                       capsys):
    """Piped messages too long for the context were said as "(not answered: ...)" and the chat went on, but it ended
    with exit status 0: a script could not tell. Once the input ends, the lines not answered are a usage error (exit 2);
    at a terminal the person saw it, and the chat still ends as it did."""
    import io

    from dschat.errors import UsageError
    from dschat.tools import chat

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(chat, "load_policy", lambda *a, **k: (session.model, session.tokenizer))
    monkeypatch.setattr(session.model.config, "max_position_embeddings", 40)
    too_long = "word " * 60
    flags = ["--path", models["policy"], "--greedy", "--max_new_tokens", "2"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{too_long}\nSay tea twice.\n{too_long}\n"))
    with pytest.raises(UsageError, match=r"^standard input lines 1, 3: not answered \(said above"):
        chat.main(flags)
    out = capsys.readouterr().out
    assert out.count("(not answered: ") == 2 and out.count("Assistant: ") == 1  # (the chat went on between them)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Say tea twice.\nquit\n"))
    assert chat.main(flags) == 0  # (all answered)
    monkeypatch.setattr(sys, "stdin", Terminal(f"{too_long}\nquit\n"))
    assert chat.main(flags) == 0 and "(not answered: " in capsys.readouterr().out


def test_a_prompt_flag_longer_than_the_context_is_an_error_naming_the_flag(session, models, monkeypatch):
    """chat.py --prompt with a message too long for the model said "error: the message takes ..." naming no flag."""
    from dschat.errors import UsageError
    from dschat.tools import chat

    monkeypatch.setattr(chat, "load_policy", lambda *a, **k: (session.model, session.tokenizer))
    monkeypatch.setattr(session.model.config, "max_position_embeddings", 40)
    with pytest.raises(UsageError, match="^--prompt: the message takes .* the model's context of 40 tokens"):
        chat.main(["--path", models["policy"], "--greedy", "--max_new_tokens", "6", "--prompt", "word " * 60])


def test_a_prompt_flag_too_long_for_the_context_is_refused_before_the_model_loads(models, monkeypatch):
    """chat.py --prompt with a last message too long for the context even alone was refused only once the model had
    loaded; its earlier turns, which the chat leaves out to fit, still do not make it an error."""
    from dschat.errors import UsageError
    from dschat.tools import chat

    context = json.loads(Path(models["policy"], "config.json").read_text())["max_position_embeddings"]
    monkeypatch.setattr(chat, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    with pytest.raises(UsageError, match=f"^--prompt: the message takes .* the model's context of {context} tokens"):
        chat.main(["--path", models["policy"], "--greedy", "--max_new_tokens", "6", "--prompt", "word " * context])
    transcript = f"Human: {'word ' * context}\n\nAssistant: ok\n\nHuman: hi"
    with pytest.raises(pytest.fail.Exception, match="a model loaded first"):  # (fits once the first turns are left out)
        chat.main(["--path", models["policy"], "--greedy", "--max_new_tokens", "6", "--prompt", transcript])


def test_generation_flags_are_checked_and_top_k_below_one_is_off():
    import argparse

    from dschat.errors import UsageError
    from dschat.tools.common import add_generation_args, generation_kwargs

    parser = argparse.ArgumentParser()
    add_generation_args(parser, sample_by_default=True)
    assert generation_kwargs(parser.parse_args(["--top_k", "-1"]))["top_k"] == 0
    for flags, message in ((["--temperature", "0"], "--greedy"), (["--top_p", "1.5"], r"\(0, 1\]")):
        with pytest.raises(UsageError, match=message):
            generation_kwargs(parser.parse_args(flags))
    assert generation_kwargs(parser.parse_args(["--temperature", "0", "--greedy"]))["do_sample"] is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--max_new_tokens", "0"])


def test_a_seed_outside_the_seedable_range_is_an_error_naming_the_flag_before_any_model_loads(monkeypatch, capsys):
    """chat.py --seed 99999999999999999999 loaded the model, then ended in torch's "Overflow when unpacking long long"
    traceback (exit 1); ppo_eval's --seed (step 3's, which draws the held-out share with numpy) took -1 too."""
    from dschat.tools import chat

    monkeypatch.setattr(chat, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    for main, flags in ((chat.main, ["--path", "tiny-llama", "--prompt", "hi"]), (ppo_eval.main, ["--policy", "x"])):
        for value in ("99999999999999999999", "-1"):
            with pytest.raises(SystemExit) as stop:
                main([*flags, "--seed", value])
            assert stop.value.code == 2
            assert "argument --seed: expected a seed in [0, 4294967295]" in capsys.readouterr().err


def test_sampling_flags_are_checked_before_any_model_loads(monkeypatch):
    """chat.py --temperature 0 (and prompt_eval's --do_sample --top_p 1.5) loaded the model (minutes for a large one)
    before the flag was refused, though check_sampling_flags is there to refuse it first."""
    from dschat.errors import UsageError
    from dschat.tools import chat

    for tool in (chat, prompt_eval):
        monkeypatch.setattr(tool, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    with pytest.raises(UsageError, match="--temperature 0.0: sampling needs a temperature > 0"):
        chat.main(["--path", "tiny-llama", "--prompt", "hi", "--temperature", "0"])
    with pytest.raises(UsageError, match=r"--top_p 1.5: must be in \(0, 1\]"):
        prompt_eval.main(["--model_name_or_path_baseline", "tiny-llama", "--model_name_or_path_finetune", "tiny-llama",
                          "--prompts", "hi", "--do_sample", "--top_p", "1.5"])


def test_a_temperature_the_fp32_sampling_cannot_scale_by_is_an_error_before_any_model_loads(monkeypatch):
    """chat.py --temperature 1e-45 loaded the model, then crashed mid-generation ("probability tensor contains
    either inf, nan"); 1e300 (inf in fp32) sampled noise. Step 3 shares the check (check_sampling_flags)."""
    from dschat.args import check_sampling_flags
    from dschat.errors import UsageError
    from dschat.tools import chat

    monkeypatch.setattr(chat, "load_policy", lambda *a, **k: pytest.fail("a model loaded first"))
    for value, message in (("1e-45", r"1e-45: below 1e-30 .*--greedy"), ("1e300", r"1e\+300: above 1e\+30 .*noise")):
        with pytest.raises(UsageError, match=f"--temperature {message}"):
            chat.main(["--path", "tiny-llama", "--prompt", "hi", "--temperature", value])
    for value in (1e-30, 1e-3, 1e30):  # (within the bounds: a near-greedy sample and a near-uniform one)
        check_sampling_flags(value, 1.0)


def test_greedy_decoding_says_only_the_sampling_flags_that_would_change_a_sample(capsys):
    """--top_k -1 is no top-k filtering, as the default 0 is: a greedy run was warned that it did nothing."""
    import argparse

    from dschat.tools.common import add_generation_args, generation_kwargs

    parser = argparse.ArgumentParser()
    add_generation_args(parser, sample_by_default=False)
    for flags in ([], ["--top_k", "-1"], ["--top_k", "0", "--top_p", "1", "--temperature", "1"]):
        generation_kwargs(parser.parse_args(flags))
    assert capsys.readouterr().err == ""
    generation_kwargs(parser.parse_args(["--top_k", "4", "--top_p", "0.9"]))
    assert "--top_k 4, --top_p 0.9: no effect on greedy decoding" in capsys.readouterr().err


def test_a_seed_given_to_a_greedy_decoding_is_said_to_do_nothing(capsys):
    """prompt_eval --seed 0 (greedy by default) and chat.py --greedy --seed 0 took the seed in silence, as if the
    answers depended on it; with sampling it is used, and nothing is said."""
    import argparse

    from dschat.tools.common import add_generation_args, generation_kwargs

    for sample_by_default, flags, said in ((False, ["--seed", "0"], True), (True, ["--greedy", "--seed", "3"], True),
                                           (True, ["--seed", "3"], False), (False, ["--do_sample", "--seed", "0"],
                                                                            False)):
        parser = argparse.ArgumentParser()
        add_generation_args(parser, sample_by_default=sample_by_default)
        generation_kwargs(parser.parse_args(flags))
        err = capsys.readouterr().err
        assert ("--seed" in err and "no effect on greedy decoding" in err) == said, (flags, err)


def test_a_prompt_and_answer_past_a_learned_position_table_are_an_error_not_an_index_error(tmp_path):
    from dschat.errors import UsageError
    from dschat.tools.generation import generate_answers

    model, tokenizer = load_policy(gpt2_models(tmp_path)[0], device="cpu")
    for prompt, new_tokens in (("word " * 600, 2), ("Say hi.", 600)):  # prompt_eval's path: no chat history to drop
        with pytest.raises(UsageError, match="learned positions"):
            generate_answers(model, tokenizer, [format_prompt([{"role": "user", "content": prompt}], tokenizer)],
                             {"max_new_tokens": new_tokens, "do_sample": False})
    assert len(generate_answers(model, tokenizer, ["Say hi."], {"max_new_tokens": 2, "do_sample": False})) == 1


def test_the_tools_answer_an_rwkv_models_batch_as_each_prompt_alone(tokenizer):
    """prompt_eval and chat (``generate_answers_and_cuts``) called HF's ``generate`` on the left-padded batch, not
    step 3's ``hf_generate``: an RWKV model's recurrence reads no mask, and transformers' one-token decode step mixes a
    batch's rows (``compat.rwkv_decode_keeps_rows_apart``), so a batch's answers were not each prompt's. Greedy, each
    answer is now the prompt's alone (two prompts of one length, one longer)."""
    from transformers import AutoModelForCausalLM, RwkvConfig

    from dschat.tools.generation import generate_answers

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(RwkvConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
        context_length=64, bos_token_id=None, eos_token_id=None)).eval()
    prompts = ["the cat sat", "the dog sat", "hello there, my friend, and more"]
    assert len({len(tokenizer(p)["input_ids"]) for p in prompts}) == 2  # (two of one length, one longer)
    alone = [generate_answers(model, tokenizer, [prompt], dict(GREEDY))[0] for prompt in prompts]
    assert generate_answers(model, tokenizer, prompts, dict(GREEDY)) == alone


def test_answers_end_at_any_eos_id_the_model_lists_and_a_saved_model_keeps_them(models, tmp_path):
    """Qwen2.5-Instruct and Llama-3-Instruct list a second EOS id in their generation_config: HF's generate stops on
    it, so the tools do, and loading for training (sync_special_tokens) keeps it after the tokenizer's EOS."""
    from dschat.models.loading import load_causal_lm, load_tokenizer
    from dschat.tools.generation import generate_answers

    model, tokenizer = load_policy(models["policy"], device="cpu")
    prompt = [format_prompt([{"role": "user", "content": "Say hi."}], tokenizer)]
    ids, mask = encode_prompt_batch(tokenizer, prompt)
    plain = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6,
                           pad_token_id=tokenizer.pad_token_id)
    stop = int(plain[0, -4])  # the third new token: the answer ends before it
    assert stop != tokenizer.eos_token_id
    full = generate_answers(model, tokenizer, prompt, dict(GREEDY))[0]
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    short = generate_answers(model, tokenizer, prompt, dict(GREEDY))[0]
    assert short == tokenizer.decode(plain[0, -6:-4], skip_special_tokens=True).strip() and full.startswith(short)
    assert len(short) < len(full)
    model.save_pretrained(tmp_path / "instruct")
    tokenizer.save_pretrained(tmp_path / "instruct")
    loaded = load_causal_lm(str(tmp_path / "instruct"), load_tokenizer(str(tmp_path / "instruct")))
    assert loaded.generation_config.eos_token_id == [tokenizer.eos_token_id, stop]


def encode_prompt_batch(tokenizer, prompts):
    from dschat.tools.generation import encode_prompts, left_padded

    return left_padded(encode_prompts(tokenizer, prompts), tokenizer.pad_token_id, "cpu")


def test_interactive_loop_clears_and_quits(session):
    session.clear()
    lines, printed = iter(["Name 3 colors.", "clear", "Say tea twice.", "quit", "never read"]), []
    run_interactive(session, read=lambda _: next(lines), write=printed.append)
    assert next(lines) == "never read"
    assert "(new conversation)" in printed
    assert [m["content"] for m in session.history if m["role"] == "user"] == ["Say tea twice."]


def test_chat_says_an_answer_cut_at_max_new_tokens(session, models, monkeypatch, capsys):
    """An answer that reached --max_new_tokens before the model ended it was shown (and kept) as if whole: the tiny
    run's PPO actor, asked "List four animals." with --max_new_tokens 3, answered "dog, dog", unsaid."""
    import torch

    from dschat.tools import chat
    from dschat.tools.generation import unended

    assert unended(torch.tensor([[5, 0, 1], [5, 6, 7], [2, 3, 9]]), [0, 9]) == [False, True, False]
    session.clear()  # (the random tiny policy writes no EOS in GREEDY's 6 tokens)
    lines, printed = iter(["Name 3 colors.", "quit"]), []
    run_interactive(session, read=lambda _: next(lines), write=printed.append)
    assert printed[-1] == "(the answer reached --max_new_tokens 6 before the model ended it: cut there)"
    assert session.cut and printed[-2].startswith("Assistant: ")
    chat.main(["--path", models["policy"], "--greedy", "--max_new_tokens", "6", "--prompt", "Name 3 colors."])
    out, err = capsys.readouterr()
    assert "cut there" not in out and "(the answer reached --max_new_tokens 6 before the model ended it" in err
    # an answer the model ended (at its EOS, or by writing the user's next turn) is not said to be cut
    monkeypatch.setattr(chat, "generate_answers_and_cuts", lambda *a: (["Red.\n\nHuman: And green?"], [True]))
    lines, printed = iter(["Name a color.", "quit"]), []
    run_interactive(session, read=lambda _: next(lines), write=printed.append)
    assert printed[-1] == "Assistant: Red." and not session.cut


def test_chat_and_prompt_eval_say_an_empty_answer(session, monkeypatch, capsys):
    """An answer with no text (a policy that writes its EOS first) was printed as "Assistant: " and nothing, or in
    prompt_eval as a blank line under the model's header, as if the output were lost; it is now said."""
    from dschat.tools import chat
    from dschat.tools.records import prompt_record

    monkeypatch.setattr(chat, "generate_answers_and_cuts", lambda *a: ([""], [False]))
    lines, printed = iter(["Name a color.", "quit"]), []
    run_interactive(session, read=lambda _: next(lines), write=printed.append)
    assert printed[-2:] == ["Assistant: ", "(an empty answer: the model ended it before any text)"]
    monkeypatch.setattr(chat, "generate_answers_and_cuts", lambda *a: (["Red."], [False]))
    lines, printed = iter(["Name a color.", "quit"]), []
    run_interactive(session, read=lambda _: next(lines), write=printed.append)
    assert printed[-1] == "Assistant: Red."  # (an answer with text: nothing more said)
    # whitespace alone up to --max_new_tokens (decoded stripped: no text): the model did not end it, so not said to
    # (the cut note says why)
    monkeypatch.setattr(chat, "generate_answers_and_cuts", lambda *a: ([""], [True]))
    lines, printed = iter(["Name a color.", "quit"]), []
    run_interactive(session, read=lambda _: next(lines), write=printed.append)
    assert "ended it before any text" not in " ".join(printed) and "cut there" in printed[-1]
    prompt_eval.print_comparison([prompt_record("Name a color.", "--prompts")] * 2, {"baseline": "b", "finetune": "f"},
                                 {"baseline": ["Red.", ""], "finetune": [" ", "Red."]}, None,
                                 {"baseline": [False, True], "finetune": [False, False]}, 6)
    out = capsys.readouterr().out
    assert "--- baseline (b):\nRed.\n" in out
    assert "--- finetune (f):   [an empty answer: the model ended it before any text]\n" in out
    assert "--- baseline (b):   [cut at --max_new_tokens 6]\n\n" in out


def test_chat_one_shot_prints_the_answer_and_exits(models, session, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(models["policy"], run / "step1_sft")
    session.clear()
    expected = session.ask("Name 3 colors.")
    assert expected
    out, err = run_chat("--path", run, "--prompt", "Name 3 colors.", "--greedy", "--max_new_tokens", 6, stderr=True)
    assert expected in out and "Human:" not in out and "<|endoftext|>" not in out
    assert f"[chat] model: {run / 'step1_sft'} on cpu" in err and "[chat]" not in out  # which model the run chose


def test_chat_interactive_answers_two_turns_then_quits(models, session):
    session.clear()
    first, second = session.ask("Name 3 colors."), session.ask("Say tea twice.")
    out = run_chat("--path", models["policy"], "--greedy", "--max_new_tokens", 6,
                   stdin="Name 3 colors.\nSay tea twice.\nquit\nNot answered.\n")
    assert f"Assistant: {first}\n" in out and f"Assistant: {second}\n" in out
    assert out.count("Assistant:") == 2


# --- step 1: prompt_eval ---

def test_prompt_eval_prints_both_models_answers(models, capsys, tmp_path):
    result = prompt_eval.main(["--model_name_or_path_baseline", models["baseline"], "--model_name_or_path_finetune",
                               models["policy"], "--prompts", "Name 3 colors.", "Say tea twice.",
                               "--max_new_tokens", "6"])
    out = capsys.readouterr().out
    assert len(result["answers"]["baseline"]) == len(result["answers"]["finetune"]) == 2
    assert result["answers"]["baseline"] != result["answers"]["finetune"]  # different weights
    run = tmp_path / "run"  # a train.py output folder: its policy, as chat.py finds it
    run.mkdir()
    os.symlink(models["policy"], run / "step1_sft")
    again = prompt_eval.main(["--model_name_or_path_baseline", models["baseline"], "--model_name_or_path_finetune",
                              str(run), "--prompts", "Name 3 colors.", "Say tea twice.", "--max_new_tokens", "6",
                              "--top_k", "4"])
    assert again["answers"]["finetune"] == result["answers"]["finetune"]
    # a sampling flag on its greedy comparison is said to do nothing, once for both models
    assert capsys.readouterr().err.count("--top_k 4: no effect on greedy decoding (add --do_sample") == 1
    for role, path in (("baseline", models["baseline"]), ("finetune", models["policy"])):
        assert f"--- {role} ({path}):" in out
        assert all(answer in out for answer in result["answers"][role])
    assert "Human: Name 3 colors." in out and "Human: Say tea twice." in out
    assert "rule_scores" not in result  # not the tiny data
    # the random models write no EOS in 6 tokens: each answer is said to be cut there (it read as a whole answer)
    assert result["cut"] == {"baseline": [True, True], "finetune": [True, True]}
    assert out.count("   [cut at --max_new_tokens 6]\n") == 4


@pytest.mark.parametrize("source", [[], ["--prompts_file", "tiny"], ["--prompts_file", "EVAL_FILE"],
                                    ["--prompts_file", "jsonl:DATA_DIR"]])
def test_prompt_eval_rule_scores_the_tiny_held_out_prompts(models, capsys, monkeypatch, reachable_hub, source):
    """Scored whether the tiny prompts are the default or named: --prompts_file tiny (or the embedded eval file's
    path, or its folder, read for its eval part) gave the same prompts with no rule score, while the tiny pipeline's
    report has one."""
    from dschat.tiny import DATA_DIR, EVAL_FILE

    source = [word.replace("EVAL_FILE", str(EVAL_FILE)).replace("DATA_DIR", str(DATA_DIR)) for word in source]
    # Stand-in models that answer with the data's chosen (finetune) or rejected (baseline) answers, so the
    # rule scores are known to differ.
    def canned_answers(path, records, args):  # (given the records themselves as the prompts, below)
        return [r.chosen if path == "finetune-model" else r.rejected for r in records], [False] * len(records)

    monkeypatch.setattr(prompt_eval, "model_prompts", lambda path, records, *_: records)
    monkeypatch.setattr(prompt_eval, "model_answers", canned_answers)
    monkeypatch.setattr(prompt_eval, "config_before_loading", lambda path: None)  # (no hub retries for the names)
    result = prompt_eval.main(["--model_name_or_path_baseline", "baseline-model", "--model_name_or_path_finetune",
                               "finetune-model", *source, "--num_prompts", "6",  # and DeepSpeed-Chat's flags
                               "--num_beams", "1", "--num_beam_groups", "1", "--top_k", "4", "--penalty_alpha", "0.6",
                               "--num_return_sequences", "1", "--max_new_tokens", "100", "--language", "English"])
    out = capsys.readouterr().out
    records = prompt_eval.tiny_held_out_records(6)
    expected = [rule_score(r.messages[-1]["content"], r.chosen) for r in records]
    assert result["rule_scores"]["finetune"] == expected
    assert result["rule_score_means"]["finetune"] > result["rule_score_means"]["baseline"]
    assert (f"mean rule score over 6 prompts: baseline {result['rule_score_means']['baseline']:.3f}, "
            f"finetune {result['rule_score_means']['finetune']:.3f}") in out
    assert out.count("[rule score") == 12


def test_prompt_eval_says_deepspeed_chats_decoding_flags_that_ask_for_what_it_does_not_do(capsys, monkeypatch):
    """--num_beams 4 (and the other DeepSpeed-Chat decoding flags) were accepted and ignored without a word: the
    answers were greedy, one per prompt."""
    monkeypatch.setattr(prompt_eval, "model_prompts", lambda path, records, *_: records)
    monkeypatch.setattr(prompt_eval, "model_answers", lambda path, records, args: (["ok"] * len(records),
                                                                                    [False] * len(records)))
    monkeypatch.setattr(prompt_eval, "config_before_loading", lambda path: None)
    models = ["--model_name_or_path_baseline", "a", "--model_name_or_path_finetune", "b", "--num_prompts", "1"]
    monkeypatch.setattr(prompt_eval, "flag_path", lambda flag, find, value: value)
    prompt_eval.main([*models, "--num_beams", "4", "--num_return_sequences", "2", "--penalty_alpha", "0.6",
                      "--language", "Chinese", "--num_beam_groups", "1"])
    said = capsys.readouterr().err
    assert ("warning: --num_beams 4, --num_return_sequences 2, --penalty_alpha 0.6, --language Chinese: "
            "no effect") in said
    prompt_eval.main([*models, "--num_beams", "1", "--language", "English"])  # (what the comparison does anyway)
    assert "no effect" not in capsys.readouterr().err


# --- step 2: rw_eval ---

def end_score_by_hand(model, tokenizer, prompt, answer):
    text = format_prompt([{"role": "user", "content": prompt}], tokenizer) + format_answer(answer, tokenizer)
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model.end_scores(ids, torch.ones_like(ids)).item()


def test_rw_eval_scores_equal_end_scores_of_the_training_text(models, tmp_path, capsys):
    from dschat.errors import UsageError

    pairs = [{"prompt": "Name 3 colors.", "chosen": "red, blue, green", "rejected": "red"},
             {"prompt": "What is 2 plus 4?", "chosen": "6", "rejected": "The answer is five, I think."}]
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    result = rw_eval.main(["--model_name_or_path", models["rm"], "--pairs_file", str(pairs_file)])
    out = capsys.readouterr().out

    tokenizer = load_tokenizer(models["rm"])
    model = load_reward_model(models["rm"], tokenizer=tokenizer).eval()
    chosen = [end_score_by_hand(model, tokenizer, p["prompt"], p["chosen"]) for p in pairs]
    rejected = [end_score_by_hand(model, tokenizer, p["prompt"], p["rejected"]) for p in pairs]
    assert [p["chosen_score"] for p in result["pairs"]] == pytest.approx(chosen, abs=1e-4)
    assert [p["rejected_score"] for p in result["pairs"]] == pytest.approx(rejected, abs=1e-4)
    assert result["accuracy"] == sum(c > r for c, r in zip(chosen, rejected)) / 2
    assert f"accuracy {result['accuracy']:.3f} over 2 pairs" in out
    assert f"chosen   {chosen[0]:+.4f}: red, blue, green" in out

    single = rw_eval.main(["--model_name_or_path", models["rm"], "--prompt", "Name 3 colors.",
                           "--answer", "red, blue, green", "--answer", "red"])
    assert single["scores"] == pytest.approx([chosen[0], rejected[0]], abs=1e-4)

    # a pair step 2 skips (the same text twice, also when truncation makes it so) is skipped here too, and counted
    tie = {"prompt": "Say hi.", "chosen": "hi", "rejected": "hi"}
    cut = {"prompt": "Say hi.", "chosen": "hi " * 200 + "one", "rejected": "hi " * 200 + "two"}
    long_prompt = {"prompt": "Say hi. " * 100, "chosen": "hi", "rejected": "bye"}
    pairs_file.write_text("".join(json.dumps(p) + "\n" for p in pairs + [tie, cut, long_prompt]))
    again = rw_eval.main(["--model_name_or_path", models["rm"], "--pairs_file", str(pairs_file),
                          "--max_seq_len", "64"])
    assert again["skipped"] == {"chosen==rejected": 2, "prompt too long": 1} and len(again["pairs"]) == 2
    assert again["accuracy"] == result["accuracy"]
    assert "skipped as in step 2: 2 chosen==rejected, 1 prompt too long" in capsys.readouterr().out
    # not given: the --max_seq_len step 2 trained with (its training_args.json), not 512
    trained = tmp_path / "step2_rm"
    shutil.copytree(models["rm"], trained)
    (trained / RUN_ARGS_FILE).write_text(json.dumps({"step": "step2", "flags": {"max_seq_len": 64}}))
    recorded = rw_eval.main(["--model_name_or_path", str(trained), "--pairs_file", str(pairs_file)])
    assert recorded["skipped"] == again["skipped"] and recorded["pairs"] == again["pairs"]
    assert f"[rw_eval] from {trained / RUN_ARGS_FILE} (flags given here win): --max_seq_len 64" \
        in capsys.readouterr().out
    # and its one local --data_path (DeepSpeed-Chat's local/jsonfile, read where step 2 ran): the eval part, not the
    # embedded pairs
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "train.json").write_text(json.dumps([tie] * 3))
    (project / "data" / "eval.json").write_text(json.dumps(pairs))
    (trained / RUN_ARGS_FILE).write_text(json.dumps({"step": "step2", "cwd": str(project),
                                                     "flags": {"max_seq_len": 64, "data_path": "local/jsonfile"}}))
    held_out = rw_eval.main(["--model_name_or_path", str(trained)])
    out = capsys.readouterr().out
    assert f"--pairs_file json:{project / 'data' / 'train.json'},{project / 'data' / 'eval.json'}" \
        in out and "2 records of json:" in out and "(its eval part)" in out
    assert held_out["pairs"] == result["pairs"]
    # its field names go with its file; and "tiny" names the embedded pairs
    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text("".join(json.dumps({"q": p["prompt"], "good": p["chosen"], "bad": p["rejected"]}) + "\n"
                               for p in pairs))
    (trained / RUN_ARGS_FILE).write_text(json.dumps({"step": "step2", "flags": {
        "data_path": [f"jsonl:{renamed}"], "data_fields": "prompt=q,chosen=good,rejected=bad"}}))
    assert rw_eval.main(["--model_name_or_path", str(trained)])["pairs"] == result["pairs"]
    assert "--data_fields prompt=q,chosen=good,rejected=bad" in capsys.readouterr().out
    embedded = rw_eval.main(["--model_name_or_path", str(trained), "--pairs_file", "tiny", "--num_pairs", "3"])
    assert len(embedded["pairs"]) == 3
    renamed.unlink()  # step 2's file gone: said as the run's (it read as a --pairs_file given here)
    with pytest.raises(UsageError, match=rf"--data_path jsonl:{renamed}: {renamed}: no such file or folder \(the "
                                         r"data of step 2, from .*training_args.json\)"
                                         ": give --pairs_file, or --prompt and --answer"):
        rw_eval.main(["--model_name_or_path", str(trained)])


def test_rw_eval_counts_records_without_a_rejected_answer_and_checks_its_flags(models, tmp_path, capsys):
    pairs = [{"prompt": "Name 3 colors.", "chosen": "red, blue, green", "rejected": "red"},
             {"prompt": "Say hi.", "chosen": "hi"}]  # SFT-only: step 2 skips it and counts it
    pairs_file = tmp_path / "pairs.jsonl"
    pairs_file.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    result = rw_eval.main(["--model_name_or_path", models["rm"], "--pairs_file", str(pairs_file),
                           "--num_padding_at_beginning", "1"])  # DeepSpeed-Chat's rw_eval.py flag
    assert len(result["pairs"]) == 1 and result["skipped"] == {"no rejected answer": 1}
    assert "skipped as in step 2: 1 no rejected answer" in capsys.readouterr().out
    for flags in (["--num_pairs", "-1"], ["--batch_size", "0"], ["--max_seq_len", "0"]):
        with pytest.raises(SystemExit):
            rw_eval.build_parser().parse_args(["--model_name_or_path", models["rm"], *flags])
    from dschat.errors import UsageError

    with pytest.raises(UsageError, match="--max_seq_len = 2000 tokens.*512 learned positions"):
        rw_eval.main(["--model_name_or_path", gpt2_models(tmp_path)[1], "--prompt", "Say hi.", "--answer", "hi",
                      "--max_seq_len", "2000"])


def test_a_tools_run_defaults_fill_only_the_flags_not_given_and_are_said(capsys):
    """rw_eval and ppo_eval take the settings of the run that wrote the model: flags given win, and the line lists
    only what was taken (not a run's value that a given flag overrides, nor one equal to the tool's own default)."""
    import argparse

    def tool_parser():
        parser = argparse.ArgumentParser()
        parser.add_argument("--a", type=int, default=1)
        parser.add_argument("--b", default="x")
        parser.add_argument("--c", action="store_true")
        parser.add_argument("--d", default="same")
        return parser

    run = {"a": 7, "b": "y", "c": True, "d": "same"}
    args = parse_with_run_defaults(tool_parser(), ["--a", "5"], lambda given: (run, "run/training_args.json"), "tool")
    assert (args.a, args.b, args.c, args.d) == (5, "y", True, "same")
    assert capsys.readouterr().out == "[tool] from run/training_args.json (flags given here win): --b y --c\n"
    # a flag given with the tool's default value wins too, and is not said to be taken
    args = parse_with_run_defaults(tool_parser(), ["--a", "1", "--b", "x"],
                                   lambda given: (run, "run/training_args.json"), "tool")
    assert (args.a, args.b, args.c) == (1, "x", True)
    assert capsys.readouterr().out == "[tool] from run/training_args.json (flags given here win): --c\n"
    plain = parse_with_run_defaults(argparse.ArgumentParser(), [], lambda given: ({}, None), "tool")
    assert vars(plain) == {} and capsys.readouterr().out == ""


# --- step 3: ppo_eval ---

def test_a_notebooks_reward_function_is_recorded_as_a_spec_eval_py_loads(tmp_path, capsys):
    """training_args.json recorded a function given from Python as its repr ("<function score at 0x...>"), which
    eval.py then refused as a --reward_fn; now as a spec that loads it again from any folder, or a marker eval.py
    explains."""
    from types import SimpleNamespace

    from dschat.rlhf.reward_fn import load_reward_fn, reward_fn_spec
    from dschat.steps.common import read_run_args, write_results

    rewards = tmp_path / "my_rewards.py"
    rewards.write_text("def score(prompts, answers):\n    return [1.0 for _ in answers]\n")
    from_file = load_reward_fn(f"{rewards}:score")
    assert reward_fn_spec(from_file) == f"{rewards}:score"
    assert load_reward_fn(reward_fn_spec(from_file))(["p"], ["a"]) == [1.0]
    from dschat.tiny.scorer import score_batch

    assert reward_fn_spec(score_batch) == "dschat.tiny.scorer:score_batch"
    (tmp_path / "rewardpkg").mkdir()  # a package's own function: by module name (as a file, its imports would fail)
    (tmp_path / "rewardpkg" / "__init__.py").write_text("def score(prompts, answers):\n    return [2.0] * len(answers)"
                                                        "\n")
    import importlib
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        package = importlib.import_module("rewardpkg")
        assert reward_fn_spec(package.score) == "rewardpkg:score"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("rewardpkg", None)

    def nested(prompts, answers):
        return [0.0] * len(answers)

    assert reward_fn_spec(nested) is None and reward_fn_spec(lambda p, a: a) is None
    for fn, recorded in ((from_file, f"{rewards}:score"), (nested, "<a Python object: "
                                                                   "test_a_notebooks_reward_function_is_recorded_as_a_"
                                                                   "spec_eval_py_loads.<locals>.nested>")):
        out = tmp_path / fn.__name__
        write_results(SimpleNamespace(output_dir=str(out), reward_fn=fn), {}, "step3")
        assert read_run_args(str(out), "step3")["flags"]["reward_fn"] == recorded
    capsys.readouterr()
    assert ppo_eval.run_reward_sources({"reward_fn": recorded, "reward_model_weight": 0}, str(tmp_path)) == {}
    assert "the run's reward function was a Python object: test_a_notebooks" in capsys.readouterr().out
    ppo_eval.run_reward_sources({"reward_fn": recorded, "reward_model_weight": 0}, str(tmp_path), "x.py:f")
    assert capsys.readouterr().out == ""  # given here: nothing to say


def test_ppo_eval_takes_a_runs_relative_reward_model_and_function_as_normalised_paths(tmp_path):
    """A run's "--reward_model_name_or_path ./my_reward_model" was echoed and read as '/tmp/x/./my_reward_model'."""
    (tmp_path / "my_reward_model").mkdir()
    (tmp_path / "rewards.py").write_text("def score(prompts, answers):\n    return [0.0] * len(answers)\n")
    flags = {"reward_model_name_or_path": "./my_reward_model", "reward_fn": "./sub/../rewards.py:score"}
    (tmp_path / "sub").mkdir()
    assert ppo_eval.run_reward_sources(flags, str(tmp_path)) == {
        "reward_model": str(tmp_path / "my_reward_model"), "reward_fn": f"{tmp_path / 'rewards.py'}:score"}


def test_ppo_eval_answers_stop_at_every_eos_id_the_policys_generation_config_lists(models, tmp_path, monkeypatch):
    """Llama-3-Instruct's <|end_of_text|> beside <|eot_id|>: ppo_eval's answers stop at each EOS id the policy's
    generation_config lists, as step 3 and the other tools stop; they stopped at the tokenizer's EOS alone (passed
    explicitly, overriding the config) and scored what followed."""
    seen = []

    def policy_listing_a_second_eos(*args, **kwargs):
        model, tokenizer = load_policy(*args, **kwargs)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, 5]
        generate = model.generate

        def spy(*a, **kw):
            seen.append(kw["eos_token_id"])
            return generate(*a, **kw)

        model.generate = spy
        return model, tokenizer

    monkeypatch.setattr(ppo_eval, "load_policy", policy_listing_a_second_eos)
    args = ppo_eval.parse_args(["--policy", models["policy"], "--num_prompts", "2", "--max_new_tokens", "3",
                                "--data_output_path", str(tmp_path / "cache"), "--num_examples", "0"])
    tokenizer = load_tokenizer(models["policy"])
    ppo_eval.evaluate_model(models["policy"], None, args)
    assert seen and all(ids == [tokenizer.eos_token_id, 5] for ids in seen), seen


def test_ppo_eval_says_when_the_policy_has_no_step3_record(models, tmp_path, capsys):
    """A policy saved from a notebook has no training_args.json: the prompts scored are this tool's defaults', said
    (they may not be the run's held-out prompts)."""
    policy = tmp_path / "saved"
    shutil.copytree(models["policy"], policy)
    args = ppo_eval.parse_args(["--policy", str(policy), "--data_split", "4,4,2"])
    assert args.data_split == "4,4,2"
    assert (f"[ppo_eval] no step-3 training_args.json with {policy}: the held-out prompts are those of this tool's "
            "flags (--data_path tiny --data_split 4,4,2 --seed 1234)") in capsys.readouterr().out


def test_ppo_eval_scores_a_dpo_policy_on_phase_3_of_its_runs_own_data_split(models, tmp_path, capsys):
    """A DPO policy (train.py --recipe dpo's step2_dpo, no step 3) was scored on phase 3 of this tool's own
    --data_split 2,4,4, which for a run of 4,4,2 takes records DPO trained on; now on phase 3 of the DPO run's split,
    with its data files and seed, said."""
    policy = tmp_path / "run" / "step2_dpo"
    shutil.copytree(models["policy"], policy)
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n")
    (policy / RUN_ARGS_FILE).write_text(json.dumps({"step": "step2_dpo", "world_size": 1, "cwd": str(tmp_path),
                                        "flags": {"data_path": ["pairs.jsonl"], "data_split": "4,4,2", "seed": 7,
                                                  "max_seq_len": 64}}))
    args = ppo_eval.parse_args(["--policy", str(policy)])
    assert (args.data_split, args.seed, args.data_path) == ("4,4,2", 7, [str(tmp_path / "pairs.jsonl")])
    out = capsys.readouterr().out
    assert f"[ppo_eval] from {policy / RUN_ARGS_FILE} (flags given here win): --data_path" in out
    assert "no step-3" not in out
    given = ppo_eval.parse_args(["--policy", str(policy), "--data_split", "2,4,4", "--data_path", "tiny"])
    assert (given.data_split, given.data_path, given.seed) == ("2,4,4", ["tiny"], 7)


def test_ppo_eval_warns_of_lengths_past_each_models_positions_once_naming_it(models, capsys, monkeypatch):
    """Answers past the positions the models were configured for: the same unnamed warning was said for the policy, the
    reward model, the baseline, and the reward model again (checked with each policy), four lines for three models."""
    monkeypatch.setattr(ppo_eval, "evaluate_policy", lambda *a, **k: {"prompts": 0, "examples": []})
    ppo_eval.main(["--policy", models["policy"], "--baseline", models["baseline"], "--reward_model", models["rm"],
                   "--max_prompt_seq_len", "16", "--max_new_tokens", "500", "--num_prompts", "1"])
    warnings = [line for line in capsys.readouterr().out.splitlines() if "past the 512 positions" in line]
    assert sorted(warnings) == sorted(f"warning: --max_prompt_seq_len + --max_new_tokens for {path} = 516 tokens is "
                                      "past the 512 positions the model was configured for"
                                      for path in (models["policy"], models["rm"], models["baseline"]))


def test_ppo_eval_scores_a_dpo_runs_policies_as_its_report_scored_them(models, tmp_path, capsys):
    """train.py --recipe dpo reports the held-out rule score of its SFT and DPO policies over every held-out prompt
    with step 3's tiny-recipe lengths (SFT 0.807 -> DPO 0.818 on 120 prompts); ppo_eval --policy <run> scored them on
    64 prompts with 256-token answers (0.819 -> 0.822), unsaid. Now with the report's settings, said; flags given win,
    and a DPO run whose report has no such score keeps this tool's defaults."""
    from dschat.pipeline import held_out_rule_score_settings

    run = tmp_path / "run"
    policy = run / "step2_dpo"
    shutil.copytree(models["policy"], policy)
    (policy / RUN_ARGS_FILE).write_text(json.dumps({"step": "step2_dpo", "world_size": 1, "cwd": str(tmp_path),
                                                    "flags": {"data_path": ["tiny"], "data_split": "4,4,2"}}))
    defaults = ppo_eval.parse_args(["--policy", str(run)])
    assert (defaults.num_prompts, defaults.max_new_tokens) == (64, 256)
    score = {"rule_score": 0.8, "prompts": 120}
    (run / "report.json").write_text(json.dumps({"policy": "step2_dpo",
                                                 "dpo": {"held_out_rule_score": {"sft": score, "dpo": score}}}))
    capsys.readouterr()
    args = ppo_eval.parse_args(["--policy", str(run)])
    step3 = held_out_rule_score_settings()
    assert (args.num_prompts, args.max_new_tokens, args.max_prompt_seq_len, args.per_device_generation_batch_size) \
        == (0, step3.max_answer_seq_len, step3.max_prompt_seq_len, step3.per_device_generation_batch_size)
    assert args.data_split == "4,4,2"
    assert f"and {run / 'report.json'}'s held-out rule score (flags given here win)" in capsys.readouterr().out
    given = ppo_eval.parse_args(["--policy", str(run), "--num_prompts", "8", "--max_new_tokens", "16"])
    assert (given.num_prompts, given.max_new_tokens) == (8, 16)


def test_ppo_eval_scores_a_dpo_policy_as_its_report_did_after_a_later_run_replaced_the_report(models, tmp_path,
                                                                                             capsys):
    """train.py --recipe dpo --step 2, then a PPO run's --resume in the same folder: its report.json replaced the DPO
    run's, and ppo_eval scored the DPO policy with its own defaults (64 prompts: 0.8405/0.8194, not the report's 120),
    unsaid. The flags are kept with the DPO model (its metrics.json), read from there; without them, what it falls
    back to is said."""
    from dschat.pipeline import held_out_rule_score_eval_flags, keep_rule_scores_with_the_dpo_model

    run = tmp_path / "run"
    policy = run / "step2_dpo"
    shutil.copytree(models["policy"], policy)
    (policy / RUN_ARGS_FILE).write_text(json.dumps({"step": "step2_dpo", "world_size": 1, "cwd": str(tmp_path),
                                                    "flags": {"data_path": ["tiny"], "data_split": "4,4,2"}}))
    (policy / "metrics.json").write_text(json.dumps({"logp_accuracy": 0.9}))
    (run / "report.json").write_text(json.dumps({"policy": "step3_ppo/actor", "held_out": {}}))  # (the later run's)
    capsys.readouterr()
    unkept = ppo_eval.parse_args(["--policy", str(policy)])
    assert (unkept.num_prompts, unkept.max_new_tokens) == (64, 256)
    assert (f"[ppo_eval] {policy}: no held-out rule score of train.py --recipe dpo kept with it "
            f"({policy / 'metrics.json'}): scored with --num_prompts 64 --max_new_tokens 256 --max_prompt_seq_len 256 "
            "--per_device_generation_batch_size 16 (this tool's defaults where not given)") in capsys.readouterr().out
    score = {"rule_score": 0.8, "prompts": 120, "empty_answers": 0}
    keep_rule_scores_with_the_dpo_model(str(run), {"sft": score, "dpo": score})
    args = ppo_eval.parse_args(["--policy", str(policy)])
    flags = held_out_rule_score_eval_flags()
    assert (args.num_prompts, args.max_new_tokens, args.max_prompt_seq_len, args.per_device_generation_batch_size) \
        == (0, flags["max_new_tokens"], flags["max_prompt_seq_len"], flags["per_device_generation_batch_size"])
    assert args.data_split == "4,4,2"
    assert (f"and {policy / 'metrics.json'}'s held-out rule score (flags given here win)" in
            capsys.readouterr().out)
    assert json.loads((policy / "metrics.json").read_text())["logp_accuracy"] == 0.9  # (the step's metrics kept)


def test_ppo_eval_scores_a_dpo_runs_sft_model_as_its_report_scored_it(tmp_path, capsys):
    """train.py --recipe dpo's report scores the SFT model beside the DPO policy (SFT 0.8066 -> DPO 0.8183 over 120
    prompts); ppo_eval --policy <run>/step1_sft took only a step-3 sibling's flags, and scored it with its own
    defaults instead (0.7273 over 64 prompts of its 2,4,4 split). Now with the DPO sibling's, as the DPO policy."""
    from dschat.pipeline import held_out_rule_score_eval_flags, keep_rule_scores_with_the_dpo_model

    run = tmp_path / "run"
    for folder in ("step1_sft", "step2_dpo"):
        (run / folder).mkdir(parents=True)
        (run / folder / "config.json").write_text("{}")
    (run / "step2_dpo" / RUN_ARGS_FILE).write_text(json.dumps(
        {"step": "step2_dpo", "world_size": 1, "cwd": str(tmp_path),
         "flags": {"data_path": ["tiny"], "data_split": "4,4,2", "seed": 7}}))
    (run / "step2_dpo" / "metrics.json").write_text(json.dumps({"logp_accuracy": 0.9}))
    score = {"rule_score": 0.8, "prompts": 120, "empty_answers": 0}
    keep_rule_scores_with_the_dpo_model(str(run), {"sft": score, "dpo": score})
    capsys.readouterr()
    flags = held_out_rule_score_eval_flags()
    for policy in ("step1_sft", "step2_dpo"):
        args = ppo_eval.parse_args(["--policy", str(run / policy)])
        assert (args.data_split, args.seed, args.num_prompts, args.max_new_tokens, args.max_prompt_seq_len) == (
            "4,4,2", 7, 0, flags["max_new_tokens"], flags["max_prompt_seq_len"]), policy
        assert f"from {run / 'step2_dpo' / RUN_ARGS_FILE} and" in capsys.readouterr().out


def test_ppo_eval_scores_the_sft_model_with_the_flags_of_the_step_that_started_from_it(tmp_path, capsys):
    """train.py --recipe ppo, then --recipe dpo into the same folder: the DPO run's step 1 replaced the SFT model and
    its report scored it beside the DPO policy, but ppo_eval --policy <run>/step1_sft took the earlier step 3's flags
    (its --eval_prompts, a 2,4,4 split and seed 1234), that step 3 having started from the SFT model that is gone. Now
    the flags of the step that recorded it started from this SFT model; of two such, the last run's (report.json);
    one started from another model only where no other record is, said."""
    run = tmp_path / "run"
    sft = run / "step1_sft"
    for folder in ("step1_sft", "step2_dpo", "step3_ppo/actor"):
        (run / folder).mkdir(parents=True)
        (run / folder / "config.json").write_text("{}")
    (sft / RUN_ARGS_FILE).write_text(json.dumps({"step": "step1", "run_id": "sft-now", "flags": {}}))
    (sft / "metrics.json").write_text("{}")  # (a finished step output: its run id is the model's identity)

    def record(folder, step, started_from, flags):
        (run / folder / RUN_ARGS_FILE).write_text(json.dumps({"step": step, "world_size": 1, "cwd": str(tmp_path),
                                                              "inputs": {str(sft): started_from}, "flags": flags}))

    ppo_flags = {"data_path": ["tiny"], "data_split": "2,4,4", "eval_prompts": 8, "per_device_generation_batch_size": 4}
    dpo_flags = {"data_path": ["tiny"], "data_split": "4,4,2", "seed": 7}
    default_count = ppo_eval.build_parser().get_default("num_prompts")

    def scored_with():
        args = ppo_eval.parse_args(["--policy", str(sft)])
        return args.data_split, args.seed, args.num_prompts

    for ppo_start, dpo_start, expected in (("sft-before", "sft-now", ("4,4,2", 7, default_count)),  # PPO, then DPO
                                           ("sft-now", "sft-before", ("2,4,4", 1234, 8))):  # DPO, then PPO
        record("step3_ppo", "step3", ppo_start, ppo_flags)
        record("step2_dpo", "step2_dpo", dpo_start, dpo_flags)
        capsys.readouterr()
        assert scored_with() == expected, (ppo_start, dpo_start)
        taken = "step2_dpo" if dpo_start == "sft-now" else "step3_ppo"
        assert f"from {run / taken / RUN_ARGS_FILE}" in capsys.readouterr().out
    record("step2_dpo", "step2_dpo", "sft-now", dpo_flags)  # both started from it: the last train.py run's
    for policy, expected in (("step2_dpo", ("4,4,2", 7, default_count)), ("step3_ppo/actor", ("2,4,4", 1234, 8))):
        (run / "report.json").write_text(json.dumps({"policy": policy}))
        assert scored_with() == expected, policy
    (run / "step2_dpo" / RUN_ARGS_FILE).unlink()  # (train.py --step 1 after the run: no step started from it)
    record("step3_ppo", "step3", "sft-before", ppo_flags)
    capsys.readouterr()
    assert scored_with() == ("2,4,4", 1234, 8)
    assert (f"[ppo_eval] {run / 'step3_ppo'} was trained from another model than {sft} (step 1 ran again after it)"
            in capsys.readouterr().out)


def test_no_rule_scores_are_kept_where_no_dpo_model_finished(tmp_path):
    """metrics.json marks a finished step output: the rule scores are not written where there is none."""
    from dschat.pipeline import keep_rule_scores_with_the_dpo_model

    (tmp_path / "step2_dpo").mkdir()
    keep_rule_scores_with_the_dpo_model(str(tmp_path), {"sft": {}, "dpo": {}})
    assert not (tmp_path / "step2_dpo" / "metrics.json").exists()


def test_ppo_eval_says_when_the_run_has_fewer_held_out_prompts_than_num_prompts(models, tmp_path, capsys):
    """A step-3 run's --eval_prompts 256 became "--num_prompts 256" in the "from training_args.json" line, where the
    run has fewer held-out prompts (the summary said "over 240 prompts"), unqualified. Now the cap is said once the
    prompts are counted; a count within them says nothing more."""
    actor = tmp_path / "run" / "step3_ppo" / "actor"
    shutil.copytree(models["policy"], actor)
    (actor.parent / RUN_ARGS_FILE).write_text(json.dumps({"step": "step3", "world_size": 1, "cwd": str(tmp_path),
                                                         "flags": {"data_path": ["tiny"], "eval_prompts": 1000,
                                                                   "max_answer_seq_len": 1}}))
    (actor.parent / "metrics.json").write_text("{}")
    flags = ["--policy", str(tmp_path / "run"), "--num_examples", "0", "--data_output_path", str(tmp_path / "data")]
    capsys.readouterr()
    held_out = ppo_eval.main(flags)["policy"]["prompts"]
    out = capsys.readouterr().out
    assert "(flags given here win): --num_prompts 1008 --max_new_tokens 1" in out and 0 < held_out < 1008
    assert f"[ppo_eval] --num_prompts 1008: there are {held_out} held-out prompts, all scored\n" in out
    assert ppo_eval.main([*flags, "--num_prompts", "2"])["policy"]["prompts"] == 2
    assert "there are" not in capsys.readouterr().out


def test_ppo_eval_scores_the_answers_as_a_padded_forwards_step_3_run_scored_them(models, tmp_path, monkeypatch,
                                                                                    capsys):
    """Step 3 with --padded_forwards scores its held-out answers over left-padded rows (evaluate_policy's
    padded_forwards), which a reward model of LEFT_PADDING_MOVES_SCORES (RWKV, ...) scores otherwise than the shifted
    rows eval.py scored, so eval.py's reward_mean of the run's policy was not the run's. It now takes the run's
    --padded_forwards (said); --no-padded_forwards given wins."""
    actor = tmp_path / "run" / "step3_ppo" / "actor"
    shutil.copytree(models["policy"], actor)
    (actor.parent / RUN_ARGS_FILE).write_text(json.dumps({"step": "step3", "world_size": 1, "cwd": str(tmp_path),
                                                         "flags": {"data_path": ["tiny"], "padded_forwards": True}}))
    seen = []

    def capture(*args, **kwargs):
        seen.append(kwargs["padded_forwards"])
        return {}

    monkeypatch.setattr(ppo_eval, "evaluate_policy", capture)
    flags = ["--policy", str(tmp_path / "run"), "--num_prompts", "1", "--data_output_path", str(tmp_path / "data")]
    ppo_eval.evaluate_model(str(actor), None, ppo_eval.parse_args(flags))
    assert "(flags given here win): --padded_forwards" in capsys.readouterr().out
    ppo_eval.evaluate_model(str(actor), None, ppo_eval.parse_args([*flags, "--no-padded_forwards"]))
    assert seen == [True, False]


def test_the_rule_scorer_scores_the_tiny_data_by_name_or_by_path_and_nothing_else(tmp_path):
    """The rule scorer (ppo_eval's, step 3's) and --reward_fn tiny took the embedded data only as the name ``tiny``:
    its shipped files by path (or copied) were refused as "nothing to score the answers with"."""
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.evaluation import rule_scorer_for
    from dschat.rlhf.reward_fn import check_reward_sources
    from dschat.tiny import DATA_DIR, EVAL_FILE, TRAIN_FILE

    copy = tmp_path / "copy"
    shutil.copytree(DATA_DIR, copy)
    (tmp_path / "other.jsonl").write_text(json.dumps({"prompt": "hi", "chosen": "a", "rejected": "b"}) + "\n")
    for data in (["tiny"], "tiny", [str(DATA_DIR)], [f"jsonl:{TRAIN_FILE},{EVAL_FILE}"], [str(EVAL_FILE)],
                 [str(copy)], ["tiny", f"jsonl:{copy / 'train.jsonl'}"]):
        assert rule_scorer_for(data) is rule_score, data
        check_reward_sources(step3_args({"reward_fn": "tiny", "reward_model_weight": 0, "data_path": data}))
    for data in ([str(tmp_path / "other.jsonl")], ["tiny", str(tmp_path / "other.jsonl")], [],
                 [str(tmp_path / "missing.jsonl")], ["Dahoas/rm-static"]):
        assert rule_scorer_for(data) is None, data


def test_ppo_eval_rule_scores_the_tiny_data_given_by_its_path(models, tmp_path, capsys):
    """``--data_path dschat/tiny/data`` (no reward model): the tiny held-out prompts, rule-scored, as with the name."""
    from dschat.tiny import DATA_DIR

    flags = ["--policy", models["policy"], "--num_prompts", "2", "--max_new_tokens", "2", "--num_examples", "2",
             "--data_output_path", str(tmp_path / "data")]
    by_name = ppo_eval.main([*flags, "--data_path", "tiny"])["policy"]
    by_path = ppo_eval.main([*flags, "--data_path", os.path.relpath(DATA_DIR)])["policy"]
    assert by_path["prompts"] == 2 and by_path["rule_score_mean"] == by_name["rule_score_mean"]
    assert [e["rule_score"] for e in by_path["examples"]] == [rule_score(e["prompt"], e["answer"])
                                                              for e in by_path["examples"]]


@pytest.mark.parametrize("flags, said", [
    (["--data_path", "jsonl:MISSING"], "--data_path jsonl:MISSING: MISSING: no such file or folder"),
    (["--data_path", "MISSING.jsonl"], "--data_path MISSING.jsonl: no such file or folder"),
    (["--data_split", "1,1"], "--data_split '1,1' must have 3 parts"),
    (["--reward_fn", "MISSING.py:score"], "--reward_fn file MISSING.py does not exist"),
    (["--data_split", "1,0,0"], "--data_split 1,0,0 gives phase 3 (the data of step 3) no share of --data_path"),
    (["--sft_only_data_path", "tiny"], "--sft_only_data_path tiny: ppo_eval scores step 3's held-out prompts"),
])
@pytest.mark.parametrize("reward_model", [False, True])
def test_ppo_eval_checks_its_data_flags_before_any_model_loads(models, tmp_path, monkeypatch, flags, said,
                                                               reward_model):
    """A missing data file was "nothing to score the answers with" without a reward model, and with one an error only
    once both models had loaded, as was a --data_split of two parts (or of no phase-3 share) and a missing --reward_fn
    file."""
    from dschat.errors import UsageError

    monkeypatch.setattr(ppo_eval, "load_policy", lambda *a, **k: pytest.fail("a model loaded"))
    missing = str(tmp_path / "missing")
    flags = [flag.replace("MISSING", missing) for flag in flags] + (["--reward_model", models["rm"]] if reward_model
                                                                      else [])
    with pytest.raises(UsageError, match=re.escape(said.replace("MISSING", missing))):
        ppo_eval.main(["--policy", models["policy"], *flags, "--data_output_path", str(tmp_path / "data")])


def test_ppo_eval_help_leaves_out_the_sft_only_data_flag_it_refuses():
    """Step 3's data group gave ppo_eval --sft_only_data_path, listed in its help and read by nothing."""
    assert "--sft_only_data_path" not in ppo_eval.build_parser().format_help()
    assert "--data_split" in ppo_eval.build_parser().format_help()


def test_ppo_eval_checks_lengths_before_generating(tmp_path):
    from dschat.errors import UsageError

    policy, reward_model = gpt2_models(tmp_path)
    args = ["--policy", policy, "--reward_model", reward_model, "--data_output_path", str(tmp_path / "data")]
    with pytest.raises(SystemExit):  # HF's generate would refuse it after every model and the data loaded
        ppo_eval.build_parser().parse_args([*args, "--max_new_tokens", "0"])
    with pytest.raises(UsageError,
                       match=r"--max_prompt_seq_len \+ --max_new_tokens = 856 tokens.*512 learned.*\(--policy .*gpt2\)"):
        ppo_eval.main([*args, "--max_prompt_seq_len", "256", "--max_new_tokens", "600"])


def test_ppo_eval_and_rw_eval_check_lengths_against_each_models_positions_before_any_model_loads(models, tmp_path,
                                                                                                  monkeypatch):
    """A sequence longer than a model's table of learned positions was refused only once the models had loaded (a
    baseline's, once the policy had answered every prompt)."""
    from dschat.errors import UsageError

    monkeypatch.setattr(ppo_eval, "load_policy", lambda *a, **k: pytest.fail("a model loaded"))
    monkeypatch.setattr(rw_eval, "load_scoring_reward_model", lambda *a, **k: pytest.fail("a model loaded"))
    gpt2, gpt2_rm = gpt2_models(tmp_path)  # (a table of 512 positions; tiny-llama's rotary positions have none)
    lengths = ["--max_prompt_seq_len", "256", "--max_new_tokens", "300", "--data_output_path", str(tmp_path / "data")]
    for flags, role, path in ((["--policy", models["policy"], "--baseline", gpt2], "--baseline", gpt2),
                              (["--policy", gpt2], "--policy", gpt2)):
        with pytest.raises(UsageError, match=rf"--max_prompt_seq_len \+ --max_new_tokens = 556 tokens.*512 learned"
                                             rf".*\({role} {re.escape(path)}\)"):
            ppo_eval.main([*flags, *lengths])
    with pytest.raises(UsageError, match=r"--max_seq_len = 600 tokens.*512 learned"):
        rw_eval.main(["--model_name_or_path", gpt2_rm, "--max_seq_len", "600", "--prompt", "hi", "--answer", "yo"])


def test_ppo_eval_refuses_a_policy_whose_token_ids_the_reward_model_reads_as_other_text(models, tmp_path):
    """The reward model was loaded with the first policy's tokenizer and scored a baseline of another tokenizer's ids
    as other text (numbers that meant nothing), as step 3 and train.py refuse."""
    from dschat.errors import UsageError

    other = tmp_path / "other_vocab"
    shutil.copytree(models["baseline"], other)
    tokenizer = load_tokenizer(str(other))
    tokenizer.add_tokens(["<brand_new_token>"])
    tokenizer.save_pretrained(other)
    with pytest.raises(UsageError, match=f"the reward model {re.escape(models['rm'])} has another tokenizer than the "
                                         f"actor {re.escape(str(other))}"):
        ppo_eval.main(["--policy", models["policy"], "--baseline", str(other), "--reward_model", models["rm"],
                       "--data_output_path", str(tmp_path / "data"), "--num_prompts", "2", "--max_new_tokens", "2"])


def test_ppo_eval_scores_as_many_held_out_prompts_as_step3_did_on_its_ranks():
    """Each of step 3's ranks scores its share of --eval_prompts in whole generation batches, the ranks interleaved
    over the prompts in order: ppo_eval, one process, takes that many of the first prompts."""
    assert ppo_eval.step3_eval_prompts(64, 16, 1) == ppo_eval.step3_eval_prompts(64, 16, 2) == 64
    assert ppo_eval.step3_eval_prompts(64, 16, 8) == 128  # 8 per rank, rounded up to a batch of 16
    assert ppo_eval.step3_eval_prompts(10, 4, 2) == 16 and ppo_eval.step3_eval_prompts(0, 16, 4) == 0


def test_ppo_eval_reads_step3s_data_files_from_any_folder_and_keeps_its_cache_out_of_the_run(tmp_path, monkeypatch):
    """training_args.json keeps the data flags as typed, relative to step 3's working directory (recorded): the tool
    reads the same files from elsewhere (before, it read ./data/... wherever it ran, or failed); its data cache goes
    where its own --data_output_path says, not into the run's (maybe moved) folder."""
    from dschat.data.raw_datasets import anchored_spec

    run_cwd, elsewhere, actor = tmp_path / "run", tmp_path / "elsewhere", tmp_path / "run" / "out" / "actor"
    for folder in (run_cwd / "data", elsewhere / "data", actor):
        folder.mkdir(parents=True)
    for name in ("prompts.jsonl", "train.json", "eval.json"):
        (run_cwd / "data" / name).write_text("{}\n")
    (actor / "config.json").write_text("{}")
    (elsewhere / "data" / "prompts.jsonl").write_text("{}\n")  # a file of the same name here is not step 3's
    specs = ["jsonl:data/prompts.jsonl", "data/prompts.jsonl", "tiny", "Dahoas/rm-static", "local/jsonfile",
             "jsonl:moved/prompts.jsonl"]  # no longer under the run's folder (a moved project): read here, as typed
    (actor.parent / "training_args.json").write_text(json.dumps(
        {"step": "step3", "world_size": 1, "cwd": str(run_cwd),
         "flags": {"data_path": specs, "data_output_path": "out/cache", "eval_prompts": 8}}))
    monkeypatch.chdir(elsewhere)
    args = ppo_eval.parse_args(["--policy", "../run/out/actor", "--reward_model", "x"])
    prompts = str(run_cwd / "data" / "prompts.jsonl")
    assert args.data_path == [f"jsonl:{prompts}", prompts, "tiny", "Dahoas/rm-static",
                              f"json:{run_cwd / 'data' / 'train.json'},{run_cwd / 'data' / 'eval.json'}",
                              "jsonl:moved/prompts.jsonl"]
    assert args.data_output_path == ppo_eval.build_parser().get_default("data_output_path")
    assert anchored_spec("data/prompts.jsonl", str(tmp_path)) == "data/prompts.jsonl"  # names nothing there
    # a run folder's SFT model takes its step 3's flags; a DPO policy beside an older PPO run does not
    for folder in ("step1_sft", "step2_dpo", "step3_ppo"):
        (tmp_path / "two" / folder).mkdir(parents=True)
        (tmp_path / "two" / folder / "config.json").write_text("{}")
    (tmp_path / "two" / "step3_ppo" / "training_args.json").write_text(json.dumps(
        {"step": "step3", "world_size": 1, "flags": {"data_path": ["tiny"], "eval_prompts": 8,
                                                     "per_device_generation_batch_size": 4}}))
    counts = {folder: ppo_eval.parse_args(["--policy", str(tmp_path / "two" / folder)]).num_prompts
              for folder in ("step1_sft", "step2_dpo")}
    assert counts == {"step1_sft": 8, "step2_dpo": ppo_eval.build_parser().get_default("num_prompts")}


def test_ppo_eval_reads_the_runs_tokenized_prompts_from_its_data_cache(tmp_path, capsys):
    """ppo_eval tokenized a run's held-out prompts again into its own /tmp/dschat_data_files, where the steps of a
    train.py run share <output>/data_cache: it takes the run's cache, where the run folder is now (moved here)."""
    run = tmp_path / "now" / "run"  # (the run was made in tmp_path/then, as its records say)
    for step, folder in (("step3", "step3_ppo/actor"), ("step2_dpo", "step2_dpo")):
        (run / folder).mkdir(parents=True)
        (run / folder / "config.json").write_text("{}")
        record_folder = run / folder.split("/")[0]
        (record_folder / RUN_ARGS_FILE).write_text(json.dumps(
            {"step": step, "world_size": 1, "cwd": str(tmp_path / "then"),
             "flags": {"data_path": ["tiny"], "output_dir": f"run/{record_folder.name}",
                       "data_output_path": "run/data_cache"}}))
    default = ppo_eval.build_parser().get_default("data_output_path")
    assert ppo_eval.parse_args(["--policy", str(run / "step3_ppo/actor")]).data_output_path == default  # (none yet)
    (run / "data_cache").mkdir()
    capsys.readouterr()
    for policy in (run / "step3_ppo/actor", run / "step2_dpo"):
        assert ppo_eval.parse_args(["--policy", str(policy)]).data_output_path == str(run / "data_cache")
        assert f"--data_output_path {run / 'data_cache'}" in capsys.readouterr().out
    given = ppo_eval.parse_args(["--policy", str(run / "step2_dpo"), "--data_output_path", str(tmp_path / "mine")])
    assert given.data_output_path == str(tmp_path / "mine")


def test_ppo_eval_takes_the_runs_field_names_only_with_the_runs_files(tmp_path):
    """A --data_path of one's own got the run's --data_fields too ("no 'question' field, which --data_fields
    prompt=question names"): they go with the run's files."""
    actor = tmp_path / "out" / "actor"
    actor.mkdir(parents=True)
    (actor / "config.json").write_text("{}")
    (actor.parent / "training_args.json").write_text(json.dumps(
        {"step": "step3", "world_size": 1, "cwd": str(tmp_path),
         "flags": {"data_path": ["jsonl:q.jsonl"], "data_fields": "prompt=question"}}))
    assert ppo_eval.parse_args(["--policy", str(actor)]).data_fields == "prompt=question"
    own = ppo_eval.parse_args(["--policy", str(actor), "--data_path", "jsonl:mine.jsonl"])
    assert own.data_path == ["jsonl:mine.jsonl"] and own.data_fields == ""
    embedded = ppo_eval.parse_args(["--policy", str(actor), "--data_path", "tiny"])  # given as its default value
    assert embedded.data_path == ["tiny"] and embedded.data_fields == ""


def test_ppo_eval_writes_policy_and_baseline_results(models, tmp_path, capsys):
    out_json = tmp_path / "eval" / "ppo_eval.json"
    results = ppo_eval.main(["--policy", models["policy"], "--baseline", models["baseline"], "--reward_model",
                             models["rm"], "--num_prompts", "4", "--per_device_generation_batch_size", "4",
                             "--max_new_tokens", "4", "--max_prompt_seq_len", "48", "--num_examples", "4",
                             "--data_output_path", str(tmp_path / "data"), "--output_json", str(out_json)])
    saved = json.loads(out_json.read_text())
    out = capsys.readouterr().out
    for role in ("policy", "baseline"):
        entry = saved[role]
        assert entry["prompts"] == 4 and len(entry["examples"]) == 4
        # the mean is over the scored answers themselves (all of them are kept as examples here)
        assert entry["reward_mean"] == pytest.approx(sum(e["reward"] for e in entry["examples"]) / 4, abs=1e-5)
        assert entry["rule_score_mean"] == pytest.approx(
            sum(rule_score(e["prompt"], e["answer"]) for e in entry["examples"]) / 4)
        assert entry["reward_mean"] == pytest.approx(results[role]["reward_mean"])
        assert f"reward_mean {entry['reward_mean']:+.4f}" in out
    assert saved["policy"]["reward_mean"] != saved["baseline"]["reward_mean"]
    assert [e["prompt"] for e in saved["policy"]["examples"]] == [e["prompt"] for e in saved["baseline"]["examples"]]
    assert "name no flag" not in out  # the tool's own flags (--max_new_tokens, ...) are not step 3's unused settings
    assert out.count("phase 3 tiny eval:") == 1  # both tokenizers encode alike: the prompts were built (said) once


def test_ppo_eval_with_every_prompt_skipped_says_it_has_no_score(models, tmp_path, capsys):
    """Every held-out prompt longer than --max_prompt_seq_len: the tool failed with step 3's "step3: no training
    records", naming training records it does not use."""
    results = ppo_eval.main(["--policy", models["policy"], "--reward_model", models["rm"], "--max_prompt_seq_len", "3",
                             "--max_new_tokens", "4", "--data_output_path", str(tmp_path / "data")])
    assert results["policy"]["prompts"] == 0
    out = capsys.readouterr().out
    assert "no held-out prompts, so no score" in out and "prompt longer than 3 tokens" in out


@pytest.mark.parametrize("flags, said", [
    (["--prompt", "", "--answer", "x"], "--prompt: the prompt is empty"),
    (["--prompt", "Hi", "--answer", " "], "--answer: an answer is empty"),
    (["--prompt", "Hi"], "--prompt and --answer go together"),
    (["--answer", "x"], "--prompt and --answer go together"),
])
def test_rw_eval_says_which_message_flag_is_empty_or_missing(flags, said, capsys):
    with pytest.raises(SystemExit):
        rw_eval.main(["--model_name_or_path", "unused", *flags])
    assert said in capsys.readouterr().err


def test_the_report_lists_the_steps_in_order_whether_run_or_skipped():
    # train.py --resume that resumed step 3 and skipped steps 1 and 2 listed step 3 first
    from dschat.report import summary_lines

    lines = summary_lines({"timings_s": {"step3_ppo": 19.7}, "skipped": ["step1_sft", "step2_rm"],
                           "resumed": ["step3_ppo"]})
    assert [line.split(":")[0] for line in lines[1:4]] == ["step1_sft", "step2_rm", "step3_ppo"]
    assert lines[3] == "step3_ppo: 19.7 s (resumed: the earlier run's time up to its checkpoint included)"


def test_the_tools_help_says_which_decoding_is_their_default():
    """chat.py samples and prompt_eval decodes greedily, while both helps said only "Greedy decoding." and "Sample
    (temperature/top-k/top-p).", and no length: a user could not tell from --help what a plain run does."""
    from dschat.tools import chat

    def help_line(parser, flag):
        return " ".join(next(action.help for action in parser._actions if flag in action.option_strings).split())

    chat_parser, prompt_eval_parser = chat.build_parser(), prompt_eval.build_parser()
    assert chat_parser.parse_args(["--path", "x"]).do_sample and "(default)" in help_line(chat_parser, "--do_sample")
    assert "(default)" not in help_line(chat_parser, "--greedy")
    assert not prompt_eval_parser.parse_args(["--model_name_or_path_baseline", "a", "--model_name_or_path_finetune",
                                              "b"]).do_sample
    assert "(default)" in help_line(prompt_eval_parser, "--greedy")
    assert "(default)" not in help_line(prompt_eval_parser, "--do_sample")
    assert "(default: 128)" in chat_parser.format_help()


@pytest.mark.parametrize("tool, argv", [
    ("prompt_eval", ["--model_name_or_path_baseline", "tiny-llama", "--model_name_or_path_finetune", "tiny-llama"]),
    ("prompt_eval", ["--model_name_or_path_baseline", "tiny-llama", "--model_name_or_path_finetune", "tiny-llama",
                     "--prompts", "Hi"]),
    ("rw_eval", ["--model_name_or_path", "RM"]),
    ("rw_eval", ["--model_name_or_path", "RM", "--prompt", "Hi", "--answer", "Hello"]),
])
def test_data_fields_without_the_file_they_name_are_a_flag_error(tool, argv, models, capsys):
    """--data_fields with the embedded data or command-line prompts was ignored, unsaid: the user named fields of a
    file the tool did not read."""
    main = {"prompt_eval": prompt_eval.main, "rw_eval": rw_eval.main}[tool]
    argv = [models["rm"] if word == "RM" else word for word in argv]
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--data_fields", "prompt=question"])
    assert stop.value.code == 2
    file_flag = "--prompts_file" if tool == "prompt_eval" else "--pairs_file"
    assert f"--data_fields prompt=question: it names the fields of {file_flag}, which is not read here" in \
        capsys.readouterr().err


def test_prompt_eval_help_lists_deepspeed_chats_accepted_decoding_flags():
    from dschat.tools.prompt_eval import build_parser

    text = build_parser().format_help()
    assert all(flag in text for flag in ("--num_beams", "--num_beam_groups", "--penalty_alpha", "--language"))


def test_chat_help_says_how_to_chat_in_plain_text():
    """chat.py --help said "Multi-turn chat with a trained policy (DeepSpeed-Chat's ``inference/chatbot.py``)": reST
    markup, and nothing of how a chat goes ('clear', 'quit'), which its prompt said only once it had started."""
    from dschat.tools.chat import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "``" not in text
    assert "messages typed or piped in ('clear' starts a new conversation, 'quit' or 'exit' ends it), or one " \
           "answer to --prompt" in text


@pytest.mark.parametrize("tool", ["chat", "rw_eval", "ppo_eval", "prompt_eval"])
def test_each_tool_runs_as_a_module_too(tool):
    """``python -m dschat.tools.rw_eval ...`` printed nothing and exited 0 whatever it was given."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", f"dschat.tools.{tool}", "--help"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("usage:"), proc.stderr[-2000:]


def test_a_command_line_prompt_is_read_as_a_prompt_field_is_and_a_question_about_the_markers_stays_whole():
    """rw_eval's --prompt and prompt_eval's --prompts split any "Human:"/"Assistant:" inside a plain question into
    turns (and scored a "prompt" that ended with an assistant turn), where training data reads it as one message."""
    from dschat.errors import UsageError
    from dschat.tools.records import prompt_record

    question = "In a chat log, what do the labels Human: and Assistant: mean?"
    assert prompt_record(question).messages == [{"role": "user", "content": question}]
    assert prompt_record("Assistant: is a word").messages == [{"role": "user", "content": "Assistant: is a word"}]
    assert prompt_record("\n\nHuman: Hi\n\nAssistant: Hello.\n\nHuman: Bye?\n\nAssistant:").messages == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"}]
    assert prompt_record("Be brief.\n\nHuman: Hi\n\nAssistant:").messages[0] == {"role": "system", "content": "Be brief."}
    with pytest.raises(UsageError, match=r"--prompts 'Human: Hi Assistant: Hello': the transcript must end with a "
                                         r"non-empty 'Human:' turn"):
        prompt_record("Human: Hi Assistant: Hello", "--prompts")


def test_the_tools_warn_of_a_model_an_interrupted_step_left(tmp_path, capsys, monkeypatch):
    """chat.py and the eval tools used the actor of a step 3 run again and interrupted (the earlier run's model, or part
    of the new one's) without a word."""
    from dschat.tools.common import find_policy_path, flag_path

    actor = tmp_path / "step3_ppo" / "actor"
    actor.mkdir(parents=True)
    (actor / "config.json").write_text("{}")
    (tmp_path / "step3_ppo" / RUN_ARGS_FILE).write_text("{}")
    assert flag_path("--path", find_policy_path, str(tmp_path)) == str(actor)
    assert (f"warning: --path {actor}: {tmp_path / 'step3_ppo'} is an unfinished step output: its last training run "
            "was interrupted, or is still running") in capsys.readouterr().err
    monkeypatch.chdir(actor)  # the actor's folder given as "."
    assert flag_path("--path", find_policy_path, ".") == "."
    assert "is an unfinished step output" in capsys.readouterr().err
    (tmp_path / "step3_ppo" / "metrics.json").write_text("{}")
    monkeypatch.setattr("dschat.utils.cli._SAID", set())  # (said once: the same warning again would not be)
    assert flag_path("--path", find_policy_path, str(tmp_path)) == str(actor)
    assert "warning" not in capsys.readouterr().err



def test_a_file_given_as_the_model_folder_is_an_error_naming_its_folder(tmp_path, capsys):
    """chat.py --path OUT/report.json ended in a tokenizer traceback, and --path OUT/step1_sft/model.safetensors in
    "no such folder here, and loading it as a hub name failed (... not a valid JSON file)"."""
    from dschat.models.loading import load_tokenizer
    from dschat.tools import chat

    (tmp_path / "step1_sft").mkdir()
    for file in (tmp_path / "report.json", tmp_path / "step1_sft" / "model.safetensors"):
        file.write_text("{}")
        with pytest.raises(FileNotFoundError, match=f"--path {file}: a file, not a model folder: give the folder that "
                                                    f"holds the model .*e.g. {file.parent}"):
            chat.main(["--path", str(file), "--prompt", "hi"])
        with pytest.raises(FileNotFoundError, match="a file, not a model folder"):
            load_tokenizer(str(file))


def test_chat_cuts_an_answer_at_the_next_human_turn_the_model_wrote_on_with(session, monkeypatch):
    """Without a chat template a model that does not stop at its EOS writes the user's next turn too: chat.py showed it
    as the assistant's answer and kept it in the history as the assistant's words (DeepSpeed-Chat's chatbot cuts it)."""
    from dschat.tools import chat

    monkeypatch.setattr(chat, "generate_answers_and_cuts",
                        lambda *a: (["Red, blue.\n\nHuman: And green?\n\nAssistant: Green."], [True]))
    session.clear()
    assert session.ask("Name two colors.") == "Red, blue."
    assert session.history[-1] == {"role": "assistant", "content": "Red, blue."}
    templated = copy.deepcopy(session.tokenizer)  # a chat template's answer is kept as generated
    templated.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert chat.own_turn("A.\n\nHuman: B", templated) == "A.\n\nHuman: B"


def test_chat_keeps_no_answer_that_is_only_a_human_turn_the_model_wrote(session, monkeypatch):
    """A model that answers with nothing but the user's next turn (" \n\nHuman: And green?", stripped to "Human: And
    green?"): the cut looked for "\n\nHuman:" in the stripped text, so chat.py showed the made-up turn as the answer
    and kept it in the history as the assistant's words."""
    from dschat.tools import chat

    monkeypatch.setattr(chat, "generate_answers_and_cuts",
                        lambda *a: (["Human: And green?\n\nAssistant: Green."], [True]))
    session.clear()
    assert session.ask("Name two colors.") == ""
    assert session.history[-1] == {"role": "assistant", "content": ""}
    assert chat.own_turn("A Human: wrote this.", session.tokenizer) == "A Human: wrote this."  # (words of the answer)


def test_a_count_of_one_is_said_in_the_singular(tmp_path, capsys):
    # "[dschat] 1 records of ...", "1 batches per rank"
    from dschat.report import counted
    from dschat.tools.records import load_records

    assert (counted(1, "batch", "batches"), counted(2, "batch", "batches"), counted(0, "record")) == \
        ("1 batch", "2 batches", "0 records")
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"prompt": "Name a color.", "chosen": "red", "rejected": "no"}) + "\n")
    assert len(load_records(f"jsonl:{data}")) == 1
    assert f"[dschat] 1 record of jsonl:{data}\n" in capsys.readouterr().out


def test_ppo_eval_scores_a_policy_with_more_token_embeddings_than_the_reward_model(models, tmp_path, monkeypatch):
    """A policy of one family's larger size has embedding rows past the reward model's (Qwen2.5-7B's 152064, 0.5B's
    151936): an id it answered with past the reward model's rows stopped ppo_eval with an IndexError in the reward
    model's forward. The reward model grows to the policy's rows, as step 3 grows it to the actor's."""
    from transformers import AutoModelForCausalLM

    from dschat.models.loading import embedding_rows

    tokenizer = load_tokenizer(models["policy"])
    wide = tmp_path / "wide_policy"
    model = AutoModelForCausalLM.from_pretrained(models["policy"])
    rows = embedding_rows(model) + 16
    model.resize_token_embeddings(rows)
    model.save_pretrained(wide)
    tokenizer.save_pretrained(wide)

    def answering_with_the_last_id(*args, **kwargs):  # (a random policy seldom samples it: it answers with it)
        policy, policy_tokenizer = load_policy(*args, **kwargs)

        def generate(input_ids, **kw):
            return torch.cat([input_ids, torch.full((len(input_ids), 2), rows - 1)], dim=1)

        policy.generate = generate
        return policy, policy_tokenizer

    monkeypatch.setattr(ppo_eval, "load_policy", answering_with_the_last_id)
    args = ppo_eval.parse_args(["--policy", str(wide), "--reward_model", models["rm"], "--num_prompts", "2",
                                "--max_new_tokens", "2", "--data_output_path", str(tmp_path / "cache"),
                                "--num_examples", "0"])
    result, reward_model = ppo_eval.evaluate_model(str(wide), models["rm"], args)
    assert embedding_rows(reward_model.rwtransformer) >= rows
    assert math.isfinite(result["reward_mean"]), result


def test_rw_eval_refuses_a_prompt_too_long_for_max_seq_len_before_the_model_loads(models, monkeypatch):
    """A --prompt leaving no room for an answer in --max_seq_len was said only after the reward model had loaded, and
    without naming --prompt."""
    from dschat.errors import UsageError

    def loaded(*args, **kwargs):
        raise AssertionError("the reward model loaded")

    monkeypatch.setattr(rw_eval, "load_scoring_reward_model", loaded)
    with pytest.raises(UsageError, match=r"^--prompt: a prompt of \d+ tokens leaves no room for an answer in "
                                         r"--max_seq_len 32"):
        rw_eval.main(["--model_name_or_path", models["rm"], "--prompt", "Say hi. " * 40, "--answer", "hi",
                      "--max_seq_len", "32"])


def test_the_tools_answers_never_hold_ids_of_embedding_rows_the_tokenizer_has_no_token_for(models, monkeypatch):
    """A policy with more embedding rows than its tokenizer has tokens (Qwen2.5: 151936 for 151665): chat and
    prompt_eval's HF generate suppresses those ids, as step 3's rollouts do, even where they are the most likely."""
    from dschat.tools import generation

    model, tokenizer = load_policy(models["policy"], device="cpu")
    tokens = len(tokenizer)
    model.resize_token_embeddings(tokens + 8)
    bias = torch.zeros(tokens + 8)
    bias[tokens:] = 50.0
    model.get_output_embeddings().register_forward_hook(lambda m, inputs, output: output + bias)
    prompt = [format_prompt([{"role": "user", "content": "Say hi."}], tokenizer)]
    ids, mask = encode_prompt_batch(tokenizer, prompt)
    plain = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=tokenizer.pad_token_id, **GREEDY)
    assert (plain[0, ids.shape[1]:] >= tokens).all(), "the premise: those rows win"
    seen, decode = [], generation.decode_answers
    monkeypatch.setattr(generation, "decode_answers", lambda tok, answer_ids, stop_ids=None: seen.append(answer_ids)
                        or decode(tok, answer_ids, stop_ids))
    generation.generate_answers(model, tokenizer, prompt, dict(GREEDY))
    generation.generate_answers(model, tokenizer, prompt, {**GREEDY, "do_sample": True, "top_k": 0})
    assert len(seen) == 2 and all((answer < tokens).all() and answer.numel() for answer in seen), seen


def test_ppo_eval_answers_never_hold_ids_of_embedding_rows_the_tokenizer_has_no_token_for(models, monkeypatch):
    """ppo_eval scores step 3's held-out prompts as step 3 does: its HF generate suppresses the embedding rows past
    the tokenizer (Qwen2.5: 151936 for 151665), as step 3's held-out evaluation does since it suppresses them too.
    It passed the model's plain generate: a policy whose extra rows are most likely answered with ids that decode to
    nothing, and its score differed from step 3's for the same policy."""
    real_load, captured = ppo_eval.load_policy, {}

    def load_with_extra_rows(path, *args, **kwargs):
        model, tokenizer = real_load(path, *args, **kwargs)
        tokens = len(tokenizer)
        model.resize_token_embeddings(tokens + 8)
        bias = torch.zeros(tokens + 8)
        bias[tokens:] = 50.0
        model.get_output_embeddings().register_forward_hook(lambda m, inputs, output: output + bias)
        captured.update(model=model, tokenizer=tokenizer)
        return model, tokenizer

    def capture(generate, *args, **kwargs):
        captured["generate"] = generate
        return {}

    monkeypatch.setattr(ppo_eval, "load_policy", load_with_extra_rows)
    monkeypatch.setattr(ppo_eval, "evaluate_policy", capture)
    args = ppo_eval.parse_args(["--policy", models["policy"], "--reward_model", models["rm"], "--num_prompts", "2"])
    ppo_eval.evaluate_model(models["policy"], None, args)
    tokenizer, model = captured["tokenizer"], captured["model"]
    ids, mask = encode_prompt_batch(tokenizer, [format_prompt([{"role": "user", "content": "Say hi."}], tokenizer)])
    plain = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=tokenizer.pad_token_id, **GREEDY)
    assert (plain[0, ids.shape[1]:] >= len(tokenizer)).all(), "the premise: those rows win"
    with torch.no_grad():
        answer = captured["generate"](ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                      pad_token_id=tokenizer.pad_token_id)
    assert (answer[0, ids.shape[1]:] < len(tokenizer)).all(), answer


def test_a_stop_id_past_the_tokenizers_ids_is_not_suppressed(models, monkeypatch):
    """A generation_config whose EOS id the tokenizer has no token for: the rows past the tokenizer are suppressed
    from the stop id on, so answers still end there (suppressed, it could never be chosen and answers never ended)."""
    from dschat.models.loading import generable_token_count
    from dschat.rlhf.trainer import untokenized_ids
    from dschat.tools import generation

    model, tokenizer = load_policy(models["policy"], device="cpu")
    tokens = len(tokenizer)
    model.resize_token_embeddings(tokens + 8)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokens + 2]
    assert generable_token_count(model, tokenizer) == tokens + 3
    assert untokenized_ids(model, tokenizer) == list(range(tokens + 3, tokens + 8))
    bias = torch.zeros(tokens + 8)
    bias[tokens + 2] = 50.0
    model.get_output_embeddings().register_forward_hook(lambda m, inputs, output: output + bias)
    seen, decode = [], generation.decode_answers
    monkeypatch.setattr(generation, "decode_answers", lambda tok, answer_ids, stop_ids=None: seen.append(answer_ids)
                        or decode(tok, answer_ids, stop_ids))
    prompt = [format_prompt([{"role": "user", "content": "Say hi."}], tokenizer)]
    assert generation.generate_answers(model, tokenizer, prompt, dict(GREEDY)) == [""]
    assert seen[0][0, 0] == tokens + 2, seen


def test_the_tools_say_which_generation_config_settings_apply_beside_their_flags(models, capsys):
    """A model's generation_config settings that no tool flag sets (Qwen2.5-Instruct's repetition_penalty 1.05) were
    applied by HF's generate in chat.py and prompt_eval, unsaid, while --temperature/--top_k/--top_p came from the
    flags. They are said once; the sampling ones the flags replace, or greedy decoding does not read, are not."""
    from dschat.tools.generation import generate_answers

    model, tokenizer = load_policy(models["policy"], device="cpu")
    model.generation_config.update(repetition_penalty=1.07, do_sample=True, temperature=0.7, top_p=0.8)
    prompt = [format_prompt([{"role": "user", "content": "Say hi."}], tokenizer)]
    generate_answers(model, tokenizer, prompt, dict(GREEDY))
    said = capsys.readouterr().err
    assert "generation_config applies repetition_penalty=1.07 (no flag of this tool sets it" in said
    assert "temperature" not in said and "top_p" not in said
    generate_answers(model, tokenizer, prompt, {**GREEDY, "do_sample": True, "temperature": 1.0, "top_p": 1.0,
                                                "top_k": 0, "repetition_penalty": 1.0})
    assert "generation_config" not in capsys.readouterr().err  # (every setting given: nothing comes from it)
