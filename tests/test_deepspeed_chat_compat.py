"""DeepSpeed-Chat's command lines: a user's DeepSpeed config file (--deepspeed_config, or --deepspeed PATH) merged over
the config dschat builds, DeepSpeed-Chat's older flag names, and train.py's model-size shorthand: the commands of
DeepSpeed-Chat's scripts and walk-throughs run as written."""
import json
import os
import re
import shlex
from types import SimpleNamespace

import pytest

from dschat.args import step1_parser, step2_parser, step3_parser
from dschat.rlhf.config import step3_args
from dschat.models import training_engine
from dschat.steps import common, sft
from dschat.utils.ds_config import apply_user_ds_config, get_train_ds_config, owned_key_flags, user_ds_config_path
from helpers import SFT_FAST, check_checkpointing_toggle

# As a DeepSpeed-Chat walk-through writes them (../shared/reference/seeds/004_*), flags only.
WALKTHROUGH = {
    step1_parser: "--data_path Dahoas/rm-static --model_name_or_path facebook/opt-1.3b --per_device_train_batch_size 8 "
                  "--per_device_eval_batch_size 8 --max_seq_len 512 --learning_rate 1e-5 --weight_decay 0.1 "
                  "--num_train_epochs 1 --gradient_accumulation_steps 8 --lr_scheduler_type cosine "
                  "--num_warmup_steps 100 --seed 42 --gradient_checkpointing --output_dir output/sft "
                  "--deepspeed training/step1_supervised_finetuning/ds_config.json",
    step2_parser: "--data_path Dahoas/rm-static --model_name_or_path facebook/opt-350m --num_padding_at_beginning 0 "
                  "--per_device_train_batch_size 8 --per_device_eval_batch_size 8 --max_seq_len 512 "
                  "--learning_rate 5e-6 --weight_decay 0.01 --output_dir output/rm "
                  "--deepspeed training/step2_reward_model_finetuning/ds_config.json",
    step3_parser: "--actor_model_name_or_path output/sft --critic_model_name_or_path output/rm --num_train_epochs 1 "
                  "--per_device_train_batch_size 8 --per_device_mini_batch_size 4 --generation_batch_numbers 2 "
                  "--ppo_epochs 1 --max_answer_seq_len 256 --max_prompt_seq_len 256 --enable_hybrid_engine "
                  "--inference_tp_size 1 --tp_gather_partition_size 8 --zero_stage 3 --actor_gradient_checkpointing "
                  "--critic_gradient_checkpointing --output_dir output/ppo "
                  "--deepspeed training/step3_rlhf_finetuning/ds_config.json",
}


def _write(tmp_path, config, name="ds_config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config) if not isinstance(config, str) else config)
    return str(path)


@pytest.mark.parametrize("parser", list(WALKTHROUGH), ids=lambda p: p.__name__)
def test_walkthrough_commands_parse_and_name_their_config_file(parser):
    args = parser().parse_args(shlex.split(WALKTHROUGH[parser]))
    assert user_ds_config_path(args).endswith("ds_config.json")


def test_old_step3_names_set_the_current_flags_and_zero_stage_fills_both_models():
    args = step3_args(step3_parser().parse_args(shlex.split(WALKTHROUGH[step3_parser])))
    assert (args.per_device_generation_batch_size, args.per_device_training_batch_size, args.generation_batches) \
        == (8, 4, 2)
    assert (args.actor_zero_stage, args.critic_zero_stage) == (3, 3)
    mixed = step3_args(step3_parser().parse_args(["--zero_stage", "3", "--critic_zero_stage", "2"]))
    assert (mixed.actor_zero_stage, mixed.critic_zero_stage) == (3, 2), "an explicit per-model stage wins"
    assert (step3_args({}).actor_zero_stage, step3_args({}).critic_zero_stage) == (0, 0)
    assert step3_args({"actor_zero_stage": 2}).actor_zero_stage == 2


def test_deepspeed_flag_alone_is_still_a_switch_and_two_different_files_are_an_error():
    args = step1_parser().parse_args(["--deepspeed"])
    assert args.deepspeed is True and user_ds_config_path(args) is None
    same = step1_parser().parse_args(["--deepspeed", "./a.json", "--deepspeed_config", "a.json"])
    assert user_ds_config_path(same) == "a.json"
    with pytest.raises(ValueError, match="name different configs"):
        user_ds_config_path(step1_parser().parse_args(["--deepspeed", "a.json", "--deepspeed_config", "b.json"]))


FLAGS = owned_key_flags("--per_device_train_batch_size", "--zero_stage")


def test_the_file_wins_on_tuning_and_auto_or_equal_values_keep_the_flags(tmp_path):
    generated = get_train_ds_config(stage=2, micro_batch_size=4, gradient_accumulation_steps=2)
    path = _write(tmp_path, {"gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": "auto",
                             "gradient_accumulation_steps": 2,
                             "zero_optimization": {"stage": 2, "reduce_bucket_size": 12345,
                                                   "offload_optimizer": {"pin_memory": True}},
                             "communication_data_type": "fp32"})
    merged = apply_user_ds_config(generated, path, FLAGS)
    assert merged["gradient_clipping"] == 0.5 and merged["communication_data_type"] == "fp32"
    assert merged["zero_optimization"]["reduce_bucket_size"] == 12345
    assert merged["zero_optimization"]["offload_optimizer"] == {"device": "none", "pin_memory": True}, \
        "nested blocks merge key by key"
    assert merged["train_micro_batch_size_per_gpu"] == 4 and merged["zero_optimization"]["stage"] == 2
    assert generated["gradient_clipping"] == 1.0, "the generated config is not changed in place"
    assert apply_user_ds_config(generated, None, FLAGS) is generated


@pytest.mark.parametrize("config, flag", [
    ({"zero_optimization": {"stage": 3}}, "--zero_stage"),
    ({"train_micro_batch_size_per_gpu": 8}, "--per_device_train_batch_size"),
    ({"train_batch_size": 64}, r"--per_device_train_batch_size x --gradient_accumulation_steps x ranks"),
    ({"fp16": {"enabled": True}}, "--dtype"),
    ({"bf16": {"enabled": False}}, "--dtype"),
    ({"bfloat16": {"enabled": False}}, "--dtype"),
    ({"hybrid_engine": {"enabled": True}}, "step 3's --enable_hybrid_engine"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": "auto"}}}, "--learning_rate"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}, "--learning_rate"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}, "--lr_scheduler_type"),
])
def test_a_file_contradicting_the_flags_is_an_error_naming_the_file_and_flag(tmp_path, config, flag):
    path = _write(tmp_path, config)
    with pytest.raises(ValueError, match=flag) as error:
        apply_user_ds_config(get_train_ds_config(stage=2, micro_batch_size=4), path, FLAGS)
    assert path in str(error.value)


def test_hf_trainer_files_with_auto_optimizer_and_scheduler_are_taken_and_overrides_are_said(tmp_path, capsys):
    hf = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
          "bf16": {"enabled": "auto"}, "bfloat16": {"enabled": True}, "train_batch_size": "auto",
          "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
          "gradient_clipping": 0.5, "amp": {"enabled": "auto", "opt_level": "O1"}, "aio": {"block_size": "auto"}}
    merged = apply_user_ds_config(get_train_ds_config(stage=2, micro_batch_size=4), _write(tmp_path, hf), FLAGS)
    assert "optimizer" not in merged and "scheduler" not in merged, "dschat hands DeepSpeed its own"
    assert merged["zero_optimization"]["overlap_comm"] is True and merged["bf16"]["enabled"] is True
    assert merged["amp"] == {"opt_level": "O1"}, "no literal \"auto\" left in a block dschat did not write"
    out = capsys.readouterr().out
    assert "the 'optimizer' block's parameters are \"auto\"" in out
    assert "gradient_clipping = 0.5 (dschat's flags gave 1.0)" in out
    assert "zero_optimization.overlap_comm = True (dschat leaves it to DeepSpeed)" in out, "a key dschat leaves out"
    assert "amp.opt_level = 'O1' (dschat leaves it to DeepSpeed)" in out
    assert "reduce_bucket_size" not in out and "bf16" not in out and "aio" not in out, "\"auto\" changes nothing"
    assert "aio" not in merged, "a block of only \"auto\" adds nothing"


def test_the_optimizer_follows_the_files_optimizer_offload(tmp_path, distributed, monkeypatch):
    """DeepSpeed refuses a torch optimizer under ZeRO-Offload (and CPU Adam without it): the file decides."""
    picked = []

    def make_optimizer_and_stop(param_groups, lr, offload):
        picked.append(offload)
        raise _Stop

    monkeypatch.setattr(training_engine, "make_optimizer", make_optimizer_and_stop)
    path = _write(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    for extra in (["--deepspeed", path], ["--offload"]):
        with pytest.raises(_Stop):
            sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
                      "--zero_stage", "2", "--max_steps", "1", *extra, *SFT_FAST])
    assert picked == [True, True]
    off = _write(tmp_path, {"zero_optimization": {"offload_optimizer": {"device": "none"}}}, "off.json")
    with pytest.raises(_Stop):
        sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
                  "--max_steps", "1", "--offload", "--deepspeed_config", off, *SFT_FAST])
    assert picked[-1] is False


def test_steps_1_and_2_leave_the_hybrid_engine_block_to_step_3(tmp_path, distributed):
    path = _write(tmp_path, {"hybrid_engine": {"enabled": True, "max_out_tokens": 300}})
    args = step1_parser().parse_args(["--deepspeed", path])
    assert common.supervised_ds_config(args, "step1")["hybrid_engine"]["enabled"] is False


