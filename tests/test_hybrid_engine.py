"""Hybrid engine: greedy equality with HF generate, weight-storage assumptions, the KV cache, the engine contract."""
import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from hybrid_common import (PAD, early_token, hf_generate, left_padded_batch,  # noqa: E402
                           make_ds_engine, tiny_model, tiny_recurrent_gemma, train_step)
from helpers import check_checkpointing_toggle  # noqa: E402

from dschat.hybrid_engine import (HybridEngine, HybridEngineConfig, strip_deepspeed_hybrid_engine,  # noqa: E402
                                  wrap_actor)
from dschat.hybrid_engine.cache import KVCache  # noqa: E402

MAX_NEW = 16


def _engine(model, stage=0, bf16=False, **config):
    config.setdefault("max_out_tokens", 32)
    return HybridEngine(make_ds_engine(model, stage, bf16=bf16), HybridEngineConfig(enabled=True, **config),
                        pad_token_id=PAD)




# -- config --------------------------------------------------------------------------------------------------------
def test_config_defaults_match_deepspeed_and_strip_removes_block():
    from deepspeed.runtime.config import HybridEngineConfig as DeepSpeedHybridEngineConfig

    ours = HybridEngineConfig()
    theirs = DeepSpeedHybridEngineConfig()
    for field in ("enabled", "max_out_tokens", "inference_tp_size", "release_inference_cache", "pin_parameters",
                  "tp_gather_partition_size", "enable_cuda_graph"):
        assert getattr(ours, field) == getattr(theirs, field), field

    ds_config = {"train_batch_size": 8, "hybrid_engine": {"enabled": True, "max_out_tokens": 64,
                                                          "pin_parameters": False}}
    cfg = HybridEngineConfig.from_ds_config(ds_config)
    assert (cfg.enabled, cfg.max_out_tokens, cfg.pin_parameters) == (True, 64, False)
    stripped = strip_deepspeed_hybrid_engine(ds_config)
    assert "hybrid_engine" not in stripped and stripped["train_batch_size"] == 8
    assert "hybrid_engine" in ds_config  # the caller's dict is left alone
    with pytest.raises(ValueError, match="unknown hybrid_engine option"):
        HybridEngineConfig.from_ds_config({"hybrid_engine": {"max_out_token": 3}})


# -- greedy equality -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "opt", "gpt2", "bloom", "falcon", "falcon_alibi",
                                    "falcon_new", "gemma2", "phi3", "gpt_neox", "gpt_bigcode"])
def test_greedy_equals_hf_generate_before_and_after_a_step(family):
    model = tiny_model(family)
    engine = _engine(model)
    ids, mask = left_padded_batch([7, 3, 5, 1])

    # EOS = a token row 0 emits early, so that row ends (and is padded after) while others may run on.
    no_eos = hf_generate(model, ids, mask, MAX_NEW)
    eos = early_token(no_eos[0, ids.shape[1]:])
    expected = hf_generate(model, ids, mask, MAX_NEW, eos_token_id=eos)
    engine.eval()
    got = engine.module.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert torch.equal(got, expected), (got, expected)
    row0 = got[0, ids.shape[1]:].tolist()
    assert eos in row0 and row0.index(eos) < MAX_NEW - 1 and set(row0[row0.index(eos) + 1:]) == {PAD}

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_step(engine, got)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "the step changed nothing"

    engine.eval()
    expected_after = hf_generate(model, ids, mask, MAX_NEW, eos_token_id=eos)
    got_after = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert torch.equal(got_after, expected_after)
    assert not torch.equal(expected_after, expected), "the test cannot see a stale weight set"


def test_all_rows_finishing_stops_early_and_trims_like_hf():
    model = tiny_model("llama", seed=1)
    engine = _engine(model, max_out_tokens=48)
    ids, mask = left_padded_batch([5, 5])
    ids[1] = ids[0]  # the same prompt twice: both rows end at the same early step
    no_eos = hf_generate(model, ids, mask, 40)
    eos = early_token(no_eos[0, ids.shape[1]:])
    expected = hf_generate(model, ids, mask, 40, eos_token_id=eos)
    assert expected.shape[1] - ids.shape[1] <= 4

    forwards = []
    handle = model.register_forward_hook(lambda *_: forwards.append(1))
    engine.eval()
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=40, eos_token_id=eos)
    handle.remove()
    assert torch.equal(got, expected)
    # prefill + decode steps up to the first all-finished check (every 8 steps), not 40 steps.
    assert len(forwards) == 8


