"""Shared settings for end-to-end tests on the embedded tiny default (small and fast on 2 CPU cores)."""
from pathlib import Path

import torch

SFT_FAST = ["--max_seq_len", "80", "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "32",
            "--learning_rate", "2e-3", "--dtype", "fp32", "--eval_iters", "2"]
RM_FAST = SFT_FAST
PPO_FAST = ["--max_prompt_seq_len", "40", "--max_answer_seq_len", "12", "--per_device_generation_batch_size", "4",
            "--per_device_training_batch_size", "4", "--dtype", "fp32", "--num_warmup_steps", "0",
            "--eval_prompts", "8", "--actor_learning_rate", "1e-4", "--critic_learning_rate", "1e-4"]


def step_dirs(root):
    root = Path(root)
    return root / "sft", root / "rm", root / "data"


def saved_tensors(folder):
    """Every tensor of the model files a step saved in ``folder`` (its subfolders too: step 3's actor and critic)."""
    from safetensors.torch import load_file

    return {f"{path.relative_to(folder)}:{name}": tensor for path in sorted(Path(folder).rglob("*.safetensors"))
            for name, tensor in load_file(str(path)).items()}


def spy_on_empty_query_rows(monkeypatch):
    """A list that gets, per call of torch's SDPA with a boolean mask, whether a query row of that mask sees no key
    (what cuDNN's backward turns into NaN; on the CPU it gives zeros, so outputs and gradients alone cannot tell a
    repaired row from one left as is)."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, *args, **kwargs):
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            seen.append(bool((~attn_mask.any(-1)).any()))
        return sdpa(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def hopper_target():
    """Triton's ahead-of-time compiler for an H100/H200 (sm_90), which works without a GPU; None where this Triton has
    no CUDA backend or ptxas."""
    import pytest

    triton = pytest.importorskip("triton", reason="the README's test command installs triton")
    try:
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        return None
    return GPUTarget("cuda", 90, 32) if "nvidia" in backends and triton.knobs.nvidia.ptxas.path else None


def run_interpreted_check(script, check):
    """``tests/scripts/<script> <check>`` under Triton's interpreter (chosen before triton decorates the kernels,
    hence a process of its own, and not a rank of this test process's world, whose port may be taken); fails the
    test with the script's output if the check fails."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("triton", reason="the README's test command installs triton")
    scripts = Path(__file__).parent / "scripts"
    own = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env = {**own, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{scripts.parent.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, str(scripts / script), check], cwd=scripts, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def skip_without_fp16():
    """Skip a test that trains in fp16 where DeepSpeed's accelerator cannot (a CPU needs AVX512-FP16 or AMX-FP16)."""
    import pytest
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        pytest.skip(f"DeepSpeed's {get_accelerator().device_name()} accelerator cannot train in fp16 (a CPU needs "
                    "AVX512-FP16 or AMX-FP16)")


def fp16_flags(folder, **loss_scale):
    """The flags of an fp16 run at ZeRO-2 whose --deepspeed_config file (written to ``folder``) sets the fp16 loss
    scale (``initial_scale_power`` or a fixed ``loss_scale``): a high one makes the scaled gradients overflow for
    real. ZeRO-2: there DeepSpeed scales the loss itself (at ZeRO-0 dschat does, ``scale_fp16_loss_at_zero_0``:
    DeepSpeed 0.19 does not, deepspeedai/DeepSpeed#8393)."""
    import json

    config = Path(folder) / "fp16_ds_config.json"
    config.write_text(json.dumps({"fp16": {"enabled": True, **loss_scale}}))
    return ["--dtype", "fp16", "--zero_stage", "2", "--deepspeed_config", str(config)]


def record_applied_steps(monkeypatch):
    """A list that gets, per optimizer step of a DeepSpeed engine (an accumulation boundary), whether it applied it
    (False: skipped on inf/NaN gradients)."""
    import deepspeed

    applied, real_step = [], deepspeed.DeepSpeedEngine.step

    def recorded(engine, *args, **kwargs):
        boundary = engine.is_gradient_accumulation_boundary()
        result = real_step(engine, *args, **kwargs)
        if boundary:
            applied.append(engine.was_step_applied())
        return result

    monkeypatch.setattr(deepspeed.DeepSpeedEngine, "step", recorded)
    return applied


def count_copy_refreshes(set_attribute):
    """{"refreshes": refreshes of a hybrid engine's inference copy (a LoRA merge, a gather of the whole actor under
    ZeRO-3: real time on a GPU), "by_writes": generations whose copy an in-place write into the actor's parameters made
    stale where no step, load or mark had}, counted from now on. ``set_attribute``: a test's monkeypatch.setattr, or
    setattr in a launched script."""
    from dschat.hybrid_engine.weights import InferenceCopy

    counts = {"refreshes": 0, "by_writes": 0}
    refresh, follow_writes = InferenceCopy._refresh, InferenceCopy.follow_writes

    def counted_refresh(self):
        counts["refreshes"] += 1
        refresh(self)

    def counted_follow_writes(self):
        fresh = not self.is_stale
        follow_writes(self)
        counts["by_writes"] += int(fresh and self.is_stale)

    set_attribute(InferenceCopy, "_refresh", counted_refresh)
    set_attribute(InferenceCopy, "follow_writes", counted_follow_writes)
    return counts


def engines_made(monkeypatch):
    """A list that gets a weak reference to each DeepSpeed engine ``deepspeed.initialize`` makes: a dead one is an
    engine that Python could free."""
    import weakref

    import deepspeed

    made, initialize = [], deepspeed.initialize

    def spy(*args, **kwargs):
        engine, *rest = initialize(*args, **kwargs)
        made.append(weakref.ref(engine))
        return (engine, *rest)

    monkeypatch.setattr(deepspeed, "initialize", spy)
    return made


def engines_alive(made):
    """How many of ``engines_made``'s engines are alive after a full collection."""
    import gc

    gc.collect()
    return sum(ref() is not None for ref in made)


def check_checkpointing_toggle(engine):
    """DeepSpeed-Chat's step-3 loop's ``actor.gradient_checkpointing_enable()`` / ``_disable()`` on ``engine``: with
    FutureWarning an error (transformers' deprecated name), enable, disable and enable with kwargs switch every layer."""
    import warnings

    layers = [m for m in engine.module.modules() if hasattr(m, "gradient_checkpointing")]
    assert layers and not any(m.gradient_checkpointing for m in layers)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        engine.gradient_checkpointing_enable()
        assert all(m.gradient_checkpointing for m in layers)
        engine.gradient_checkpointing_disable()
        assert not any(m.gradient_checkpointing for m in layers)
        engine.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert all(m.gradient_checkpointing for m in layers)


def hub_cache_snapshot(hub, repo):
    """The snapshot folder of ``repo`` ("datasets--ORG--NAME") in the hub cache ``hub``, as a download leaves it: its
    refs/main naming the snapshot (not made: the caller writes its files)."""
    commit = "0" * 40
    (hub / repo / "refs").mkdir(parents=True)
    (hub / repo / "refs" / "main").write_text(commit)
    return hub / repo / "snapshots" / commit


def tiny_rwkv():
    """A tiny random RWKV causal LM (seeded, eval mode, no EOS or pad id): what the RWKV decode tests generate with."""
    from transformers import AutoModelForCausalLM, RwkvConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(RwkvConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64,
        context_length=64, bos_token_id=None, eos_token_id=None)).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