def test_notebook_dicts_take_the_old_names_and_a_config_dict():
    from dschat.rlhf.engine import step3_train_config

    args = step3_args({"per_device_train_batch_size": 8, "per_device_mini_train_batch_size": 4,
                       "generation_batch_numbers": 2, "deepspeed_config": {"gradient_clipping": 0.3}})
    assert (args.per_device_generation_batch_size, args.per_device_training_batch_size, args.generation_batches) \
        == (8, 4, 2)
    assert step3_train_config(args, 1, 0)["gradient_clipping"] == 0.3


def test_notebook_settings_mean_what_the_flags_mean():
    import argparse

    from dschat.errors import UsageError

    # DeepSpeed-Chat's switches: True sets their constant, False (an old namespace's default) leaves the value
    assert step3_args({"disable_actor_dropout": True}).actor_dropout == 0.0
    assert step3_args({"disable_actor_dropout": False}).actor_dropout == step3_args({}).actor_dropout
    old = argparse.Namespace(dtype="fp32", disable_actor_dropout=False, disable_critic_dropout=True, global_rank=0)
    settings = step3_args(old)
    assert (settings.actor_dropout, settings.critic_dropout, settings.dtype) == (None, 0.0, "fp32")
    assert step3_args({"no-enable_cuda_graph": True}).enable_cuda_graph is False
    assert step3_args({"no-enable_cuda_graph": False}).enable_cuda_graph is None  # auto, as without the flag
    assert step3_args({"enable_cuda_graph": True}).enable_cuda_graph is True
    # deepspeed.add_config_arguments leaves both names; the one that holds the file wins whatever the order
    ds_namespace = argparse.Namespace(deepspeed_config=None, deepscale_config="ds.json")
    assert step3_args(ds_namespace).deepspeed_config == "ds.json"
    converted = step3_args({"actor_zero_stage": "3", "kl_in_reward": "0", "ppo_epochs": "2"})  # as on the command line
    assert (converted.actor_zero_stage, converted.kl_in_reward, converted.ppo_epochs) == (3, 0, 2)

    class Settings:  # class attributes, as a config class is often written
        dtype = "fp32"
        max_prompt_seq_len = 48
        enable_hybrid_engine = True

    settings = step3_args(Settings())
    assert (settings.dtype, settings.max_prompt_seq_len, settings.enable_hybrid_engine) == ("fp32", 48, True)

    import dataclasses

    @dataclasses.dataclass(slots=True)
    class Slotted:
        dtype: str = "fp16"

    assert step3_args(Slotted()).dtype == "fp16"
    with pytest.raises(UsageError, match=r"unknown setting\(s\) \['actor_lr'\]"):
        step3_args({"actor_lr": 1e-3})  # a typo of actor_learning_rate is not a silent default
    with pytest.raises(UsageError, match="ppo_epochs: expected a positive integer"):
        step3_args({"ppo_epochs": 0})
    with pytest.raises(UsageError, match="dtype: 'fp8' is not one of"):
        step3_args({"dtype": "fp8"})
    # a fraction for a count was cut without a word (8.5 -> 8); a whole float is the number it is
    with pytest.raises(UsageError, match="max_answer_seq_len: expected a positive integer, got 8.5"):
        step3_args({"max_answer_seq_len": 8.5})
    with pytest.raises(UsageError, match=r"seed: expected a seed in \[0, 4294967295\], got 1.5"):
        step3_args({"seed": 1.5})
    assert step3_args({"max_answer_seq_len": 8.0}).max_answer_seq_len == 8
    assert type(step3_args({"seed": 2.0}).seed) is int
    # a command-line-like string has no attributes: every setting was silently the default
    with pytest.raises(UsageError, match="args is a str: give a dict"):
        step3_args("max_prompt_seq_len=16 enable_hybrid_engine=True")


def test_a_dict_giving_one_flag_other_values_under_two_names_is_an_error():
    """{"per_device_generation_batch_size": 4, "per_device_train_batch_size": 8} (dschat's name and DeepSpeed-Chat's)
    ran with 8 whatever the order, unsaid, where the command line refuses the flag given twice; it is now an error
    naming both. A name left at its default (a copy of vars(engine.args)) or given the same value still reads."""
    from dschat.errors import UsageError

    with pytest.raises(UsageError, match=r"per_device_generation_batch_size=4, per_device_train_batch_size=8: one "
                                         r"setting given other values under 2 of its names; give it once"):
        step3_args({"per_device_generation_batch_size": 4, "per_device_train_batch_size": 8})
    with pytest.raises(UsageError, match="actor_dropout=0.1, disable_actor_dropout=True: one setting"):
        step3_args({"actor_dropout": 0.1, "disable_actor_dropout": True})
    copied = {**vars(step3_args({})), "per_device_train_batch_size": 8}  # (its per_device_generation_batch_size: 16)
    assert step3_args(copied).per_device_generation_batch_size == 8
    assert step3_args({"actor_dropout": 0.0, "disable_actor_dropout": True}).actor_dropout == 0.0
    assert step3_args({"per_device_train_batch_size": None, "per_device_generation_batch_size": 4}) \
        .per_device_generation_batch_size == 4


def test_deepspeed_chats_step3_namespace_with_its_none_defaults_sets_up_a_run(distributed):
    """DeepSpeed-Chat's step-3 parser defaults --seed and --output_dir to None: its namespace given to
    DeepSpeedRLHFEngine kept them, and the engine's set-up failed in ``set_seed(None)`` with a TypeError."""
    import argparse

    from dschat.steps.common import setup_run

    ds_chat = argparse.Namespace(seed=None, output_dir=None, preprocessing_num_workers=None, actor_dropout=None,
                                 unsupervised_dataset_name=None, dtype="fp32", local_rank=-1, global_rank=0)
    settings = step3_args(ds_chat)
    assert (settings.seed, settings.output_dir) == (step3_args({}).seed, step3_args({}).output_dir)
    assert settings.actor_dropout is None and settings.unsupervised_dataset_name is None  # (None is their default)
    setup_run(settings)


def test_a_dict_of_a_completed_namespaces_settings_reads_as_they_do():
    """``{**vars(engine.args), "ppo_epochs": 2}``, a notebook's copy of the settings with one changed, was refused
    with "unknown setting(s) ['_data_files', '_dschat_complete', ...]": the attributes dschat keeps on a completed
    namespace. They are its bookkeeping, left out as they are when the namespace itself is given."""
    from dschat.args import step_settings
    from dschat.steps.common import take_data_files

    args = step3_args({"dtype": "fp32", "max_answer_seq_len": 12})
    take_data_files(args)  # (what a step keeps on its namespace once it reads the data)
    copied = step3_args({**vars(args), "ppo_epochs": 2})
    assert (copied.dtype, copied.max_answer_seq_len, copied.ppo_epochs) == ("fp32", 12, 2)
    sft_args = step_settings(step1_parser(), {"max_seq_len": 64})
    take_data_files(sft_args)
    assert step_settings(step1_parser(), {**vars(sft_args), "max_steps": 3}).max_seq_len == 64


def test_ptx_doubles_the_actors_accumulation_after_a_config_file_that_states_the_flags():
    from dschat.rlhf.engine import step3_train_config

    args = step3_args({"unsupervised_dataset_name": "jsonl:unsup.jsonl", "per_device_training_batch_size": 4,
                       "deepspeed_config": {"gradient_accumulation_steps": 1, "train_batch_size": "auto"}})
    actor, critic = step3_train_config(args, 1, 0), step3_train_config(args, 1, 0, role="critic")
    assert (actor["gradient_accumulation_steps"], actor["train_batch_size"]) == (2, 8)
    assert (critic["gradient_accumulation_steps"], critic["train_batch_size"]) == (1, 4)


def test_a_missing_or_malformed_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        apply_user_ds_config({}, str(tmp_path / "nope.json"), FLAGS)
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        apply_user_ds_config({}, _write(tmp_path, "{stage: 3", "bad.json"), FLAGS)
    with pytest.raises(ValueError, match="expected a JSON object"):
        apply_user_ds_config({}, _write(tmp_path, [1, 2], "list.json"), FLAGS)


def test_step3_file_reaches_actor_and_critic_and_its_hybrid_block_only_the_actor(tmp_path):
    from dschat.rlhf.engine import DeepSpeedRLHFEngine

    path = _write(tmp_path, {"gradient_clipping": 0.25,
                             "hybrid_engine": {"enabled": True, "enable_cuda_graph": False, "max_out_tokens": 300}})
    settings = step3_args({"deepspeed_config": path, "enable_hybrid_engine": True, "max_prompt_seq_len": 8,
                           "max_answer_seq_len": 8})
    engine = SimpleNamespace(args=settings, world_size=1)
    actor = DeepSpeedRLHFEngine._train_config(engine, 0, hybrid=True)
    critic = DeepSpeedRLHFEngine._train_config(engine, 0, role="critic")
    assert actor["gradient_clipping"] == critic["gradient_clipping"] == 0.25
    assert actor["hybrid_engine"]["max_out_tokens"] == 300 and critic["hybrid_engine"]["enabled"] is False
    settings.enable_hybrid_engine = False
    with pytest.raises(ValueError, match="--enable_hybrid_engine"):
        DeepSpeedRLHFEngine._train_config(engine, 0, hybrid=False)
    from dschat.rlhf.engine import check_step3_settings

    short = step3_args({"deepspeed_config": path, "enable_hybrid_engine": True, "max_prompt_seq_len": 256,
                        "max_answer_seq_len": 256})
    with pytest.raises(ValueError, match=r"max_out_tokens 300 .* generates, 512 .*prompt \+ answer must fit"):
        check_step3_settings(short, 1)  # before any model loads, not at the first generation
    # the held-out evaluation may generate longer answers than training: the engine's cache is sized for them
    longer_eval = step3_args({"enable_hybrid_engine": True, "max_prompt_seq_len": 8, "max_answer_seq_len": 8,
                              "eval_max_new_tokens": 12})
    assert DeepSpeedRLHFEngine._train_config(SimpleNamespace(args=longer_eval, world_size=1), 0,
                                             hybrid=True)["hybrid_engine"]["max_out_tokens"] == 20