def test_eos_list_and_default_pad_token():
    model = tiny_model("llama", seed=2)
    ds_engine = make_ds_engine(model)
    # pad/eos from a tokenizer-like object, as trainers pass them.
    tok = type("Tok", (), {"pad_token_id": PAD, "eos_token_id": None})()
    engine = wrap_actor(ds_engine, {"hybrid_engine": {"enabled": True, "max_out_tokens": 24}}, tok)
    assert isinstance(engine, HybridEngine)
    ids, mask = left_padded_batch([4, 6, 2], seed=3)
    no_eos = hf_generate(model, ids, mask, 12)
    eos = [early_token(no_eos[0, 6:]), early_token(no_eos[1, 6:], avoid=[early_token(no_eos[0, 6:])])]
    expected = hf_generate(model, ids, mask, 12, eos_token_id=eos)
    engine.eval()
    # DeepSpeed-Chat passes the total max_length and synced_gpus; both must work.
    got = engine.module.generate(ids, attention_mask=mask, max_length=6 + 12, eos_token_id=eos, synced_gpus=True)
    assert torch.equal(got, expected)
    assert wrap_actor(ds_engine, {"hybrid_engine": {"enabled": False}}, tok) is ds_engine
    assert engine.token_count is None  # (no size: every column may be generated)
    sized = type("Tok", (), {"pad_token_id": PAD, "eos_token_id": None, "__len__": lambda self: 90})()
    assert wrap_actor(ds_engine, {"hybrid_engine": {"enabled": True}}, sized).token_count == 90  # len(tokenizer)


# -- weights ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stage,dtype", [(0, torch.float32), (2, torch.float32), (0, torch.bfloat16),
                                         (2, torch.bfloat16)])
def test_zero_0_2_generates_from_training_parameters_whose_storage_is_stable(stage, dtype):
    # DeepSpeed's optimizers (FP16_Optimizer/BF16 at stage 0, ZeRO-1/2's flat buffers) update parameters in place.
    model = tiny_model("llama", seed=4, dtype=dtype)
    engine = _engine(model, stage=stage, bf16=dtype == torch.bfloat16)
    assert next(engine.module.parameters()).dtype == dtype
    weights = engine.inference_weights
    assert weights.kind == "training_module" and weights.model is engine.module
    assert weights.description == "the training module's own weights (no copy)"  # what the run's log says
    ptrs = {n: p.data_ptr() for n, p in engine.module.named_parameters()}
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    ids, mask = left_padded_batch([3, 5], seed=5)
    engine.eval()
    seq = engine.generate(ids, attention_mask=mask, max_new_tokens=6)
    train_step(engine, seq)
    assert {n: p.data_ptr() for n, p in engine.module.named_parameters()} == ptrs
    assert any(not torch.equal(before[n], p) for n, p in engine.module.named_parameters())


def test_step_marks_weights_stale_only_when_applied():
    model = tiny_model("llama", seed=6)
    engine = _engine(model)
    weights = engine.inference_weights
    ids, mask = left_padded_batch([3, 4], seed=6)
    engine.eval()
    v0 = weights.version
    seq = engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    train_step(engine, seq)
    assert weights.version == v0 + 1 and weights.is_stale
    engine.eval()
    assert not weights.is_stale
    engine.eval()
    assert weights.version == v0 + 1


# -- KV cache ----------------------------------------------------------------------------------------------------
def test_cache_is_reused_across_generations_and_released_on_request():
    model = tiny_model("qwen2", seed=7)
    engine = _engine(model)
    ids, mask = left_padded_batch([4, 2, 5], seed=7)
    engine.eval()
    first = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    storage = engine.kv_cache.storages()[0]
    second = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(first, second)
    assert engine.kv_cache.allocations == 1 and engine.kv_cache.storages()[0] is storage  # reset, not reallocated

    releasing = _engine(tiny_model("qwen2", seed=7), release_inference_cache=True)
    # Observe the cache storage only through a weakref taken while generating.
    refs = []

    def remember_cache_storage(*_):
        if not refs:
            refs.append(weakref.ref(releasing.kv_cache.storages()[0]))

    handle = releasing.module.register_forward_hook(remember_cache_storage)
    releasing.eval()
    out = releasing.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    handle.remove()
    assert torch.equal(out, first)
    assert not releasing.kv_cache.is_allocated and releasing.kv_cache.nbytes == 0
    gc.collect()
    assert refs and refs[0]() is None, "the released KV cache is still referenced"
    again = releasing.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(again, first) and releasing.kv_cache.allocations == 2


