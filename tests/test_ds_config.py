"""DeepSpeed configs built by dschat: the bf16 overflow scan (host time on every step) is off unless asked, and
DeepSpeed's own config model reads dschat's setting; ZeRO-3's fetch unit (``--zero3_fetch``)."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from deepspeed.runtime.precision_config import get_bfloat16_config

from dschat.args import step1_parser, step3_parser
from dschat.errors import UsageError
from dschat.rlhf.config import step3_args
from dschat.utils.ds_config import get_train_ds_config
from tests.launch import run_deepspeed


def test_bf16_overflow_scan_is_off_unless_asked_and_deepspeed_reads_it():
    assert get_bfloat16_config(get_train_ds_config(dtype="bf16")).check_grad_overflow is False
    assert get_bfloat16_config(get_train_ds_config(dtype="bf16", check_grad_overflow=True)).check_grad_overflow
    assert "check_grad_overflow" not in get_train_ds_config(dtype="fp16")["fp16"], "fp16 always checks"
    assert "bf16" not in get_train_ds_config(dtype="fp32")


def test_check_grad_overflow_flag_reaches_the_step_configs():
    assert step1_parser().parse_args(["--check_grad_overflow"]).check_grad_overflow
    args = step3_parser().parse_args(["--actor_model_name_or_path", "a", "--critic_model_name_or_path", "c"])
    assert args.check_grad_overflow is False

    from dschat.rlhf.engine import DeepSpeedRLHFEngine

    for flag in (False, True):
        settings = step3_args({"actor_model_name_or_path": "a", "critic_model_name_or_path": "c",
                               "check_grad_overflow": flag})
        config = DeepSpeedRLHFEngine._train_config(SimpleNamespace(args=settings, world_size=1), 2)
        assert config["bf16"]["check_grad_overflow"] is flag


def test_frozen_copies_are_sharded_only_where_zero3_splits_or_offloads_something():
    from dschat.rlhf.engine import DeepSpeedRLHFEngine
    from dschat.utils.ds_config import frozen_copy_stage

    assert frozen_copy_stage(3, world_size=2) == 3
    assert frozen_copy_stage(3, world_size=1) == 0, "one rank: ZeRO-3 would split nothing"
    assert frozen_copy_stage(3, world_size=1, offload=True) == 3, "parameter offload needs ZeRO-3"
    assert frozen_copy_stage(2, world_size=8) == 0 and frozen_copy_stage(2, world_size=1, offload=True) == 0

    settings = step3_args({"actor_model_name_or_path": "a", "critic_model_name_or_path": "c"})
    for world, offload, stage in ((1, False, 0), (2, False, 3), (1, True, 3)):
        engine = SimpleNamespace(args=settings, world_size=world)
        config = DeepSpeedRLHFEngine._eval_config(engine, 3, offload)
        assert config["zero_optimization"]["stage"] == stage, (world, offload)
        assert config["zero_optimization"]["offload_param"]["device"] == ("cpu" if offload else "none")
    unsharded = DeepSpeedRLHFEngine._eval_config(SimpleNamespace(args=settings, world_size=4), 2, True)
    assert unsharded["zero_optimization"]["offload_param"]["device"] == "none", "offload needs ZeRO-3: not asked of it"


def _nan_gradient_step(stage, check_grad_overflow):
    """One bf16 step of a tiny model whose gradient turns NaN while its loss stays finite; returns the weights'
    finiteness after ``optimizer_step`` (or the error it raised)."""
    import deepspeed
    import torch

    from dschat.utils.optim import optimizer_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    model[0].weight.register_hook(lambda grad: torch.full_like(grad, float("nan")))
    config = get_train_ds_config(dtype="bf16", stage=stage, check_grad_overflow=check_grad_overflow)
    config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=list(model.parameters()))
    loss = engine(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).mean()
    assert torch.isfinite(loss)
    engine.backward(loss)
    try:
        optimizer_step(engine, "tiny")
    except FloatingPointError as error:
        return error
    return all(torch.isfinite(p.float()).all() for p in engine.module.parameters())


def test_a_step_that_applied_nan_gradients_raises_and_a_skipped_one_is_reported(distributed, capsys):
    error = _nan_gradient_step(stage=2, check_grad_overflow=False)
    assert isinstance(error, FloatingPointError) and "check_grad_overflow" in str(error)
    capsys.readouterr()
    assert _nan_gradient_step(stage=2, check_grad_overflow=True) is True, "DeepSpeed skipped it: weights finite"
    assert "[tiny] optimizer step skipped by DeepSpeed" in capsys.readouterr().out
    assert _nan_gradient_step(stage=0, check_grad_overflow=False) is True, "ZeRO-0 always scans"
    assert _nan_gradient_step(stage=3, check_grad_overflow=False) is True, "ZeRO-3 checks the norm"


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])
def test_zero3_fetch_layer_marks_each_decoder_layer_of_any_family_and_only_under_zero3(family, distributed):
    import peft
    from deepspeed.utils import get_z3_leaf_modules

    from dschat.models.reward_model import RewardModel
    from dschat.models.training_engine import prepare_zero3_hooks
    from tests.scripts.hybrid_common import tiny_model

    blocks = {"llama": "LlamaDecoderLayer", "opt": "OPTDecoderLayer", "gpt2": "GPT2Block"}[family]
    for wrap in (lambda m: m, lambda m: RewardModel(m.base_model, num_padding_at_beginning=0),
                 lambda m: peft.get_peft_model(m, peft.LoraConfig(r=2, target_modules="all-linear"))):
        model = wrap(tiny_model(family, num_layers=3))
        prepare_zero3_hooks(model, {"zero_optimization": {"stage": 2}}, "layer")
        assert get_z3_leaf_modules(model) == [], "ZeRO-0..2 have no parameter hooks to change"
        prepare_zero3_hooks(model, {"zero_optimization": {"stage": 3}}, "module")
        assert get_z3_leaf_modules(model) == []
        prepare_zero3_hooks(model, {"zero_optimization": {"stage": 3}}, "layer")
        assert [type(m).__name__ for m in get_z3_leaf_modules(model)] == [blocks] * 3
    with pytest.raises(ValueError, match="--zero3_fetch"):
        prepare_zero3_hooks(model, {"zero_optimization": {"stage": 3}}, "block")


def test_zero3_unit_input_requires_grad_only_when_its_backward_needs_it(distributed):
    from deepspeed.utils import z3_leaf_module

    from dschat.models.layers import decoder_layer_list, mark_zero3_leaf_layers
    from tests.scripts.hybrid_common import tiny_model

    model = tiny_model("llama", num_layers=2)
    assert mark_zero3_leaf_layers(model) == 2 and mark_zero3_leaf_layers(model) == 2
    layer = decoder_layer_list(model)[1][0]
    assert z3_leaf_module(layer) and len(layer._forward_pre_hooks) == 1, "marked once, however often called"
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(args[0].requires_grad))
    hidden = torch.randn(1, 3, 64)
    model.requires_grad_(False)
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(True)  # only this layer trains (like LoRA)
    model(inputs_embeds=hidden)
    with torch.no_grad():
        model(inputs_embeds=hidden)
    assert seen == [True, False] and not hidden.requires_grad, "a detached copy, in grad mode only"
    with pytest.raises(RuntimeError, match="--zero3_fetch module"):
        layer(hidden_states=hidden, position_embeddings=None, attention_mask=None)


def test_zero3_layer_units_only_where_the_largest_module_list_is_the_decoder_stack(distributed):
    from dschat.models.layers import mark_zero3_leaf_layers
    from tests.scripts.hybrid_common import tiny_model

    model = tiny_model("opt", num_layers=3)
    model.config.num_hidden_layers = 4  # the largest ModuleList is not the config's stack
    assert mark_zero3_leaf_layers(model) == 0
    model.config.num_hidden_layers, model.config.layerdrop = 3, 0.1  # OPT's layer drop skips units at random
    assert mark_zero3_leaf_layers(model) == 0
    model.config.layerdrop = 0.0
    assert mark_zero3_leaf_layers(model) == 3
    heads = torch.nn.Module()
    heads.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Conv1d(4, 4, 1)])
    assert mark_zero3_leaf_layers(heads) == 0, "mixed classes"


def test_ranks_gathering_submodule_by_submodule_refused_only_where_a_family_calls_others_by_length():
    """RecurrentGemma's one-token prompt reads conv_1d's weight where a longer one calls conv_1d: ZeRO-3 gathering
    submodule by submodule on several ranks would gather other weights (tests/scripts/hybrid_zero3_recurrent.py).
    Refused there only: not on one rank, not with whole layers as units, not for a family whose calls do not vary."""
    from dschat.models.layers import check_ranks_gather_alike, mark_zero3_leaf_layers
    from tests.helpers import tiny_recurrent_gemma_actor
    from tests.scripts.hybrid_common import tiny_model

    model = tiny_recurrent_gemma_actor()
    with pytest.raises(UsageError, match="conv_1d.*--zero3_fetch layer.*pin_parameters true"):
        check_ranks_gather_alike(model, 2)
    check_ranks_gather_alike(model, 1)
    check_ranks_gather_alike(tiny_model("llama"), 2)
    assert mark_zero3_leaf_layers(model) == 2
    check_ranks_gather_alike(model, 2)


def test_a_refusal_of_ranks_gathering_otherwise_is_told_by_its_run_and_the_model():
    """``refuse_ranks_gathering_otherwise`` took 7 arguments, three of them the wording of its three callers' runs; it
    takes the run (a ``GatheringRun``: the hybrid engine unpinned, HF generate, training or scoring), the family, the
    ranks, the --zero3_fetch given and the model's name. Each run's message, word for word as it was."""
    from dschat.models.layers import (HF_GENERATION, TRAINING_OR_SCORING, UNPINNED_GENERATION,
                                      refuse_ranks_gathering_otherwise)

    def said(*args):
        with pytest.raises(UsageError) as refused:
            refuse_ranks_gathering_otherwise(*args)
        return str(refused.value)

    gemma = ("each forward gathering the actor's (recurrent_gemma) weights submodule by submodule (--zero3_fetch "
             "module), and a prompt of one token takes its recurrent blocks' decode path, which reads conv_1d's weight "
             "without calling conv_1d, where a longer prompt calls it: ranks generating from prompts of other lengths "
             "would gather other weights (a hang). Use --zero3_fetch layer (the default: each decoder layer gathered "
             "whole, whatever it calls inside)")
    assert said(UNPINNED_GENERATION, "recurrent_gemma", 2) == (
        "the hybrid engine generating without pinned parameters (--unpin_actor_parameters, or "
        "hybrid_engine.pin_parameters false) under ZeRO-3 on 2 ranks, " + gemma + ", or keep the actor's parameters "
        "pinned (no --unpin_actor_parameters: hybrid_engine.pin_parameters true)")
    assert said(HF_GENERATION, "recurrent_gemma", 2) == \
        "HF generate (--no-enable_hybrid_engine) under ZeRO-3 on 2 ranks, " + gemma
    assert said(TRAINING_OR_SCORING, "deepseek_v4", 3, "layer", "--model_name_or_path's") == (
        "a model trained or scored under ZeRO-3 on 3 ranks, each forward gathering --model_name_or_path's "
        "(deepseek_v4) weights submodule by submodule (its decoder layers could not be made --zero3_fetch layer "
        "units: mixed or miscounted blocks, or layerdrop), and its compressed attention calls its compressors' norms "
        "only in a forward that fills a window of tokens (4 and 128 by default), which a longer prompt or batch "
        "fills first: ranks forwarding batches of other widths (each rank pads its own) would gather other weights "
        "(a hang). Run it at ZeRO stage 2 or below, or on one rank")
    refuse_ranks_gathering_otherwise(HF_GENERATION, "recurrent_gemma", 1)  # (one rank: nothing to differ)
    refuse_ranks_gathering_otherwise(TRAINING_OR_SCORING, "llama", 2)  # (its calls do not vary)


def test_a_deepseek_v4_engine_gathering_submodule_by_submodule_on_several_ranks_is_refused_in_every_step(monkeypatch):
    """DeepSeek-V4 calls its compressors' norms only in a forward that fills a compression window: trained under ZeRO-3
    fetched submodule by submodule on 2 CPU ranks, batches 3 and 20 tokens wide, gloo aborted in the first forward
    (whole layers: trained). Only its generation on several ranks was refused (step 3's HF generate); now every
    ZeRO-3 engine of it, trained or frozen, in any step (``prepare_zero3_hooks``). Not with whole layers as units,
    not at ZeRO-2, not on one rank, not for RecurrentGemma (whose calls vary at a one-token prompt only)."""
    from dschat.models.training_engine import prepare_zero3_hooks
    from dschat.utils import dist
    from tests.helpers import tiny_deepseek_v4_actor, tiny_recurrent_gemma_actor

    zero3 = {"zero_optimization": {"stage": 3}}
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    model = tiny_deepseek_v4_actor()
    with pytest.raises(UsageError, match=r"^a model trained or scored under ZeRO-3 on 2 ranks, each forward gathering "
                                         r"its \(deepseek_v4\) weights submodule by submodule.*compressors' norms.*"
                                         r"batches of other widths.*Use --zero3_fetch layer"):
        prepare_zero3_hooks(model, zero3, "module")
    prepare_zero3_hooks(model, {"zero_optimization": {"stage": 2}}, "module")
    prepare_zero3_hooks(tiny_recurrent_gemma_actor(), zero3, "module")
    prepare_zero3_hooks(model, zero3, "layer")  # (its decoder layers made whole units)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    prepare_zero3_hooks(tiny_deepseek_v4_actor(), zero3, "module")


def test_a_deepseek_v4_engine_whose_layers_could_not_be_made_units_is_refused_by_what_happened(monkeypatch):
    """Under --zero3_fetch layer a model whose decoder layers cannot be made fetch units (here: layerdrop) gathers
    submodule by submodule all the same; its refusal said "(--zero3_fetch module)" and "Use --zero3_fetch layer",
    which the user had given. It says the layers were not made units, and a way out that exists."""
    from dschat.models.training_engine import prepare_zero3_hooks
    from dschat.utils import dist
    from tests.helpers import tiny_deepseek_v4_actor

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    model = tiny_deepseek_v4_actor()
    model.config.layerdrop = 0.1  # (a layer skipped at random never fires DeepSpeed's hooks: no units)
    with pytest.raises(UsageError) as refused:
        prepare_zero3_hooks(model, {"zero_optimization": {"stage": 3}}, "layer")
    said = str(refused.value)
    assert "submodule by submodule (its decoder layers could not be made --zero3_fetch layer units: mixed or " \
           "miscounted blocks, or layerdrop)" in said and said.endswith("Run it at ZeRO stage 2 or below, or on one rank")
    assert "--zero3_fetch module" not in said and "Use --zero3_fetch layer" not in said


def test_the_hybrid_engines_refusal_says_layers_given_could_not_be_made_units(monkeypatch):
    """The hybrid engine's own check (``build_inference_weights`` -> ``check_ranks_gather_alike``, unpinned ZeRO-3 on
    several ranks) did not know the --zero3_fetch given: a RecurrentGemma actor whose layers --zero3_fetch layer
    could not make units (layerdrop) was told "(--zero3_fetch module)" and "Use --zero3_fetch layer". The flag is
    kept on the model its engine was prepared from (``prepare_zero3_hooks``), and the refusal says what happened."""
    from dschat.hybrid_engine import weights
    from dschat.hybrid_engine.config import HybridEngineConfig
    from dschat.models.training_engine import prepare_zero3_hooks
    from dschat.utils import dist
    from tests.helpers import tiny_recurrent_gemma_actor

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(weights, "get_world_size", lambda: 2)
    unpinned = HybridEngineConfig(enabled=True, pin_parameters=False)
    model = tiny_recurrent_gemma_actor()
    model.config.layerdrop = 0.1  # (a layer skipped at random never fires DeepSpeed's hooks: no units)
    prepare_zero3_hooks(model, {"zero_optimization": {"stage": 3}}, "layer")  # (its calls vary at one token only)
    with pytest.raises(UsageError) as refused:
        weights.build_inference_weights(model, unpinned, 3, torch.device("cpu"))
    said = str(refused.value)
    assert said.startswith("the hybrid engine generating without pinned parameters") and "(recurrent_gemma)" in said
    assert "submodule by submodule (its decoder layers could not be made --zero3_fetch layer units: mixed or " \
           "miscounted blocks, or layerdrop)" in said and "Run it at ZeRO stage 2 or below, or on one rank" in said
    assert "--zero3_fetch module" not in said and "Use --zero3_fetch layer" not in said
    model = tiny_recurrent_gemma_actor()  # (given module: that is what it says)
    prepare_zero3_hooks(model, {"zero_optimization": {"stage": 3}}, "module")
    with pytest.raises(UsageError, match=r"submodule by submodule \(--zero3_fetch module\).*Use --zero3_fetch layer"):
        weights.build_inference_weights(model, unpinned, 3, torch.device("cpu"))


def test_zero3_fetch_flag_defaults_to_layer_in_every_step():
    assert step1_parser().parse_args([]).zero3_fetch == "layer"
    assert step1_parser().parse_args(["--zero3_fetch", "module"]).zero3_fetch == "module"
    assert step3_args({"actor_model_name_or_path": "a", "critic_model_name_or_path": "c"}).zero3_fetch == "layer"


@pytest.mark.multirank
def test_zero3_layer_and_module_fetch_train_like_zero2_on_two_ranks():
    proc = run_deepspeed(Path(__file__).parent / "scripts" / "zero3_fetch.py", timeout=600)
    cases = ("llama full checkpointing=True", "opt full checkpointing=True", "gpt2 full checkpointing=True",
             "llama lora checkpointing=False", "opt lora checkpointing=True", "llama critic_lora checkpointing=False")
    for rank in (0, 1):
        for case in cases:
            assert f"rank {rank} {case}: layer == module == ZeRO-2" in proc.stdout
        assert f"rank {rank} ALL OK" in proc.stdout


def test_mixed_precision_lora_quantizes_only_the_actors_frozen_weights_and_says_what_it_needs():
    from deepspeed.accelerator import get_accelerator

    from dschat.rlhf.engine import check_step3_settings, step3_train_config

    ready = {"enable_mixed_precision_lora": True, "actor_lora_dim": 8, "actor_zero_stage": 3, "critic_zero_stage": 3, "dtype": "fp16"}
    args = step3_args(ready)
    actor = step3_train_config(args, 1, 3)
    assert actor["zero_optimization"]["zero_quantized_nontrainable_weights"] is True
    critic = step3_train_config(args, 1, 3, role="critic")
    assert "zero_quantized_nontrainable_weights" not in critic["zero_optimization"]
    devices = get_accelerator().device_count()
    spread = step3_train_config(args, devices + 1, 3)["zero_optimization"]
    assert spread["zero_hpz_partition_size"] == devices, "ranks beyond one node's devices: hierarchical partitions"
    default = step3_train_config(step3_args({"actor_zero_stage": 3}), 1, 3)["zero_optimization"]
    assert "zero_quantized_nontrainable_weights" not in default, "off by default"
    for key, value, flag in (("actor_lora_dim", 0, "--actor_lora_dim > 0"),
                             ("actor_zero_stage", 2, "--actor_zero_stage 3"), ("dtype", "bf16", "--dtype fp16")):
        with pytest.raises(ValueError, match=flag):
            check_step3_settings(step3_args({**ready, key: value}), 1)


def test_mixed_precision_lora_on_an_accelerator_without_deepspeeds_quantizer_is_an_error_naming_the_flag(monkeypatch):
    # the CPU accelerator builds no quantizer op: the flag ended in DeepSpeed's "This op had not been implemented on
    # CPU backend." traceback from inside the actor's load, after the data and the tokenizer had loaded
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.cpu.no_impl import NotImplementedBuilder

    from dschat.rlhf.engine import check_step3_settings

    accelerator = get_accelerator()
    own = accelerator.get_op_builder
    monkeypatch.setattr(accelerator, "get_op_builder",
                        lambda name: NotImplementedBuilder if name == "QuantizerBuilder" else own(name))
    ready = {"enable_mixed_precision_lora": True, "actor_lora_dim": 8, "actor_zero_stage": 3, "critic_zero_stage": 3,
             "dtype": "fp16", "actor_model_name_or_path": "tiny-llama"}
    with pytest.raises(ValueError, match="--enable_mixed_precision_lora: DeepSpeed's .* accelerator has no quantizer"):
        check_step3_settings(step3_args(ready), 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run it on the device machine")
def test_mixed_precision_lora_trains_and_saves_the_merged_actor_on_the_gpu(tmp_path):
    """``tests/scripts/mixed_precision_lora_gpu.py`` in a process of its own (a world of one): step 3 with int8 frozen
    weights, then its saved actor loaded with ``from_pretrained`` against the trained weights, LoRA merged."""
    import os
    import subprocess
    import sys

    script = Path(__file__).parent / "scripts" / "mixed_precision_lora_gpu.py"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"


def test_a_config_files_bfloat16_block_is_read_as_bf16():
    # DeepSpeed reads "bf16" first: beside dschat's own "bf16" block, the file's old-named one was ignored
    from deepspeed.runtime.precision_config import get_bfloat16_config

    from dschat.utils.ds_config import apply_user_ds_config, get_train_ds_config, owned_key_flags

    merged = apply_user_ds_config(get_train_ds_config(dtype="bf16", stage=2),
                                  {"bfloat16": {"enabled": True, "check_grad_overflow": True}},
                                  owned_key_flags("--per_device_train_batch_size", "--zero_stage"), quiet=True)
    assert "bfloat16" not in merged and get_bfloat16_config(merged).check_grad_overflow is True


def test_optimizer_offload_without_zero_is_a_usage_error():
    # DeepSpeed offloads optimizer states only under ZeRO; at stage 0 its CPU Adam fails on GPU tensors
    from dschat.errors import UsageError
    from dschat.utils.ds_config import apply_user_ds_config, get_train_ds_config, owned_key_flags

    flags = owned_key_flags("--per_device_train_batch_size", "--zero_stage")
    with pytest.raises(UsageError, match="optimizer offload .* needs ZeRO stage 1, 2 or 3"):
        apply_user_ds_config(get_train_ds_config(offload=True, stage=0), None, flags)
    with pytest.raises(UsageError, match="needs ZeRO stage"):
        apply_user_ds_config(get_train_ds_config(stage=0), {"zero_optimization": {
            "offload_optimizer": {"device": "cpu"}}}, flags, quiet=True)
    assert apply_user_ds_config(get_train_ds_config(offload=True, stage=2), None, flags)["zero_optimization"][
        "offload_optimizer"]["device"] == "cpu"
    # step 3: which model is at stage 0 (--actor_zero_stage 3 left the critic at 0, and the error named neither)
    from dschat.rlhf.engine import check_step3_settings

    with pytest.raises(UsageError, match=r"--offload: the critic trains at ZeRO stage 0 .*give --critic_zero_stage"):
        check_step3_settings(step3_args({"offload": True, "actor_zero_stage": 3}), 1)


def test_notebook_switches_given_as_strings_mean_what_they_say():
    # "false" is a truthy string: kept raw, {"enable_hybrid_engine": "false"} turned the hybrid engine on
    from dschat.errors import UsageError

    assert step3_args({"enable_hybrid_engine": "false", "greedy": "OFF"}).enable_hybrid_engine is False
    assert step3_args({"enable_hybrid_engine": "True", "greedy": "off"}).enable_hybrid_engine is True
    assert step3_args({"enable_cuda_graph": "no"}).enable_cuda_graph is False
    assert step3_args({"no-enable_cuda_graph": "yes"}).enable_cuda_graph is False
    assert step3_args({"no-enable_cuda_graph": "0"}).enable_cuda_graph is None  # False leaves it, as a bool does
    assert step3_args({"disable_actor_dropout": "false"}).actor_dropout is None
    assert step3_args({"disable_actor_dropout": "1"}).actor_dropout == 0.0
    assert step3_args({"actor_dropout": "0.1"}).actor_dropout == 0.1  # the float flag, not --disable_actor_dropout
    with pytest.raises(UsageError, match="enable_hybrid_engine: 'maybe'"):
        step3_args({"enable_hybrid_engine": "maybe"})


def test_every_key_a_config_file_sets_against_the_flags_is_in_one_error():
    """A file with two such keys said only the first; fixed and run again, the second."""
    from dschat.errors import UsageError
    from dschat.utils.ds_config import apply_user_ds_config, get_train_ds_config, owned_key_flags

    flags = owned_key_flags("--per_device_train_batch_size", "--zero_stage")
    with pytest.raises(UsageError, match=r"train_micro_batch_size_per_gpu = 99, but the flags give 4 \(set it with "
                                         r"--per_device_train_batch_size\); zero_optimization.stage = 3, but the "
                                         r"flags give 2 \(set it with --zero_stage\): the flags set these"):
        apply_user_ds_config(get_train_ds_config(stage=2, micro_batch_size=4),
                             {"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 99}, flags,
                             quiet=True)


def test_the_decoder_stack_is_found_by_full_size_under_zero3_partitioning(distributed):
    """Partitioned parameters have numel() 0 outside a gather: every ModuleList weighed 0 and the first one won, so a
    model with another ModuleList before its decoder stack (a projector, say) had it taken for the layers."""
    import deepspeed
    from torch import nn

    from dschat.models.layers import decoder_layer_list

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.small = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
            self.layers = nn.ModuleList([nn.Linear(64, 64) for _ in range(3)])

    with deepspeed.zero.Init(config_dict_or_path={"train_micro_batch_size_per_gpu": 1,
                                                  "zero_optimization": {"stage": 3}}):
        sharded = Net()
    assert sharded.layers[0].weight.numel() == 0, "the parameters are partitioned"
    assert decoder_layer_list(sharded)[0] == "layers"