def test_a_hybrid_engine_block_the_engine_cannot_read_fails_before_any_model_loads(tmp_path):
    """The block never reaches DeepSpeed: a typo'd option passed every check and failed once the actor had loaded,
    naming no file; a string value failed in a TypeError of a comparison (or, "false", switched the setting on)."""
    from dschat.errors import UsageError
    from dschat.rlhf.engine import check_step3_settings

    flags = {"enable_hybrid_engine": True, "max_prompt_seq_len": 8, "max_answer_seq_len": 8}
    for block, said in (({"release_cache": True}, r"unknown hybrid_engine option\(s\) \['release_cache'\]"),
                        ({"max_out_tokens": "64"}, r"hybrid_engine: max_out_tokens = '64' \(not int\)"),
                        ({"pin_parameters": "false"}, r"hybrid_engine: pin_parameters = 'false' \(not bool\)"),
                        # (a bool is no int here, though Python's bool is one: true would be read as 1 token)
                        ({"max_out_tokens": True}, r"hybrid_engine: max_out_tokens = True \(not int\)")):
        path = _write(tmp_path, {"hybrid_engine": block})
        with pytest.raises(UsageError, match=f"DeepSpeed config '.*ds_config.json': {said}"):
            check_step3_settings(step3_args({**flags, "deepspeed_config": path}), 1)
    check_step3_settings(step3_args({**flags, "deepspeed_config": _write(tmp_path, {"hybrid_engine": {
        "enabled": True, "max_out_tokens": 64, "inference_tp_size": 1, "release_inference_cache": False,
        "pin_parameters": True, "tp_gather_partition_size": 8}})}), 1)  # DeepSpeed-Chat's block as it writes it
    # a notebook's switches given as 1: the config dschat builds from them holds bools
    check_step3_settings(step3_args({**flags, "enable_hybrid_engine": 1, "release_inference_cache": 1}), 1)


class _Stop(Exception):
    pass


def test_sft_hands_deepspeed_the_merged_config(tmp_path, distributed, monkeypatch):
    """DeepSpeed itself runs with the file's value (not only dschat's dict)."""
    engines = []
    initialize = common.initialize_engine

    def initialize_and_stop(*args, **kwargs):
        engines.append(initialize(*args, **kwargs))
        raise _Stop

    monkeypatch.setattr(common, "initialize_engine", initialize_and_stop)
    path = _write(tmp_path, {"gradient_clipping": 0.125, "zero_optimization": {"stage": "auto"}})
    with pytest.raises(_Stop):
        sft.main(["--output_dir", str(tmp_path / "sft"), "--data_output_path", str(tmp_path / "data"),
                  "--max_steps", "1", "--deepspeed", path, *SFT_FAST])
    assert engines[0].gradient_clipping() == 0.125


def test_train_py_says_how_to_pass_step_flags_it_does_not_take(capsys):
    import runpy

    from launch import REPO

    train = runpy.run_path(str(REPO / "train.py"))  # its functions; __main__ does not run
    with pytest.raises(SystemExit):
        train["parse_args"](shlex.split("--actor_model_name_or_path facebook/opt-1.3b --per_device_train_batch_size 4 "
                                        "--deepspeed_config ds.json --no_such_flag"))
    err = capsys.readouterr().err
    assert "unrecognized arguments: --actor_model_name_or_path" in err and "--no_such_flag" in err
    assert "--actor_model_name_or_path: train.py's --actor-model" in err
    assert "--per_device_train_batch_size: a flag of step 1, 2, 3" in err and "--step3-args" in err
    assert "--no_such_flag:" not in err, "only the step scripts' flags get a hint"
    assert train["parse_args"](["--actor-model", "tiny-opt"]).actor_model == "tiny-opt"


def test_train_py_names_its_own_flag_a_step_spelling_meant(capsys):
    """train.py's flags are DeepSpeed-Chat's, spelled with "-", the steps' with "_": --actor_model (or a typo,
    --output-dri) was said to be unrecognized with no flag named, where a step's flag is told how to pass."""
    import runpy

    from launch import REPO

    train = runpy.run_path(str(REPO / "train.py"))
    for given, meant in (("--actor_model", "--actor-model"), ("--step3_args", "--step3-args"),
                         ("--deployment_type", "--deployment-type"), ("--output-dri", "--output-dir")):
        with pytest.raises(SystemExit):
            train["parse_args"]([given, "x"])
        assert f"unrecognized arguments: {given} x\n  {given}: did you mean {meant}?" in capsys.readouterr().err


def test_train_py_help_prints_its_example_commands_as_written(capsys):
    """The help's two-line deepspeed example lost its backslash and newline (a "\\" at a line's end inside the
    docstring joins the lines), printing one line with a run of spaces in it."""
    import runpy

    from launch import REPO

    with pytest.raises(SystemExit):
        runpy.run_path(str(REPO / "train.py"))["parse_args"](["--help"])
    out = capsys.readouterr().out
    assert "--reward-model Qwen/Qwen2.5-0.5B \\\n        --deployment-type single_node" in out


@pytest.mark.parametrize("parser", [step1_parser, step2_parser, step3_parser], ids=lambda p: p.__name__)
def test_step_scripts_refuse_abbreviated_flags(parser, capsys):
    # flags are forwarded between train.py and the steps: a prefix must not quietly become some whole flag
    with pytest.raises(SystemExit):
        parser().parse_args(["--zero_s", "3"])
    assert "unrecognized arguments: --zero_s 3" in capsys.readouterr().err
    assert parser().parse_args(["--zero_stage", "3"]).zero_stage == 3
    assert parser().parse_args(["--zero_stage=3"]).zero_stage == 3


def test_train_py_refuses_abbreviated_flags_its_own_and_inside_step_args(tmp_path, capsys, distributed):
    import runpy

    from dschat import pipeline
    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    for flags in ("--output x", "--actor-zero 3", "--recipe dpo --deployment single_gpu"):
        with pytest.raises(SystemExit):
            parse(shlex.split(flags))
        assert f"unrecognized arguments: {flags.split()[-2]}" in capsys.readouterr().err
    assert parse(["--output-dir", "x", "--actor-zero-stage=3"]).actor_zero_stage == 3
    args = parse(["--output-dir", str(tmp_path / "out"), "--step1-args", "--output_d elsewhere"])
    with pytest.raises(SystemExit):  # not the folder flag --output_dir, nor a run
        pipeline.run_pipeline(args)
    assert "train.py --step1-args: error: unrecognized arguments: --output_d elsewhere" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_train_py_refuses_its_own_flags_given_twice_rather_than_dropping_the_first(capsys):
    """argparse keeps a repeated flag's last values: ``--step 2 --step 3`` ran step 3 alone, and a second
    ``--step3-args`` string dropped the first's flags, unsaid."""
    import runpy

    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    for flags, said in (("--step 2 --step 3", "--step (2 times)"),
                        ("--step3-args --enable_ema --step3-args=--actor_lora_dim=4", "--step3-args (2 times)"),
                        ("--data-path tiny --output-dir a --data-path jsonl:x.jsonl", "--data-path (2 times)")):
        with pytest.raises(SystemExit):
            parse(shlex.split(flags))
        assert f"given more than once: {said}" in capsys.readouterr().err
    args = parse(shlex.split("--step 2 3 --step3-args '--max_steps 2 --max_steps 3' --local_rank=0"))
    assert args.step == [2, 3] and args.step3_args == "--max_steps 2 --max_steps 3"  # (step 3 refuses it: below)


def test_a_step_script_refuses_a_flag_given_twice_rather_than_keeping_the_last(capsys, monkeypatch):
    """argparse kept a repeated flag's last value: ``main.py --learning_rate 1e-4 ... --learning_rate 1e-3`` trained at
    1e-3, unsaid (two spellings of one setting too). A list from Python (a notebook's, a test's) keeps last-wins."""
    from dschat.args import step2_dpo_parser, step_settings
    from dschat.steps import ppo

    for main, flags, said in ((sft.main, "--learning_rate 1e-4 --dtype fp32 --learning_rate 1e-3",
                               "--learning_rate (2 times)"),
                              (ppo.main, "--actor_dropout 0.1 --disable_actor_dropout --max_steps=2 --max_steps 3",
                               "--actor_dropout / --disable_actor_dropout (2 times), --max_steps (2 times)")):
        monkeypatch.setattr("sys.argv", ["main.py", *shlex.split(flags)])
        with pytest.raises(SystemExit):
            main()
        assert f"error: given more than once: {said}; give each once" in capsys.readouterr().err
    for parser in (step1_parser, step2_parser, step2_dpo_parser, step3_parser):
        monkeypatch.setattr("sys.argv", ["main.py", "--seed", "1", "--seed", "1", "--local_rank=0"])
        with pytest.raises(SystemExit):
            parser().parse_args()  # (even with the same value)
        assert "given more than once: --seed (2 times)" in capsys.readouterr().err
        monkeypatch.setattr("sys.argv", ["main.py", "--seed", "1", "--local_rank=0"])
        assert parser().parse_args().seed == 1
        # a list from Python overrides by appending (README: "the list keeps the last value")
        assert step_settings(parser(), ["--seed", "1", "--seed", "2", "--local_rank=0"]).seed == 2


def test_merging_a_steps_flags_takes_values_that_are_not_strings():
    """A list from Python may hold a Path as a value: the merge took it for a flag (AttributeError on startswith)."""
    from pathlib import Path

    from dschat.args import repeated_flags, without_flags_given_in

    argv = ["--data_output_path", Path("cache"), "--seed", "1"]
    assert without_flags_given_in(step1_parser(), argv, ["--seed", "2"]) == ["--data_output_path", Path("cache")]
    assert repeated_flags(step1_parser(), [*argv, "--seed=2"]) == ["--seed (2 times)"]