def _counting_destroys(ds_engine):
    """The list that gets a 1 for each destroy() of ``ds_engine`` (its own: DeepSpeed's __del__ destroys an engine
    again as it goes, the engines of earlier tests too)."""
    calls, destroy = [], ds_engine.destroy
    ds_engine.destroy = lambda: calls.append(1) or destroy()
    return calls


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_an_engine_released_twice_is_destroyed_once(stage):
    """release_engine of an engine released before (a HybridEngine, then its DeepSpeed engine; either twice) ran
    DeepSpeed's destroy() again; now a second release does nothing."""
    from dschat.models.training_engine import release_engine

    engine = _engine(tiny_model("llama"), stage=stage)
    destroyed, generation = _counting_destroys(engine.ds_engine), []
    release_generation = engine.release_generation
    engine.release_generation = lambda: generation.append(1) or release_generation()
    for released in (engine, engine, engine.ds_engine):
        release_engine(released)
    assert destroyed == [1] and generation == [1]
    alone = make_ds_engine(tiny_model("llama"), stage)
    destroyed = _counting_destroys(alone)
    release_engine(alone)
    release_engine(alone)
    assert destroyed == [1]


def test_a_hybrid_engine_released_by_release_generation_is_released_for_release_engine_too():
    """release_generation() called on its own (not through release_engine) makes the engine refuse to generate, and
    a release_engine afterwards drops nothing of it twice yet still releases its DeepSpeed engine, once: the wrapper's
    released state and release_engine's record are one."""
    from dschat.models.training_engine import release_engine

    engine = _engine(tiny_model("llama"))
    destroyed, dropped = _counting_destroys(engine.ds_engine), []
    engine.release_generation()
    with pytest.raises(RuntimeError, match="was released"):
        engine.eval()
    engine.kv_cache.release = lambda: dropped.append(1)
    release_engine(engine)
    release_engine(engine)
    assert destroyed == [1] and dropped == []


def test_a_released_engines_block_releases_every_hybrid_engine_around_its_engine():
    """Two HybridEngines around one DeepSpeed engine made in a released_engines block: the block released the first
    alone (it took its engine's place), so the second one's inference tensor-parallel group stayed in torch's
    registry (2 ranks: tests/scripts/hybrid_tp.py --release). Each is released, the DeepSpeed engine once."""
    from dschat.models import training_engine

    generations = []
    with training_engine.released_engines():
        ds_engine = training_engine._made(make_ds_engine(tiny_model("llama")))
        destroyed = _counting_destroys(ds_engine)
        for name in ("first", "second"):
            wrapper = HybridEngine(ds_engine, HybridEngineConfig(enabled=True, max_out_tokens=32), pad_token_id=PAD)
            release_generation = wrapper.release_generation
            wrapper.release_generation = lambda name=name, release=release_generation: \
                generations.append(name) or release()
    assert generations == ["first", "second"] and destroyed == [1]


def test_two_hybrid_engines_on_one_deepspeed_engine_each_stay_routed_and_fresh():
    """Two HybridEngines around one DeepSpeed engine (a notebook that wrapped the actor again): release_generation()
    of either one deleted the module's routed generate, so engine.module.generate of the one left ran HF's generate
    instead of it; and a step through one marked only its own inference copy stale, so the other generated from the
    weights before the step. Now the module's generate goes to the latest wrapper not released, and a step through
    either refreshes both."""
    import peft

    model = peft.get_peft_model(tiny_model("llama", seed=3), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    ds_engine = make_ds_engine(model)
    config = HybridEngineConfig(enabled=True, max_out_tokens=32)
    first, second = (HybridEngine(ds_engine, config, pad_token_id=PAD) for _ in range(2))
    assert first.inference_weights.kind == second.inference_weights.kind == "lora_copy"
    ids, mask = left_padded_batch([4, 2, 5], seed=3)
    calls = []
    for name, wrapper in (("first", first), ("second", second)):
        generate = wrapper.generate
        wrapper.generate = lambda *a, name=name, generate=generate, **k: calls.append(name) or generate(*a, **k)

    def module_generate():
        return ds_engine.module.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)

    second.eval()
    train_step(first, module_generate())  # through the first: the second's copy is behind it now
    second.eval()
    assert torch.equal(module_generate(), hf_generate(model, ids, mask, MAX_NEW))
    first.release_generation()
    module_generate()
    assert calls == ["second", "second", "second"], calls
    third = HybridEngine(ds_engine, config, pad_token_id=PAD)
    third.release_generation()  # the latest released: the one before it generates again
    module_generate()
    assert calls[-1] == "second", calls
    second.release_generation()  # none left: the model class's own generate
    assert torch.equal(module_generate(), hf_generate(model, ids, mask, MAX_NEW)) and len(calls) == 4