def tiny_deepseek_v4_actor():
    """DeepSeek-V4 whose compressed sparse attention pools every 4 tokens and whose indexer picks 2 of the pools, with
    a sliding window of 16: all reached by 20 tokens."""
    from transformers import AutoModelForCausalLM, DeepseekV4Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(DeepseekV4Config(
        vocab_size=96, hidden_size=64, moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=4,
        n_shared_experts=1, sliding_window=16, max_position_embeddings=256, qk_rope_head_dim=8, index_n_heads=4,
        index_head_dim=16, index_topk=2, layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"], bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


def tiny_recurrent_gemma_actor():
    """RecurrentGemma whose attention layer's window is 16 tokens (its head untied: tied, the tiny model answered each
    prompt with its last token over and over)."""
    from transformers import AutoModelForCausalLM, RecurrentGemmaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(RecurrentGemmaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, lru_width=32, attention_window_size=16, tie_word_embeddings=False,
        block_types=["recurrent", "attention"], pad_token_id=None, bos_token_id=None, eos_token_id=None)).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


def tiny_xlstm():
    """xLSTM 64 wide: its query/key heads (64 * 0.5 / 4 = 8) are narrower than transformers' cache makes their states,
    and a forward with a cache failed, one row too (tests/test_models.py)."""
    from transformers import AutoModelForCausalLM, xLSTMConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(xLSTMConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_heads=4, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)).eval()
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    return model


def hub_files_asked(monkeypatch, repo):
    """The file names transformers' ``cached_file`` is asked for of the hub model ``repo`` from now on (a list that
    grows): how many fetches a check makes."""
    import transformers.utils.hub

    asked = []
    cached_file = transformers.utils.hub.cached_file

    def counted(name, filename, **kwargs):
        if name == repo:
            asked.append(filename)
        return cached_file(name, filename, **kwargs)

    monkeypatch.setattr(transformers.utils.hub, "cached_file", counted)
    return asked