@pytest.mark.parametrize("recipe", ["ppo", "grpo", "dpo"])
def test_train_py_gives_each_step_each_flag_once_its_step_args_replacing_its_own(recipe, tmp_path, capsys,
                                                                                  distributed):
    """train.py appended --stepN-args after its own flags for argparse's last to win; the command line it prints for
    each step ("==== step1: ..."), run as that step's script, is now refused for its repeats. A flag the --stepN-args
    give replaces train.py's (and the GRPO recipe's the tiny recipe's); a user's flag given twice inside them is
    refused before any step runs."""
    import runpy

    from dschat import pipeline
    from dschat.args import repeated_flags
    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    given = {1: "--learning_rate 1e-4 --data_split 2,4,4", 2: "--disable_dropout --learning_rate 1e-4",
             3: "--actor_learning_rate 1e-4 --disable_actor_dropout --per_device_train_batch_size 4"}
    for tiny, models in ((True, []), (False, ["--actor-model", "facebook/opt-1.3b"])):
        args = parse(["--recipe", recipe, *models, "--data-path", "tiny", "--data-fields", "prompt=q"])
        with_own = parse(["--recipe", recipe, *models, "--data-path", "tiny", "--data-fields", "prompt=q",
                          *(f"--step{step}-args={flags}" for step, flags in given.items())])
        for step in pipeline.recipe_steps(recipe, [1, 2, 3])[0]:
            parser = pipeline.step_parser(step, recipe)()
            for run in (args, with_own):
                argv = pipeline.step_argv(step, run, tiny)
                assert not repeated_flags(parser, argv), argv
            own = parser.parse_args(pipeline.step_argv(step, with_own, tiny))
            assert (own.learning_rate if step < 3 else own.actor_learning_rate) == 1e-4
            assert (own.dropout if step < 3 else own.actor_dropout) == (None if step == 1 else 0.0)
            assert own.data_path == ["tiny"] and own.data_fields == "prompt=q"
            if step == 3:
                assert own.per_device_generation_batch_size == 4  # (--per_device_train_batch_size: its old name)
            if step == 1:
                assert own.data_split == "2,4,4"
    args = parse(["--recipe", recipe, "--output-dir", str(tmp_path / "out"), "--step1-args", "--seed 1 --seed=2"])
    with pytest.raises(SystemExit):
        pipeline.run_pipeline(args)
    assert "train.py --step1-args: error: given more than once: --seed (2 times)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_train_py_refuses_a_data_path_without_a_dataset(capsys):
    """``--data-path $DATA`` with DATA unset ran every step on the default data (the hub's Dahoas/rm-static for real
    models), unsaid; the step scripts' --data_path refuses it."""
    import runpy

    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    with pytest.raises(SystemExit):
        parse(["--data-path", "--output-dir", "out"])
    assert "argument --data-path: expected at least one argument" in capsys.readouterr().err
    assert parse(["--data-path", "tiny", "jsonl:x.jsonl"]).data_path == ["tiny", "jsonl:x.jsonl"]
    assert parse([]).data_path is None


def test_train_py_says_a_zero_stage_flag_no_step_of_the_run_reads(capsys):
    """``--step 1 --reward-zero-stage 3`` (no reward model trains) and ``--step 2 --actor-zero-stage 3`` (no actor)
    dropped the flag unsaid, while a --stepN-args of a step not run is said."""
    import runpy

    from dschat import pipeline
    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    for flags, said in (("--step 1 --reward-zero-stage 3 --actor-zero-stage 2",
                         "--reward-zero-stage 3 (step 2's reward model and step 3's critic): ignored, no step this "
                         "run runs reads it (--step 1)"),
                        ("--step 2 --actor-zero-stage 3", "--actor-zero-stage 3 (steps 1 and 3's actor): ignored")):
        args = parse(shlex.split(flags))
        pipeline.say_left_out_steps(args, args.step, [])
        out = capsys.readouterr().out
        assert said in out and out.count("ignored") == 1
    for flags in ("--step 1 --actor-zero-stage 3", "--step 2 --reward-zero-stage 3", "--step 1 3 --reward-zero-stage 3",
                  "--recipe dpo --step 2 --actor-zero-stage 3", "--step 1"):
        args = parse(shlex.split(flags))
        pipeline.say_left_out_steps(args, args.step, [])
        assert "ignored" not in capsys.readouterr().out, flags


def test_train_py_names_one_table_for_its_hints_and_folder_checks(capsys):
    import runpy

    from dschat import pipeline
    from launch import REPO

    for dest, train_py_flag in pipeline.FOLDER_DESTS.items():
        assert pipeline.TRAIN_PY_NAMES[f"--{dest}"] == train_py_flag
    with pytest.raises(SystemExit):
        runpy.run_path(str(REPO / "train.py"))["parse_args"](["--model_name_or_path", "x"])
    assert "--model_name_or_path: train.py's --actor-model / --reward-model" in capsys.readouterr().err


def test_train_py_refuses_steps_its_recipe_does_not_have(capsys):
    import runpy

    from dschat import pipeline
    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    for flags, missing in (("--recipe grpo --step 2", "no step 2"), ("--recipe dpo --step 3", "no step 3")):
        with pytest.raises(SystemExit):  # not a run of nothing that reprints the last run's report
            parse(shlex.split(flags))
        assert f"nothing to run; the recipe has {missing}" in capsys.readouterr().err
    assert parse(shlex.split("--recipe grpo --step 2 3")).step == [2, 3]  # step 3 runs (noted at run time)
    grpo_step3 = pipeline.step_argv(3, parse(["--recipe", "grpo"]), True)
    assert "--critic_model_name_or_path" not in grpo_step3  # no critic: its record names no step-2 folder
    assert "--critic_learning_rate" not in grpo_step3  # (the PPO recipe's, which no critic would read)
    assert "--critic_learning_rate" in pipeline.step_argv(3, parse([]), True)
    assert "--critic_model_name_or_path" in pipeline.step_argv(3, parse([]), True)
    assert pipeline.recipe_steps("grpo", [3, 2, 1]) == ([1, 3], ["step 2 (GRPO is rewarded by --reward_fn, or by a "
                                                                 "trained --reward-model)"])


def test_train_py_turns_dropout_off_and_gives_hub_models_deepspeed_chats_script_flags():
    """As DeepSpeed-Chat's train.py (its training scripts): no dropout in the reward model, DPO and the PPO actor (and
    critic); weight decay 0.1 in step 2 and DPO and the hybrid engine in step 3 for hub models; --stepN-args win."""
    import runpy

    from dschat import pipeline
    from dschat.args import step2_dpo_parser
    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    hub = ["--actor-model", "facebook/opt-1.3b", "--reward-model", "facebook/opt-350m"]

    def parsed(step, flags, parser, tiny):
        return parser().parse_args(pipeline.step_argv(step, parse(flags), tiny))

    for tiny, flags in ((True, []), (False, hub)):
        assert parsed(1, flags, step1_parser, tiny).dropout is None  # step 1 keeps the model's own, as there
        step2 = parsed(2, flags, step2_parser, tiny)
        step3 = parsed(3, flags, step3_parser, tiny)
        assert (step2.dropout, step3.actor_dropout, step3.critic_dropout) == (0.0, 0.0, 0.0)
        assert step3.enable_hybrid_engine  # (the tiny recipe's, the hub recipe's)
        assert step2.weight_decay == (0.0 if tiny else 0.1)  # (the tiny recipe keeps its tuned settings)
        dpo = parsed(2, flags + ["--recipe", "dpo"], step2_dpo_parser, tiny)
        assert (dpo.dropout, dpo.weight_decay) == (0.0, 0.0 if tiny else 0.1)
        grpo = parsed(3, flags + ["--recipe", "grpo"], step3_parser, tiny)
        assert grpo.actor_dropout == 0.0 and grpo.enable_hybrid_engine
    chosen = parsed(3, hub + ["--step3-args", "--actor_dropout 0.1 --no-enable_hybrid_engine"], step3_parser, False)
    assert chosen.actor_dropout == 0.1 and not chosen.enable_hybrid_engine
    assert parsed(2, hub + ["--step2-args", "--weight_decay 0"], step2_parser, False).weight_decay == 0.0


def test_train_py_checks_each_steps_config_file_before_the_first_step_and_zero_stage_reaches_step3(
        tmp_path, distributed):
    import runpy

    from dschat import pipeline
    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    stage3 = _write(tmp_path, {"zero_optimization": {"stage": 3}})
    args = parse(["--output-dir", str(tmp_path / "out"), "--step2-args", f"--deepspeed {stage3}"])
    with pytest.raises(ValueError, match="zero_optimization.stage = 3.*set it with --reward-zero-stage"):
        pipeline.check_step_args([1, 2, 3], args, True, {1: step1_parser, 2: step2_parser, 3: step3_parser})
    missing = parse(["--step3-args", "--deepspeed_config /no/such.json"])
    with pytest.raises(FileNotFoundError, match="/no/such.json"):
        pipeline.check_step_args([3], missing, True, {3: step3_parser})

    both = parse(["--step3-args", "--zero_stage 2"])
    settings = step3_args(step3_parser().parse_args(pipeline.step_argv(3, both, True)))
    assert (settings.actor_zero_stage, settings.critic_zero_stage) == (2, 2)
    plain = step3_args(step3_parser().parse_args(pipeline.step_argv(3, parse(["--actor-zero-stage", "2"]), True)))
    assert (plain.actor_zero_stage, plain.critic_zero_stage) == (2, 0)
    # TensorBoard events go under the run's folder (the steps' own default is the working directory), unless given
    assert plain.tensorboard_path == os.path.join(os.path.dirname(plain.output_dir), "tensorboard")
    for step, step_parser in ((1, step1_parser), (2, step2_parser)):
        assert step_parser().parse_args(pipeline.step_argv(step, args, True)).tensorboard_path == \
            str(tmp_path / "out" / "tensorboard")
    given = parse(["--step3-args", "--tensorboard_path tb_elsewhere"])
    assert step3_parser().parse_args(pipeline.step_argv(3, given, True)).tensorboard_path == "tb_elsewhere"