def test_release_drops_generation_state_while_the_engine_is_still_referenced():
    """release_engine on a HybridEngine that something still holds (a notebook's trainer holds the actor): the KV
    cache, the decode steps of the graph path (run eagerly on the CPU) with their buffers, the fused projections and
    the inference copy (a LoRA actor's merged weights) were kept as long as the engine was; now they go at once, and the
    model once the engine goes. The released engine refuses to generate."""
    import peft

    from dschat.hybrid_engine.graphs import GraphDecoder
    from dschat.models.training_engine import release_engine

    model = peft.get_peft_model(tiny_model("llama", seed=3), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    engine = HybridEngine(make_ds_engine(model), HybridEngineConfig(enabled=True, max_out_tokens=32),
                          pad_token_id=PAD, fuse_projections="on")
    engine.graph_decoder = GraphDecoder(engine.kv_cache, capture_graphs=False)
    ids, mask = left_padded_batch([4, 2, 5], seed=3)
    engine.eval()
    engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert engine.graph_decoder.replays > 0 and engine.fusion.groups and engine.inference_weights.kind == "lora_copy"
    state = {"kv cache": engine.kv_cache.storages()[0], "inference copy": engine.inference_weights.model,
             "decode step": next(iter(engine.graph_decoder.decoders.values())).buffers,
             "fused weights": engine.fusion.groups[0]}
    refs = {name: weakref.ref(value) for name, value in state.items()}
    del state
    release_engine(engine)
    gc.collect()
    assert [name for name, ref in refs.items() if ref() is not None] == []
    with pytest.raises(RuntimeError, match="was released"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    # the model's own generate is its class's again (ZeRO-0: the model is whole)
    assert torch.equal(engine.module.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                              pad_token_id=PAD), hf_generate(model, ids, mask, 4))
    module = weakref.ref(model)
    del engine, model
    gc.collect()
    assert module() is None, "the released engine's model is still referenced"


def test_cache_allocation_retries_once_then_explains():
    config = tiny_model("llama").config
    cache = KVCache(config)
    real_allocate = cache._allocate
    calls = []

    def fail_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("out of memory")
        return real_allocate(*args)

    cache._allocate = fail_once
    assert cache.acquire(2, 10, torch.float32, "cpu") is not None and len(calls) == 2

    def always_fail(*args):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")

    cache.release()
    cache._allocate = always_fail
    with pytest.raises(RuntimeError, match=r"MiB.*max_out_tokens"):
        cache.acquire(2, 10, torch.float32, "cpu")


def test_max_out_tokens_bounds_prompt_plus_answer_as_in_deepspeed():
    engine = _engine(tiny_model("llama"), max_out_tokens=8)
    ids, mask = left_padded_batch([3])
    assert engine.generate(ids, attention_mask=mask, max_new_tokens=5).shape[1] <= 8  # 3 + 5 fits
    with pytest.raises(ValueError, match=r"a prompt of 3 tokens \+ max_new_tokens=6 exceeds .*max_out_tokens=8"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=6)


def test_unset_settings_come_from_the_generation_config_as_in_hf():
    model = tiny_model("llama", seed=3)
    engine = _engine(model, max_out_tokens=64)
    ids, mask = left_padded_batch([3, 5], seed=3)
    config = model.generation_config
    config.do_sample, config.top_k, config.max_new_tokens = True, 1, 7  # top-k 1: sampling that is greedy
    got = engine.generate(ids, attention_mask=mask, eos_token_id=None)
    expected = hf_generate(model, ids, mask, 7)  # greedy, 7 new tokens
    assert torch.equal(got, expected)
    # HF-style None values mean "not given"
    assert torch.equal(engine.generate(ids, attention_mask=mask, temperature=None, top_k=None, top_p=None,
                                       eos_token_id=None), expected)


def test_hf_kwargs_that_would_change_the_result_are_errors_and_no_ops_pass():
    engine = _engine(tiny_model("llama"))
    ids, mask = left_padded_batch([3])
    for kwargs in ({"num_return_sequences": 2}, {"no_repeat_ngram_size": 2}, {"return_dict_in_generate": True},
                   {"num_beams": 2}, {"stop_strings": ["x"]}):
        with pytest.raises(ValueError, match="does not support"):
            engine.generate(ids, attention_mask=mask, max_new_tokens=3, **kwargs)
    engine.generate(ids, attention_mask=mask, max_new_tokens=3, synced_gpus=True, use_cache=True, num_beams=1,
                    num_return_sequences=1, output_scores=False, streamer=None, no_repeat_ngram_size=0,
                    typical_p=1.0, logits_processor=[], repetition_penalty=1.0)
    for penalty in (0.0, -1.2):  # HF's rule: strictly positive
        with pytest.raises(ValueError, match="repetition_penalty has to be strictly positive"):
            engine.generate(ids, attention_mask=mask, max_new_tokens=3, repetition_penalty=penalty)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_repetition_penalty_comes_from_the_generation_config_unless_the_call_gives_one(family):
    """A generation_config's repetition_penalty (Qwen2.5-Instruct ships 1.05) is applied as HF applies it, greedy or
    sampled, not refused; the call's value wins. Settings the decode does not apply are still refused."""
    from dschat.errors import UsageError

    model = tiny_model(family, seed=14)
    engine = _engine(model)
    ids, mask = left_padded_batch([7, 3, 5], seed=14)
    unpenalised = hf_generate(model, ids, mask, 12)
    model.generation_config.repetition_penalty = 1.3
    engine.check_generation_config()  # not an error any more
    engine.eval()
    expected = hf_generate(model, ids, mask, 12)  # HF reads the generation_config's penalty too
    assert not torch.equal(expected, unpenalised), "the penalty changed nothing: the test could not see it"
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12), expected)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12, repetition_penalty=None),
                       expected)  # HF-style None: not given
    # the call's value wins over the generation_config's
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12, repetition_penalty=1.0),
                       unpenalised)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12, repetition_penalty=0.8),
                       hf_generate(model, ids, mask, 12, repetition_penalty=0.8))
    # with sampling too: a top-k of 1 samples greedily, through the penalised logits
    model.generation_config.do_sample, model.generation_config.top_k = True, 1
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12), expected)
    model.generation_config.no_repeat_ngram_size = 2
    with pytest.raises(UsageError, match="generation_config sets no_repeat_ngram_size=2"):
        engine.check_generation_config()