def test_older_dropout_flags_and_the_eot_token_flag():
    assert step1_parser().parse_args(["--disable_dropout"]).dropout == 0.0
    assert step2_parser().parse_args([]).dropout is None
    args = step3_parser().parse_args(["--disable_actor_dropout", "--disable_critic_dropout"])
    assert (args.actor_dropout, args.critic_dropout) == (0.0, 0.0)
    assert step3_parser().parse_args(["--eot_token", "<eot>"]).eot_token == "<eot>"


def test_add_eot_token_adds_the_named_token_to_a_tokenizer_without_eos(tmp_path):
    from dschat.models.loading import load_tokenizer
    from dschat.tiny import load_tiny_tokenizer

    tokenizer = load_tiny_tokenizer()
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="--add_eot_token"):
        load_tokenizer(str(tmp_path))
    assert load_tokenizer(str(tmp_path), add_eot_token=True, eot_token="<|eot|>").eos_token == "<|eot|>"


def test_train_py_takes_deepspeed_chat_model_sizes_and_an_empty_zero_stage():
    import runpy

    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    args = parse(["--actor-model", "1.3b", "--reward-model", "350m", "--actor-zero-stage", "",
                  "--deployment-type", "single_node"])
    assert (args.actor_model, args.reward_model) == ("facebook/opt-1.3b", "facebook/opt-350m")
    assert args.actor_zero_stage == 3, "'' is the deployment's default"
    assert parse(["--actor-model", "Qwen/Qwen2.5-0.5B"]).actor_model == "Qwen/Qwen2.5-0.5B"
    with pytest.raises(SystemExit):
        parse(["--reward-zero-stage", "4"])


def test_every_step_flag_says_what_it_does_in_help():
    """A user reads --help: every flag of every step has a help text (DeepSpeed-Chat's own flags included)."""
    import argparse

    from dschat import args

    for name in ("step1_parser", "step2_parser", "step2_dpo_parser", "step3_parser"):
        parser = getattr(args, name)()
        silent = [action.option_strings[0] for action in parser._actions
                  if action.option_strings and not action.help and not isinstance(action, argparse._HelpAction)]
        assert not silent, (name, silent)


def test_every_train_py_flag_says_what_it_does_in_help(capsys):
    """train.py --help listed --deployment-type and --output-dir with no word of what they do or where the run's files
    go (DeepSpeed-Chat's train.py says both)."""
    import runpy

    from launch import REPO

    with pytest.raises(SystemExit):
        runpy.run_path(str(REPO / "train.py"))["parse_args"](["--help"])
    options = capsys.readouterr().out.split("options:")[1]
    flags = re.split(r"\n  (?=-)", options)[1:]  # one entry per flag: its names, then (after spaces) its help
    silent = [flag.split()[0] for flag in flags if len(re.split(r"\s{2,}", flag.strip(), maxsplit=1)) < 2]
    assert not silent, silent
    assert "default: ./output" in " ".join(options.split())
    # --data-path's default was said to be "the steps'" (--data_path tiny), where real models train on DeepSpeed-Chat's
    from dschat.pipeline import DEEPSPEED_CHAT_DATA

    def help_of(name):  # (argparse wraps lines at hyphens too: "tiny-\n llama")
        return " ".join(next(flag for flag in flags if flag.startswith(name)).split()).replace("- ", "-")

    assert f"else DeepSpeed-Chat's {DEEPSPEED_CHAT_DATA}" in help_of("--data-path")
    assert "--stepN-args replaces it" in help_of("--data-path") and "default: tiny-llama" in help_of("--actor-model")


def test_reward_model_takes_deepspeed_chats_arguments_in_its_order():
    """DeepSpeed-Chat's ``RewardModel(base_model, tokenizer, num_padding_at_beginning=0, compute_fp32_loss=False)``:
    dschat's took ``compute_fp32_loss`` second, so a call ported from it passed the tokenizer as that flag (true: the
    head computed in fp32 unasked)."""
    from transformers import AutoModel, OPTConfig

    from dschat import RewardModel
    from dschat.tiny import load_tiny_tokenizer

    def backbone():
        return AutoModel.from_config(OPTConfig(vocab_size=96, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                               num_attention_heads=2, word_embed_proj_dim=16))

    tokenizer = load_tiny_tokenizer()
    ported = RewardModel(backbone(), tokenizer, 1)
    assert ported.compute_fp32_loss is False and ported.num_padding_at_beginning == 1
    assert RewardModel(backbone(), tokenizer, 1, True).compute_fp32_loss is True


def test_a_reward_model_built_on_a_causal_lm_is_refused_naming_the_backbone_to_give():
    """``RewardModel(AutoModelForCausalLM.from_pretrained(step1_output), tokenizer)``: the LM head's logits reached the
    value head, and the first forward failed with "mat1 and mat2 shapes cannot be multiplied"."""
    from transformers import AutoModelForCausalLM, OPTConfig

    from dschat import RewardModel
    from dschat.errors import UsageError

    policy = AutoModelForCausalLM.from_config(OPTConfig(vocab_size=96, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                                        num_attention_heads=2, word_embed_proj_dim=16))
    with pytest.raises(UsageError, match="base_model is a OPTForCausalLM, a model with an LM head.*AutoModel"):
        RewardModel(policy, None)
    assert RewardModel(policy.base_model).rwtransformer is policy.base_model  # (its backbone, as the error says)


def test_a_reward_model_called_without_an_attention_mask_says_it_needs_one():
    """DeepSpeed-Chat's ``RewardModel.forward`` takes ``attention_mask=None`` (it finds each end by the pad id);
    dschat's failed with "'NoneType' object has no attribute 'shape'" once the backbone had run."""
    import torch
    from transformers import AutoModel, OPTConfig

    from dschat import RewardModel

    model = RewardModel(AutoModel.from_config(OPTConfig(vocab_size=96, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                                        num_attention_heads=2, word_embed_proj_dim=16)))
    ids = torch.tensor([[5, 6, 7], [5, 8, 9]])
    with pytest.raises(ValueError, match="finds by the attention_mask: give it"):
        model(ids, None)
    with pytest.raises(ValueError, match="finds by the attention_mask"):
        model.end_scores(ids, None)
    assert model(ids, torch.ones_like(ids))["chosen_mean_scores"].shape == (1,)


def test_trainer_kl_ctl_takes_deepspeed_chats_float_and_says_where_it_would_not_apply():
    """DeepSpeed-Chat's trainer.kl_ctl is the coefficient, a float: assigned here it failed in compute_rewards with
    "'float' object has no attribute 'value'"; it is now the fixed controller of that coefficient."""
    import torch

    from dschat.errors import UsageError
    from dschat.rlhf import algorithms as algo
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    def trainer(**settings):
        made = DeepSpeedPPOTrainer.__new__(DeepSpeedPPOTrainer)  # (no engine: compute_rewards reads no model)
        made.args, made.clip_reward_value = step3_args(settings), 5.0
        made.kl_ctl = algo.get_kl_controller("adaptive" if made.args.adaptive_kl else "fixed", made.args.kl_ctl,
                                             made.args.kl_target, made.args.kl_horizon)
        return made

    ppo = trainer()
    ppo.kl_ctl = 0.05
    assert isinstance(ppo.kl_ctl, algo.FixedKLController) and ppo.kl_ctl.value == 0.05
    log_probs, ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    score, mask = torch.tensor([1.0]), torch.ones(1, 2)
    torch.testing.assert_close(ppo.compute_rewards(None, log_probs, ref, score, mask),
                               algo.kl_penalized_rewards(log_probs, ref, score, mask, 0.05, 5.0, "k1"))
    ppo.kl_ctl = algo.FixedKLController(0.2)  # (a controller stays one)
    assert ppo.kl_ctl.value == 0.2
    with pytest.raises(TypeError, match=r"trainer.kl_ctl = '0.1': expected the KL coefficient \(a float"):
        ppo.kl_ctl = "0.1"
    with pytest.raises(UsageError, match=r"must be a non-negative number"):
        ppo.kl_ctl = -0.1
    with pytest.raises(UsageError, match=r"KL controller is not a fixed one \(AdaptiveKLController: --adaptive_kl "
                                         r"changes its coefficient each iteration\); set trainer.kl_ctl.value = 0.05 "
                                         r"to go on adapting .*\.FixedKLController\(0.05\) to hold it fixed"):
        trainer(adaptive_kl=True).kl_ctl = 0.05
    with pytest.raises(UsageError, match=r"does not use: the KL is a loss term weighted by trainer.args.kl_loss_coef"):
        trainer(advantage_estimator="grpo", n_samples_per_prompt=2).kl_ctl = 0.05


def test_a_kl_coefficient_assigned_to_the_trainer_is_the_runs_kl_ctl_its_checkpoints_record():
    """trainer.kl_ctl = 0.05 (DeepSpeed-Chat's float) made the reward's coefficient 0.05 while trainer.args.kl_ctl
    stayed 0.1: a checkpoint recorded --kl_ctl 0.1 beside the 0.05 it trained with, and a resume with 0.1 dropped the
    0.05 unsaid. The coefficient is args' kl_ctl now, as the other settings assigned are."""
    from dschat.rlhf import algorithms as algo
    from dschat.rlhf.checkpointing import resume_flags
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer

    trainer = DeepSpeedPPOTrainer.__new__(DeepSpeedPPOTrainer)  # (no engine: the setter reads args alone)
    trainer.args = step3_args({})
    trainer.critic_model = None
    trainer.kl_ctl = algo.FixedKLController(trainer.args.kl_ctl)
    trainer.kl_ctl = 0.05
    assert trainer.kl_ctl.value == trainer.args.kl_ctl == resume_flags(trainer)["kl_ctl"] == 0.05


def test_train_py_field_names_go_with_its_data_path_not_a_steps_own(capsys):
    """train.py's --data-fields were given to a step whose --stepN-args gave its own --data_path (and no
    --data_fields): the names of --data-path's columns renamed columns of other files, unsaid. They go with the files
    they were given for, as ppo_eval's run defaults do; a step's own --data_fields still wins, and a step that reads
    --data-path keeps them."""
    import runpy

    from dschat import pipeline
    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    args = parse(["--data-path", "jsonl:a.jsonl", "--data-fields", "prompt=q",
                  "--step1-args", "--data_path=jsonl:own.jsonl", "--step2-args", "--data_path jsonl:b.jsonl "
                  "--data_fields prompt=question"])
    flags = {step: pipeline.step_parser(step, "ppo")().parse_args(pipeline.step_argv(step, args, True))
             for step in (1, 2, 3)}
    assert (flags[1].data_path, flags[1].data_fields) == (["jsonl:own.jsonl"], "")
    assert (flags[2].data_path, flags[2].data_fields) == (["jsonl:b.jsonl"], "prompt=question")
    assert (flags[3].data_path, flags[3].data_fields) == (["jsonl:a.jsonl"], "prompt=q")
    pipeline.say_left_out_steps(args, [1, 2, 3], [])
    out = capsys.readouterr().out
    assert "--data-fields prompt=q: not given to step 1, whose --step1-args give its own --data_path" in out
    assert "step 2" not in out and "step 3" not in out
    # a step's own --data_path of --data-path's files (some of them) reads them with their field names
    args = parse(["--data-path", "jsonl:a.jsonl", "jsonl:b.jsonl", "--data-fields", "prompt=q",
                  "--step1-args", "--data_path jsonl:b.jsonl"])
    assert pipeline.step_parser(1, "ppo")().parse_args(pipeline.step_argv(1, args, True)).data_fields == "prompt=q"


@pytest.mark.parametrize("recipe", ["ppo", "grpo", "dpo"])
def test_train_py_says_steps_that_split_the_same_data_differently(recipe, capsys):
    """A --data_split (or --seed) in one step's --stepN-args split --data-path for that step alone: its phase's share
    of its own split may hold records another step trained on (the shares of one split are apart), unsaid."""
    import runpy

    from dschat import pipeline
    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    steps = pipeline.recipe_steps(recipe, [1, 2, 3])[0]
    later = steps[-1]

    def flags(argv, tiny):
        args = parse(["--recipe", recipe, *argv])
        return {step: pipeline.step_parser(step, recipe)().parse_args(pipeline.step_argv(step, args, tiny))
                for step in steps}

    for tiny, models in ((True, []), (False, ["--actor-model", "facebook/opt-1.3b", "--data-path", "jsonl:a.jsonl"])):
        pipeline.say_splits_that_differ(flags(models, tiny))
        assert "split --data_path" not in capsys.readouterr().out  # (the recipes give every step the same)
        pipeline.say_splits_that_differ(flags([*models, "--step1-args", "--data_split 6,2,2"], tiny))
        out = capsys.readouterr().out
        assert f"note: steps 1 and {later} split --data_path" in out and "step 1: --data_split 6,2,2" in out
    pipeline.say_splits_that_differ(flags([f"--step{later}-args", "--seed 7"], True))
    assert f"step {later}: --data_split 4,4,2 --seed 7" in capsys.readouterr().out
    # a step reading its own files shares none of them
    pipeline.say_splits_that_differ(flags(["--step1-args", "--data_split 6,2,2 --data_path jsonl:own.jsonl"], True))
    assert "split --data_path" not in capsys.readouterr().out


def test_train_py_grpo_refuses_step3_args_that_would_read_a_step2_folder(tmp_path, monkeypatch, distributed):
    """--recipe grpo has no step 2 and gives step 3 no critic folder: --step3-args "--advantage_estimator gae" (or a
    --reward_model_weight without --reward-model) had step 3 start its critic from output/step2_rm of the working
    directory, an earlier PPO run's there, unsaid. Refused before step 1 trains."""
    import runpy

    from dschat import pipeline
    from dschat.errors import UsageError
    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    monkeypatch.chdir(tmp_path)
    stale = tmp_path / "output" / "step2_rm"  # (an earlier run's folder where step 3's default points)
    stale.mkdir(parents=True)
    for given, said in (("--advantage_estimator gae", "--advantage_estimator gae trains a critic"),
                        ("--reward_model_weight 1", "--reward_model_weight 1.0 scores with a reward model")):
        args = parse(["--recipe", "grpo", "--output-dir", str(tmp_path / "out"), "--step3-args", given])
        with pytest.raises(UsageError, match=f"--recipe grpo --step3-args: {said}, which step 3 would start from "
                                             "output/step2_rm"):
            pipeline.run_pipeline(args)
        assert not (tmp_path / "out").exists()
    flags = pipeline.step_parser(3, "ppo")().parse_args(pipeline.step_argv(3, parse(["--step3-args", "--advantage_"
                                                                                     "estimator gae"]), True))
    pipeline.check_grpo_reads_no_step2_folder(flags, parse([]))  # (PPO's critic is step 2's, of this run)


# --- DeepSpeed-Chat's step-3 loop on a critic-free engine -----------------------------------------------------------

class MiniDataset:
    """DeepSpeed-Chat's utils/data/data_utils.py MiniDataset (its step-3 loop's slicing of each experience into
    training micro-batches), as it is there."""

    def __init__(self, max_size, small_batch_size):
        self.dataset, self.max_size, self.small_batch_size = [], max_size, small_batch_size

    def seperate(self):
        small_dataset = []
        for large_batch in self.dataset:
            if type(large_batch) == list or type(large_batch) == tuple:  # noqa: E721
                large_size = len(large_batch[0])
            elif type(large_batch) == dict:  # noqa: E721
                large_size = len(large_batch[list(large_batch.keys())[0]])
            else:
                large_size = len(large_batch)
            for i in range(0, large_size, self.small_batch_size):
                if type(large_batch) == list or type(large_batch) == tuple:  # noqa: E721
                    small_dataset.append([x[i:i + self.small_batch_size] for x in large_batch])
                elif type(large_batch) == dict:  # noqa: E721
                    small_dataset.append({k: v[i:i + self.small_batch_size] for k, v in large_batch.items()})
                else:
                    small_dataset.append(large_batch[i:i + self.small_batch_size])
        self.dataset = []
        return small_dataset

    def add(self, data):
        self.dataset.append(data)
        return self.seperate() if len(self.dataset) == self.max_size else None


GRPO_NOTEBOOK = {"actor_model_name_or_path": "tiny-llama", "dtype": "fp32", "max_prompt_seq_len": 40,
                 "max_answer_seq_len": 8, "per_device_training_batch_size": 2, "num_warmup_steps": 0, "max_steps": 1,
                 "advantage_estimator": "grpo", "n_samples_per_prompt": 2, "reward_model_weight": 0,
                 "reward_fn": lambda prompts, answers: [float(len(a)) for a in answers]}


@pytest.fixture(scope="module")
def grpo_engine(distributed):
    """A critic-free (GRPO) engine on the embedded tiny Llama, no hybrid engine (seconds on a CPU)."""
    from dschat import DeepSpeedRLHFEngine

    with DeepSpeedRLHFEngine(args=GRPO_NOTEBOOK) as engine:
        yield engine


def _grpo_prompts(engine):
    return engine.tokenizer(["\n\nHuman: Say hi.\n\nAssistant:", "\n\nHuman: List three colors.\n\nAssistant:"],
                            return_tensors="pt", padding=True)


def test_deepspeed_chats_minidataset_slices_a_critic_free_experience(grpo_engine):
    """With GRPO/RLOO/REINFORCE++ (no critic) generate_experience returned out["value"] = None, and DeepSpeed-Chat's
    loop, MiniDataset(...).add(out), failed with "TypeError: 'NoneType' object is not subscriptable". Without a critic
    the key is left out: every value slices, and train_rlhf trains on each slice."""
    import math

    from dschat import DeepSpeedPPOTrainer

    trainer = DeepSpeedPPOTrainer(engine=grpo_engine)
    out = trainer.generate_experience(_grpo_prompts(grpo_engine))
    slices = MiniDataset(1, 2).add(out)
    assert "value" not in out and out["input_ids"].shape[0] == 4
    assert [s["input_ids"].shape[0] for s in slices] == [2, 2]
    for mini in slices:
        assert set(mini) == set(out)
        losses = trainer.train_rlhf(mini)
        assert all(math.isfinite(float(loss)) for loss in losses)