# -- contract & stats --------------------------------------------------------------------------------------------
def test_engine_delegates_and_records_latencies(capsys):
    model = tiny_model("gpt2", seed=8)
    engine = _engine(model)
    assert engine.module is engine.ds_engine.module and engine.optimizer is engine.ds_engine.optimizer
    ids, mask = left_padded_batch([3, 4], seed=8)
    engine.eval()
    seq = engine.module.generate(ids, attention_mask=mask, max_new_tokens=5)  # DeepSpeed-Chat's call site
    assert engine.latency_stats()["samples"] == 2  # went through the engine
    train_step(engine, seq)  # train() ... step()
    engine.eval()  # closes iteration 1
    stats = engine.latency_stats(engine.last_iteration)
    assert stats["generate_latency"] > 0 and stats["training_latency"] > 0
    assert stats["samples"] == 2 and 2 <= stats["generated_tokens"] <= 10 and stats["tokens_per_sec"] > 0
    assert stats["e2e_latency"] >= stats["generate_latency"] + stats["training_latency"]
    engine.log_stats(engine.last_iteration)
    assert "|E2E latency=" in capsys.readouterr().out


@pytest.mark.parametrize("lora", [False, True])
def test_deepspeed_chats_checkpointing_toggle_on_the_actor_warns_not_and_switches_every_layer(lora):
    """DeepSpeed-Chat's step-3 loop turns the actor's checkpointing on before each PPO update and off after
    (``rlhf_engine.actor.gradient_checkpointing_enable()``): forwarded to transformers' deprecated name, each call put a
    FutureWarning in the run's log (and transformers 6 drops the name). The engine's own pair switches every layer."""
    from dschat.models.lora import apply_lora

    model = tiny_model("llama", seed=3)
    check_checkpointing_toggle(_engine(apply_lora(model, lora_dim=4) if lora else model))


def test_a_deep_copy_of_the_actor_module_is_possible_and_does_not_generate_through_the_engine():
    import copy

    engine = _engine(tiny_model("llama", seed=2))
    twin = copy.deepcopy(engine.module)  # e.g. TRL's create_reference_model; it copied the engine's process groups
    ids, mask = left_padded_batch([3, 4], seed=8)
    with pytest.raises(RuntimeError, match=r"type\(model\).generate"):
        twin.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert torch.equal(type(twin).generate(twin, ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                           pad_token_id=PAD),
                       engine.generate(ids, attention_mask=mask, max_new_tokens=4))


def test_generation_uses_torchs_linear_even_after_zero3_replaced_it(monkeypatch):
    # ZeRO-3 swaps torch.nn.functional.linear for a memory-efficient autograd function (an extra bias-add kernel per
    # projection); generation restores torch's own for its duration and puts DeepSpeed's back afterwards.
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses

    from dschat.hybrid_engine.engine import torch_linear

    original = torch.nn.functional.linear
    calls = []

    def zero3_linear(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(InsertPostInitMethodToModuleSubClasses, "linear_bk", original, raising=False)
    monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear)
    with torch_linear():
        assert torch.nn.functional.linear is original
    assert torch.nn.functional.linear is zero3_linear

    engine = _engine(tiny_model("llama", seed=9))
    ids, mask = left_padded_batch([3, 4], seed=9)
    engine.eval()
    engine.generate(ids, attention_mask=mask, max_new_tokens=3)
    assert not calls and torch.nn.functional.linear is zero3_linear


def test_step3_turns_cuda_graphs_on_by_default_only_where_they_can_run(monkeypatch):
    from deepspeed.accelerator import get_accelerator

    from dschat.args import step3_parser
    from dschat.rlhf.config import step3_args
    from dschat.rlhf.engine import uses_cuda_graph

    parse = step3_parser().parse_args
    assert parse([]).enable_cuda_graph is None
    assert parse(["--enable_cuda_graph"]).enable_cuda_graph is True
    assert parse(["--no-enable_cuda_graph"]).enable_cuda_graph is False
    assert uses_cuda_graph(step3_args({})) is False  # this CPU accelerator: the eager loop, no notice
    monkeypatch.setattr(type(get_accelerator()), "device_name", lambda self, *a: "cuda")
    assert uses_cuda_graph(step3_args({})) is True
    unpinned = {"unpin_actor_parameters": True, "actor_zero_stage": 3}
    assert uses_cuda_graph(step3_args(unpinned)) is False  # gathers inside the forward
    assert uses_cuda_graph(step3_args({"unpin_actor_parameters": True, "zero_stage": 3})) is False
    # below ZeRO-3 the flag changes nothing (whole weights, no gathers): it turned the graphs off all the same
    assert uses_cuda_graph(step3_args({"unpin_actor_parameters": True})) is True
    assert uses_cuda_graph(step3_args({"unpin_actor_parameters": True, "actor_zero_stage": 2})) is True
    assert uses_cuda_graph(step3_args({"enable_cuda_graph": False})) is False
    assert uses_cuda_graph(step3_args({"enable_cuda_graph": True, "unpin_actor_parameters": True})) is True


def _gemma4(per_layer_config):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip("this transformers has no Gemma-4")
    from transformers import AutoModelForCausalLM

    config = transformers.Gemma4TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        per_layer_config=per_layer_config, vocab_size_per_layer_input=96, hidden_size_per_layer_input=8,
        max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        setattr(model.generation_config, key, None)
    return model