def test_deepspeed_chats_trainer_attributes_are_the_settings_the_run_reads(grpo_engine):
    """DeepSpeed-Chat's trainer says its kl_ctl, clip_reward_value, cliprange, cliprange_value, gamma and lam "can be
    changed", and sets max_answer_seq_len from args. Here they were copies of args made in __init__: assigning
    trainer.max_answer_seq_len changed nothing (generation read args), trainer.args.cliprange = 0.1 changed nothing the
    loss read (it read the copy), and REINFORCE++ read args.gamma where GAE read trainer.gamma. They are args' settings
    now, checked as the flags are; the engine's own args stay as it was built."""
    from dschat import DeepSpeedPPOTrainer
    from dschat.errors import UsageError

    trainer = DeepSpeedPPOTrainer(engine=grpo_engine)
    prompts = _grpo_prompts(grpo_engine)
    assert trainer.generate_experience(prompts)["action_mask"].sum(1).max() > 3  # (the premise: longer answers)
    trainer.max_answer_seq_len = 3
    assert trainer.generate_experience(prompts)["action_mask"].sum(1).max() <= 3
    assert trainer.args.max_answer_seq_len == 3 and grpo_engine.args.max_answer_seq_len == 8
    for name, value in (("clip_reward_value", 2.0), ("cliprange", 0.1), ("cliprange_value", 0.3), ("gamma", 0.9),
                        ("lam", 0.5)):
        setattr(trainer, name, value)
        assert getattr(trainer.args, name) == value and getattr(grpo_engine.args, name) != value, name
        setattr(trainer.args, name, 0.25)
        assert getattr(trainer, name) == 0.25, name
    with pytest.raises(UsageError, match=r"trainer.gamma = 1.5: gamma: expected a number in \[0, 1\]"):
        trainer.gamma = 1.5
    with pytest.raises(UsageError, match=r"trainer.cliprange = -0.2: .*expected a number > 0"):
        trainer.cliprange = -0.2
    with pytest.raises(UsageError, match=r"trainer.max_answer_seq_len = 9: .* would be 49, longer than the 48 the "
                                         r"engine's models were checked and sized for"):
        trainer.max_answer_seq_len = 9
    trainer.max_answer_seq_len = 8.0  # (as the flag takes it: an integer)
    assert trainer.max_answer_seq_len == 8 and type(trainer.max_answer_seq_len) is int
    assert DeepSpeedPPOTrainer(engine=grpo_engine).cliprange == 0.2  # (a new trainer: the engine's settings)


def test_deepspeed_chats_checkpointing_toggle_on_an_actor_without_the_hybrid_engine_warns_not(grpo_engine):
    """DeepSpeed-Chat's loop calls rlhf_engine.actor.gradient_checkpointing_enable() (and _disable). The hybrid engine
    takes the call; without it the DeepSpeed engine forwarded it to transformers' deprecated name (a FutureWarning
    each call; gone in transformers 6). The actor's engine takes it now, as the hybrid engine does, and DeepSpeed's
    class is left as it is."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from dschat.compat import disable_activation_checkpointing

    actor = grpo_engine.actor
    assert type(actor) is DeepSpeedEngine  # (the premise: no hybrid engine)
    try:
        check_checkpointing_toggle(actor)
    finally:
        disable_activation_checkpointing(actor.module)  # (the module's engine serves the file's other tests)
    assert "gradient_checkpointing_enable" not in vars(DeepSpeedEngine)


def test_a_trainers_settings_are_its_own_args_and_the_engines_are_read_only(grpo_engine):
    """A trainer built without args read its engine's args until its first change of a setting copied them: a later
    engine.args.ppo_epochs = 2 no longer reached it, one before did. Now each trainer copies the engine's args when it
    is built and reads its own, and engine.args (what the engine was built with) refuses writes, before and after a
    trainer's change alike, saying where the setting is changed."""
    from dschat import DeepSpeedPPOTrainer
    from dschat.errors import UsageError

    def refused(name, value, said):
        with pytest.raises(UsageError, match=rf"engine.args.{name} = {value!r}: an engine's args are the settings it "
                                             rf"was built with, read-only .*; {said}"):
            setattr(grpo_engine.args, name, value)
        assert getattr(grpo_engine.args, name) != value

    on_trainer = r"set it on the trainer, whose settings are its own args \(trainer.args.ppo_epochs = 2\)"
    refused("ppo_epochs", 2, on_trainer)  # (no trainer changed yet)
    trainer, other = DeepSpeedPPOTrainer(engine=grpo_engine), DeepSpeedPPOTrainer(grpo_engine, grpo_engine.args)
    assert trainer.args is not grpo_engine.args and vars(trainer.args) == vars(grpo_engine.args)
    refused("ppo_epochs", 2, on_trainer)  # (a trainer built, none of its settings changed)
    trainer.args.ppo_epochs = 2  # either order of an attribute's change and args' reaches the trainer alone
    trainer.cliprange = 0.1
    trainer.args.lam = 0.5
    assert (trainer.args.ppo_epochs, trainer.cliprange, trainer.args.cliprange, trainer.lam) == (2, 0.1, 0.1, 0.5)
    refused("ppo_epochs", 2, on_trainer)  # (after a trainer's change: the same)
    refused("actor_learning_rate", 1e-3, "build a new DeepSpeedRLHFEngine with actor_learning_rate")
    with pytest.raises(UsageError, match="del engine.args.lam: .*read-only"):
        del grpo_engine.args.lam
    assert (other.args.ppo_epochs, other.cliprange, other.lam) == (1, 0.2, 0.95)  # (another trainer: its own)
    assert (grpo_engine.args.ppo_epochs, grpo_engine.args.cliprange) == (1, 0.2)
    assert DeepSpeedPPOTrainer(engine=grpo_engine).cliprange == 0.2


def test_an_engines_list_settings_change_through_neither_a_trainer_nor_the_args_it_was_built_from(grpo_engine):
    """engine.args refused assignments but shared its list values (--data_path, --sft_only_data_path) with a
    trainer's copy of them and with the namespace it was built from: trainer.args.data_path.append(...) changed
    engine.args.data_path, and so every trainer built on the engine after. Each copy holds lists of its own now."""
    from dschat import DeepSpeedPPOTrainer
    from dschat.rlhf.engine import BuiltArgs

    built = list(grpo_engine.args.data_path)
    trainer = DeepSpeedPPOTrainer(engine=grpo_engine)
    trainer.args.data_path.append("jsonl:other.jsonl")
    trainer.args.sft_only_data_path.append("jsonl:sft.jsonl")
    assert grpo_engine.args.data_path == built and grpo_engine.args.sft_only_data_path == []
    assert DeepSpeedPPOTrainer(engine=grpo_engine).args.data_path == built
    given = step3_args({"data_path": ["jsonl:a.jsonl"]})
    engine_args = BuiltArgs.of(given)
    given.data_path.append("jsonl:b.jsonl")
    assert engine_args.data_path == ["jsonl:a.jsonl"]


def test_a_trainer_built_after_a_resume_takes_the_learning_rates_the_engine_runs_at(grpo_engine, monkeypatch):
    """load_checkpoint sets the learning rates DeepSpeed restored on the trainer's args (the namespace given, where it
    is step 3's), and a second DeepSpeedPPOTrainer(engine, those args) was refused: its actor_learning_rate differed
    from the engine's as built, though the engine's optimizer runs at it; one built without args took the built rate,
    which its checkpoints recorded. The restored rates are the engine's now: a trainer given them, or the rates the
    engine was built with, or no args, takes them; another rate is refused, naming the one the engine runs at."""
    from dschat import DeepSpeedPPOTrainer
    from dschat.errors import UsageError
    from dschat.utils.checkpoints import take_restored_flags

    monkeypatch.setattr(grpo_engine, "restored_settings", {})  # (the module's engine: as built, after this test)
    built = grpo_engine.args.actor_learning_rate
    args = step3_args(GRPO_NOTEBOOK)
    first = DeepSpeedPPOTrainer(grpo_engine, args)
    restored = {"actor_learning_rate": built * 3}
    take_restored_flags({"restored": dict(restored)}, first.args)  # (load_checkpoint's, on a checkpoint of 3x)
    first.took_restored_flags(restored)
    assert args.actor_learning_rate == built * 3 and grpo_engine.args.actor_learning_rate == built
    second = DeepSpeedPPOTrainer(grpo_engine, args)
    assert second.generate_experience(_grpo_prompts(grpo_engine))["action_mask"].shape[0] == 4
    assert DeepSpeedPPOTrainer(engine=grpo_engine).args.actor_learning_rate == built * 3
    assert DeepSpeedPPOTrainer(grpo_engine, GRPO_NOTEBOOK).args.actor_learning_rate == built * 3
    with pytest.raises(UsageError, match=rf"actor_learning_rate 1.0 \(the engine's: {built * 3!r}"):
        DeepSpeedPPOTrainer(grpo_engine, {**GRPO_NOTEBOOK, "actor_learning_rate": 1.0})


def test_a_setting_the_engine_was_built_with_changed_on_the_trainers_args_is_an_error_not_ignored(grpo_engine,
                                                                                                   monkeypatch):
    """trainer.args.actor_learning_rate = 1.0 (or gradient_accumulation_steps, a longer max_answer_seq_len) after the
    trainer was built changed nothing: the engine's optimizers, accumulation and models were built, and the run went
    on with them, its checkpoints recording the new value. Generating or training now says so; set back, it runs; a
    checkpoint's restored learning rate (load_checkpoint) stands for the engine's."""
    from dschat import DeepSpeedPPOTrainer
    from dschat.errors import UsageError

    trainer = DeepSpeedPPOTrainer(engine=grpo_engine)
    out = trainer.generate_experience(_grpo_prompts(grpo_engine))
    built = trainer.args.actor_learning_rate
    trainer.args.actor_learning_rate = 1.0
    for call in (lambda: trainer.generate_experience(_grpo_prompts(grpo_engine)), lambda: trainer.train_rlhf(out),
                 lambda: trainer.train_rollout([out])):
        with pytest.raises(UsageError, match=rf"trainer.args were changed after the trainer was built in settings the "
                                             rf"engine's .* actor_learning_rate 1.0 \(the engine's: {built!r}\)"):
            call()
    monkeypatch.setattr(grpo_engine, "restored_settings", {})  # (the module's engine: as built, after this test)
    trainer.took_restored_flags({"actor_learning_rate": 1.0})  # (a checkpoint's, which DeepSpeed restored)
    trainer.generate_experience(_grpo_prompts(grpo_engine))
    trainer.args.actor_learning_rate = built  # (set back: the engine's is no longer what it trains with)
    with pytest.raises(UsageError, match=r"actor_learning_rate .* \(the engine's: 1.0\)"):
        trainer.train_rollout([out])
    trainer.args.actor_learning_rate = 1.0
    trainer.args.max_answer_seq_len = 100
    with pytest.raises(UsageError, match=r"--max_prompt_seq_len \+ the longer of .* 140 \(the engine's: 48"):
        trainer.generate_experience(_grpo_prompts(grpo_engine))
    trainer.args.max_answer_seq_len = 4  # (shorter: the trainer's to choose)
    assert trainer.generate_experience(_grpo_prompts(grpo_engine))["action_mask"].shape[1] <= 4