def test_per_layer_head_dim_is_refused_when_the_engine_is_built():
    # Gemma-4: its full-attention layers have a larger head_dim (a per-layer field transformers refuses to read
    # globally); one static cache cannot hold both, so the engine says what to do instead of failing at the prefill
    from dschat.errors import UsageError
    from dschat.hybrid_engine.cache import kv_layout

    model = _gemma4({"01": {"head_dim": 32}})
    with pytest.raises(UsageError, match=r"head_dim per layer \(\[16, 32\]\).*one head dim per model.*"
                                         r"without the hybrid engine.*--no-enable_hybrid_engine"):
        _engine(model)
    with pytest.raises(UsageError, match="one head dim per model"):
        kv_layout(model.config)
    with pytest.raises(UsageError, match="one head dim per model"):
        KVCache(model.config)


def test_gemma4_with_one_head_dim_generates_as_hf():
    model = _gemma4(None)
    engine = _engine(model)
    engine.eval()
    ids, mask = left_padded_batch([9, 3, 7], seed=2)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=10)
    assert torch.equal(got, hf_generate(model, ids, mask, 10))




def test_a_one_token_prompt_of_recurrent_gemma_generates_alike_after_another_generation():
    """RecurrentGemma keeps its convolution state in its modules and sets it up only for a forward given no cache;
    a one-token prompt's prefill is taken for a decode step, and the engine's went on from the previous generation's
    state: log-probs 0.002 off after another prompt's generation. Each generation starts from a fresh state: the
    log-probs are the same before and after, and the first is the model's own (a forward without a cache)."""
    model = tiny_recurrent_gemma()
    engine = _engine(model)
    engine.eval()
    one, other = torch.tensor([[17]]), torch.tensor([[40, 51, 9, 77, 23]])

    def logprobs(ids):
        return engine.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                               return_logprobs=True)[1]

    first = logprobs(one)
    logprobs(other)
    torch.testing.assert_close(logprobs(one), first, rtol=0, atol=0)
    with torch.no_grad():
        own = torch.log_softmax(model(one).logits[0, -1].float(), -1).max()
    torch.testing.assert_close(first[0, 0], own)


def test_an_actor_whose_outputs_left_padding_moves_generates_each_row_as_without_its_padding(capsys, monkeypatch):
    """RecurrentGemma's recurrent layers read no attention mask (transformers' modelling): the engine decoded the
    padded rows, and a left-padded prompt's answer was not the prompt's own (its short convolution reads the pads'
    inputs: log-probs up to 0.16 off), while step 3 scores the answers' log-probs on rows shifted to start at their
    first token; it only warned. The rows of each prompt length now generate
    together without their padding: each row's tokens and log-probs are those of its prompt alone (HF's tokens too),
    nothing is warned of; where a row cannot leave its padding out (a hole in the mask), the batch decodes as it is,
    warned of once (LEFT_PADDING_MOVES_SCORES)."""
    from dschat.models import left_padding

    monkeypatch.setattr(left_padding, "_WARNED_LEFT_PADDING", set())
    model = tiny_recurrent_gemma()
    with torch.no_grad():  # (as a trained model's: at their initial 0 the pads' inputs to the convolution are 0)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
        model.get_input_embeddings().weight[PAD].normal_()
    engine = _engine(model)
    engine.eval()
    lengths = [5, 2, 4, 1, 2]
    ids, mask = left_padded_batch(lengths, seed=3)
    width = ids.shape[1]
    capsys.readouterr()
    got, logprobs = engine.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                    return_logprobs=True)
    assert got.shape == (len(lengths), width + 6) and torch.equal(got[:, :width], ids)
    for row, n in enumerate(lengths):
        alone_ids = ids[row:row + 1, width - n:]
        alone, alone_logprobs = engine.generate(alone_ids, attention_mask=torch.ones_like(alone_ids),
                                                max_new_tokens=6, do_sample=False, return_logprobs=True)
        assert torch.equal(got[row, width:], alone[0, n:]), row
        torch.testing.assert_close(logprobs[row], alone_logprobs[0])
        assert torch.equal(alone, hf_generate(model, alone_ids, torch.ones_like(alone_ids), 6)), row
    assert "warning" not in capsys.readouterr().out
    holed = mask.clone()
    holed[0, width - 3] = 0  # (a hole inside row 0's prompt: no row without padding to give it)
    for _ in range(2):
        engine.generate(ids, attention_mask=holed, max_new_tokens=3, do_sample=False)
    said = capsys.readouterr().out
    assert said.count("warning: the actor on RecurrentGemmaForCausalLM generates from left-padded prompts") == 1