def test_deepspeed_chats_trainer_attributes_of_the_engines_build_are_read_not_assigned(grpo_engine):
    """DeepSpeed-Chat's trainer also has z3_enabled, compute_fp32_loss and end_of_conversation_token_id. Here the
    last two were missing (AttributeError), and z3_enabled was a plain copy: assigned, HF's generate synced the ranks,
    or not, apart from how the actor was sharded. They read as there; assigned, an error says what to do."""
    from dschat import DeepSpeedPPOTrainer
    from dschat.errors import UsageError

    trainer = DeepSpeedPPOTrainer(engine=grpo_engine)
    assert trainer.z3_enabled is False and trainer.compute_fp32_loss is False
    assert trainer.end_of_conversation_token_id == grpo_engine.tokenizer.eos_token_id
    for attribute, flag in (("z3_enabled", "actor_zero_stage"), ("compute_fp32_loss", "compute_fp32_loss")):
        with pytest.raises(UsageError, match=rf"trainer.{attribute} = True: the engine's models were built with "
                                             rf"{flag} .*build a DeepSpeedRLHFEngine with another {flag}"):
            setattr(trainer, attribute, True)
        assert getattr(trainer, attribute) is False
    with pytest.raises(UsageError, match=r"trainer.end_of_conversation_token_id = 5: the answers end at "
                                         r"trainer.eos_token_id .*: set that"):
        trainer.end_of_conversation_token_id = 5


def test_a_notebook_loop_stepping_past_the_engines_schedule_is_said_once(grpo_engine, monkeypatch, capsys):
    """num_total_iters counts optimizer steps, not PPO iterations (the README's notebook sizes it by
    len(prompt_dataloader): one step per iteration there). A loop that took more steps (ppo_epochs 2 on the trainer's
    args, as the README shows, or smaller training batches) ran past the schedule's end, where transformers' cosine
    schedule rises again to the full learning rate, unsaid. The trainer says it once, with the count to give."""
    from dschat import DeepSpeedPPOTrainer
    from dschat.rlhf.config import optimizer_steps_per_iteration

    trainer = DeepSpeedPPOTrainer(engine=grpo_engine)
    out = trainer.generate_experience(_grpo_prompts(grpo_engine))
    assert out["input_ids"].shape[0] == 2 * trainer.args.per_device_training_batch_size  # (2 steps a rollout)
    taken = grpo_engine.actor.lr_scheduler.last_epoch
    for total in ("num_total_iters", "actor_total_iters"):  # (the module's engine: as built, after this test)
        monkeypatch.setattr(grpo_engine, total, taken + 2)
    trainer.train_rollout([out])  # to the schedule's end
    assert "learning-rate schedule" not in capsys.readouterr().out
    trainer.train_rollout([out])  # past it
    said = capsys.readouterr().out
    assert (f"the actor has taken {taken + 3} optimizer steps, past the {taken + 2} its learning-rate schedule "
            "(cosine) spans (the engine's num_total_iters): from here the rate rises again towards the full rate. "
            "num_total_iters counts optimizer steps, not PPO iterations: give your loop's PPO iterations x "
            f"{optimizer_steps_per_iteration(trainer.args)} per train_rollout here") in said
    assert grpo_engine.actor.get_lr()[0] > 0  # (the premise: the cosine schedule's rate past its end, 0 at it)
    trainer.train_rollout([out])
    assert "learning-rate schedule" not in capsys.readouterr().out  # (once)


def test_a_notebooks_dict_gives_the_optimizer_steps_of_an_iteration():
    """The engine built without num_total_iters says to size it with optimizer_steps_per_iteration(args), and the
    README's args is a dict: it failed on it ("'dict' object has no attribute 'ppo_epochs'"). It takes every form of
    args the engine takes now."""
    from dschat.rlhf.config import optimizer_steps_per_iteration

    settings = {"per_device_generation_batch_size": 4, "per_device_training_batch_size": 2, "ppo_epochs": 2}
    assert optimizer_steps_per_iteration(settings) == 4 == optimizer_steps_per_iteration(step3_args(settings))
    assert optimizer_steps_per_iteration(SimpleNamespace(**settings)) == 4


@pytest.mark.parametrize("scheduler_type, said", [("linear", "stays at its end, 0 or near it"), ("constant", None),
                                                  ("constant_with_warmup", None)])
def test_the_schedule_end_notice_says_what_each_schedule_does_past_its_end(scheduler_type, said):
    from dschat.rlhf.trainer import schedule_ended_notice, steps_past_schedule

    scheduler = SimpleNamespace(last_epoch=5)
    assert steps_past_schedule(scheduler, 5, scheduler_type) is None  # (at its end)
    taken = steps_past_schedule(scheduler, 4, scheduler_type)
    if said is None:
        assert taken is None
    else:
        assert taken == 5 and said in schedule_ended_notice("critic", taken, 4, scheduler_type, "num_total_iters", 1)


def test_a_flag_typed_with_a_pasted_dash_names_the_flag_it_spells(capsys):
    """A command line pasted from a web page or word processor has "–recipe" (an en dash) for "--recipe": argparse
    takes it for a value and said only "unrecognized arguments"; the error names the flag it spells (or may mean)."""
    import runpy

    from launch import REPO

    from dschat.args import step1_parser

    train = runpy.run_path(str(REPO / "train.py"))
    for parse, given, meant in ((train["parse_args"], "\u2013recipe", "--recipe"),
                                (step1_parser().parse_args, "\u2014learning_rate", "--learning_rate"),
                                (step1_parser().parse_args, "\u2013learning-rate", "--learning_rate")):
        with pytest.raises(SystemExit) as stopped:
            parse([given, "1"])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and f"{given}: begins with a typographic dash, not '--'; did you mean {meant}?" \
            in err, err



def test_a_step_flag_typed_with_a_pasted_dash_says_what_the_flag_is(capsys):
    """A flag the parser lacks typed with a pasted dash was said to be unrecognized and no more, where typed with "--"
    it is told what it is: train.py's ``–entropy_coef`` (step 3's, and how to pass it), step 1's ``–print_answers``
    (step 3's)."""
    import runpy

    from launch import REPO

    from dschat.args import step1_parser

    train = runpy.run_path(str(REPO / "train.py"))
    typed = "begins with a typographic dash, not '--'"
    for parse, given, said in (
            (train["parse_args"], "\u2013entropy_coef", "--entropy_coef: a flag of step 3; give it to train.py inside "
                                                        "--step3-args"),
            (train["parse_args"], "\u2013entropy_coeff", "--entropy_coeff: did you mean --entropy_coef (a flag of "
                                                         "step 3: give it to train.py inside --step3-args)?"),
            (step1_parser().parse_args, "\u2014print_answers", "--print_answers: a flag of step 3 "
                                                               "(training/step3_ppo/main.py)")):
        with pytest.raises(SystemExit) as stopped:
            parse([given, "1"])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and f"unrecognized arguments: {given} 1\n  {given}: {typed}; {said}" in err, err

def test_the_local_rank_that_torch_distributed_launch_appends_is_taken(capsys):
    """torch.distributed.launch (torch 2) appends --local-rank=N to each rank's command line, deepspeed's launcher
    --local_rank=N: the steps, train.py and ppo_eval refused the first as an unrecognized argument; chat.py, rw_eval
    and prompt_eval both (``deepspeed chat.py --path X`` stopped at once)."""
    import runpy

    from launch import REPO

    from dschat.args import step1_parser, step3_parser
    from dschat.tools import chat, ppo_eval, prompt_eval, rw_eval

    train = runpy.run_path(str(REPO / "train.py"))
    tools = ((chat.build_parser, ["--path", "x"]), (ppo_eval.build_parser, ["--policy", "x"]),
             (rw_eval.build_parser, ["--model_name_or_path", "x"]),
             (prompt_eval.build_parser, ["--model_name_or_path_baseline", "x", "--model_name_or_path_finetune", "y"]))
    for parse, given in ((step1_parser().parse_args, []), (step3_parser().parse_args, []),
                         (train["parse_args"], []), *((build().parse_args, given) for build, given in tools)):
        for spelling in ("--local-rank=1", "--local_rank=1", "--local_rank=0"):
            assert parse([*given, spelling]).local_rank == int(spelling[-1])
    for build, _ in tools:  # (the launcher's, not the user's: --help leaves it out, as train.py's)
        assert "--local" not in build().format_help()


def test_train_py_names_the_dpo_step_for_a_dpo_flag(capsys):
    """train.py --beta 0.1 (DPO's flag) was told only "unrecognized arguments": the hint for a step's flag knew steps
    1-3 only; it says the --stepN-args that passes it."""
    import runpy

    from launch import REPO

    train = runpy.run_path(str(REPO / "train.py"))
    with pytest.raises(SystemExit):
        train["parse_args"](["--beta", "0.1"])
    assert "unrecognized arguments: --beta 0.1\n  --beta: a flag of step 2; give it to train.py inside --step2-args " \
        "with --recipe dpo" in capsys.readouterr().err
