"""Optimizer steps taken through the DeepSpeed engine itself, not the HybridEngine around it (a DeepSpeed-Chat-style
loop that kept the engine deepspeed.initialize returned): the next generation must read the stepped weights."""
import copy
import sys
from pathlib import Path

import peft
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from hybrid_common import (PAD, ds_config, gather_into, hf_generate, left_padded_batch, make_ds_engine,  # noqa: E402
                           tiny_model, train_step)

from dschat.hybrid_engine import HybridEngine, HybridEngineConfig  # noqa: E402
from dschat.models.lora import unwrap_peft  # noqa: E402

MAX_NEW = 12


def _lora_model(seed=0):
    model = tiny_model("llama", seed=seed)
    torch.manual_seed(seed + 100)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _hybrid(ds_engine):
    return HybridEngine(ds_engine, HybridEngineConfig(enabled=True, max_out_tokens=32), pad_token_id=PAD)


def _reference_generate(ds_engine, reference, ids, mask):
    """HF's greedy generate from the training weights as they are now (gathered into ``reference`` under ZeRO-3)."""
    if reference is None:
        return hf_generate(ds_engine.module, ids, mask, MAX_NEW)
    gather_into(reference, ds_engine.module)
    return hf_generate(reference, ids, mask, MAX_NEW)


# Where generation reads a copy of the training weights (the training module itself, ZeRO 0-2 without LoRA, and the
# fused projections, rewritten at every generation, are never behind: test_hybrid_engine*.py).
CASES = {"lora_zero0": (0, True), "lora_zero2": (2, True), "pinned_zero3": (3, False), "lora_zero3": (3, True)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_through_the_raw_deepspeed_engine_is_seen_by_the_next_generation(case):
    stage, lora = CASES[case]
    model = _lora_model() if lora else tiny_model("llama", seed=0)
    reference = copy.deepcopy(model) if stage == 3 else None  # (before deepspeed.initialize partitions it)
    ds_engine = make_ds_engine(model, stage)
    engine = _hybrid(ds_engine)
    assert engine.inference_weights.kind == ("lora_copy" if lora else "pinned_copy")
    ids, mask = left_padded_batch([6, 3, 5], seed=1)
    engine.eval()
    first = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(first, _reference_generate(ds_engine, reference, ids, mask))

    train_step(ds_engine, first)  # ds_engine.step(): the HybridEngine is not told
    expected = _reference_generate(ds_engine, reference, ids, mask)
    assert not torch.equal(expected, first), "the step changed no answer: the test could not see stale weights"
    engine.eval()
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), expected)
    # engine.module.generate (DeepSpeed-Chat's call site) without eval() too, after another raw step
    train_step(ds_engine, expected)
    again = _reference_generate(ds_engine, reference, ids, mask)
    assert torch.equal(ds_engine.module.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), again)


def _raw_micro_step(ds_engine, sequences, loss_factor=1.0):
    """One forward/backward/step() through the DeepSpeed engine; ``loss_factor`` NaN makes the gradients NaN."""
    ds_engine.train()
    mask = (sequences != PAD).long()
    loss = ds_engine(input_ids=sequences, attention_mask=mask, labels=sequences.masked_fill(mask == 0, -100)).loss
    ds_engine.backward(loss * loss_factor)
    ds_engine.step()


def test_a_raw_step_that_deepspeed_skipped_or_that_ended_no_accumulation_refreshes_nothing():
    """Only a step that changed the weights costs a refresh (a gather of the whole model under ZeRO-3): not one that
    DeepSpeed skipped on NaN gradients (ZeRO-2 in fp32 checks them), nor a step() inside an accumulation."""
    import deepspeed

    from dschat.utils.dist import ensure_distributed

    ensure_distributed()
    model = _lora_model(seed=2)
    config = ds_config(stage=2)
    config["gradient_accumulation_steps"] = 2
    ds_engine, *_ = deepspeed.initialize(model=model, config=config,
                                         model_parameters=[p for p in model.parameters() if p.requires_grad])
    engine = _hybrid(ds_engine)
    weights = engine.inference_weights
    ids, mask = left_padded_batch([5, 2, 4], seed=2)
    first = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert weights.refresh_count == 1

    for _ in range(2):  # a whole accumulation of NaN gradients: its step is skipped
        _raw_micro_step(ds_engine, first, loss_factor=float("nan"))
    assert ds_engine.skipped_steps == 1 and ds_engine.global_steps == 1
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), first)
    assert weights.refresh_count == 1

    _raw_micro_step(ds_engine, first)  # within the accumulation: no optimizer step
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), first)
    assert weights.refresh_count == 1
    _raw_micro_step(ds_engine, first)  # the boundary: applied
    expected = hf_generate(model, ids, mask, MAX_NEW)
    assert not torch.equal(expected, first), "the step changed no answer: the test could not see stale weights"
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), expected)
    assert weights.refresh_count == 2


def test_a_raw_step_reaches_every_hybrid_engine_of_the_deepspeed_engine_and_one_left_after_a_release():
    model = _lora_model(seed=3)
    ds_engine = make_ds_engine(model)
    first, second = _hybrid(ds_engine), _hybrid(ds_engine)
    ids, mask = left_padded_batch([4, 6], seed=3)
    before = first.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(second.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), before)
    train_step(ds_engine, before)
    expected = hf_generate(model, ids, mask, MAX_NEW)
    assert not torch.equal(expected, before), "the step changed no answer: the test could not see stale weights"
    for wrapper in (first, second):
        assert torch.equal(wrapper.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), expected)
    first.release_generation()
    train_step(ds_engine, expected)
    assert torch.equal(ds_engine.module.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW),
                       hf_generate(model, ids, mask, MAX_NEW))


def test_a_step_through_the_hybrid_engine_marks_its_weights_stale_once():
    """The wrapper's own step() marks the weights stale at once (``is_stale`` says so before the next generation);
    the generation after it, which also reads DeepSpeed's step counts, counts that step once, not twice."""
    model = _lora_model(seed=4)
    engine = _hybrid(make_ds_engine(model))
    weights = engine.inference_weights
    ids, mask = left_padded_batch([3, 5], seed=4)
    seq = engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    version = weights.version
    train_step(engine, seq)
    assert weights.is_stale and weights.version == version + 1
    engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert not weights.is_stale and weights.version == version + 1 and weights.refresh_count == 2


# -- weights loaded into the actor's module ------------------------------------------------------------------------
def test_a_load_state_dict_into_the_actor_module_or_its_hf_model_is_seen_by_the_next_generation():
    """engine.module.load_state_dict (a notebook that loads other weights into the actor) left a LoRA actor's merged
    copy as it was: generation went on from the weights before the load."""
    model = _lora_model(seed=5)
    engine = _hybrid(make_ds_engine(model))
    ids, mask = left_padded_batch([5, 3], seed=5)
    first = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    engine.module.load_state_dict(_lora_model(seed=6).state_dict())  # the PEFT model DeepSpeed trains
    expected = hf_generate(model, ids, mask, MAX_NEW)
    assert not torch.equal(expected, first), "the load changed no answer: the test could not see stale weights"
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), expected)
    model.get_base_model().load_state_dict(_lora_model(seed=7).get_base_model().state_dict())  # the HF model in it
    expected = hf_generate(model, ids, mask, MAX_NEW)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), expected)


def test_the_deepspeed_engines_own_load_checkpoint_of_the_module_alone_is_seen_by_the_next_generation(tmp_path):
    """load_module_only=True restores no step counts: only the load into the module says the weights changed."""
    model = _lora_model(seed=10)
    ds_engine = make_ds_engine(model)
    engine = _hybrid(ds_engine)
    ids, mask = left_padded_batch([5, 4], seed=10)
    saved = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    ds_engine.save_checkpoint(str(tmp_path), tag="saved")
    train_step(engine, saved)
    trained = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert not torch.equal(trained, saved), "the step changed no answer: the test could not see stale weights"
    ds_engine.load_checkpoint(str(tmp_path), tag="saved", load_module_only=True)
    assert torch.equal(hf_generate(model, ids, mask, MAX_NEW), saved)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), saved)


def test_a_copy_of_the_actor_module_loads_and_pickles_without_the_engine_and_a_release_removes_the_hooks():
    import pickle

    model = _lora_model(seed=8)
    watched = (model, model.get_base_model())
    hooks_before = [(len(m._load_state_dict_pre_hooks), len(m._load_state_dict_post_hooks)) for m in watched]
    engine = _hybrid(make_ds_engine(model))
    ids, mask = left_padded_batch([4, 2], seed=8)
    engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    weights = engine.inference_weights
    other = _lora_model(seed=9).state_dict()
    copied = copy.deepcopy(engine.module)  # (a reference or EMA copy: TRL's create_reference_model)
    copied.load_state_dict(other)
    assert not weights.is_stale, "a load into a copy of the module marked the actor's engine stale"
    # (DeepSpeed's own forward hooks keep the module from pickling: the hook alone, as a pickled module would hold it)
    hook = next(h for h in model._load_state_dict_post_hooks.values() if type(h).__name__ == "_LoadMarksStale")
    pickle.loads(pickle.dumps(hook))(copied, None)
    assert not weights.is_stale
    hook(model, None)
    assert weights.is_stale
    hooks = [(len(m._load_state_dict_pre_hooks), len(m._load_state_dict_post_hooks)) for m in watched]
    assert hooks == [(pre + 1, post + 1) for pre, post in hooks_before]
    engine.release_generation()
    assert [(len(m._load_state_dict_pre_hooks), len(m._load_state_dict_post_hooks)) for m in watched] == hooks_before


# -- module surgery on the actor ------------------------------------------------------------------------------------
def _params(module):
    return list(module.parameters())


def _same_objects(a, b):
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@pytest.mark.parametrize("lora", [True, False], ids=["lora_copy", "training_module"])
def test_a_load_state_dict_with_assign_into_the_actor_is_refused_before_anything_is_loaded(lora):
    """load_state_dict(sd, assign=True) put the state dict's tensors in place of the actor's parameters: a LoRA actor's
    merged copy kept generating from the old ones, and DeepSpeed's optimizer kept training them (the new ones never
    moved; ZeRO-2's next step failed with an IndexError). It is refused, into the PEFT model or the HF model in it,
    with nothing loaded; a copy of the module (no actor) loads with assign=True."""
    model = _lora_model(seed=21) if lora else tiny_model("llama", seed=21)
    engine = _hybrid(make_ds_engine(model))
    ids, mask = left_padded_batch([5, 3], seed=21)
    first = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    params = _params(model)
    values = [p.detach().clone() for p in params]
    other = _lora_model(seed=22) if lora else tiny_model("llama", seed=22)
    pairs = {id(m): (m, o) for m, o in ((model, other), (unwrap_peft(model), unwrap_peft(other)))}  # (one if no PEFT)
    for target, source in pairs.values():
        with pytest.raises(ValueError, match=r"assign=True\) into the hybrid engine's actor would replace its "
                                             r"parameters.*Load without assign=True.*nothing was loaded"):
            target.load_state_dict({k: v.detach().clone() for k, v in source.state_dict().items()}, assign=True)
    assert _same_objects(_params(model), params)
    assert all(torch.equal(p, v) for p, v in zip(params, values))
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), first)
    copied = copy.deepcopy(engine.module)  # (a reference or EMA copy)
    copied.load_state_dict({k: v.detach().clone() for k, v in other.state_dict().items()}, assign=True)


def _resize_token_embeddings(model):
    model.resize_token_embeddings(128)


def _merge_and_unload(model):
    model.merge_and_unload()


def _assign_into_a_submodule(model):
    q_proj = unwrap_peft(model).model.layers[0].self_attn.q_proj
    q_proj = getattr(q_proj, "base_layer", q_proj)
    q_proj.load_state_dict({"weight": torch.randn_like(q_proj.weight)}, assign=True)


SURGERIES = {"resize_token_embeddings": (_resize_token_embeddings, r"lm_head"),
             "merge_and_unload": (_merge_and_unload, r"model\.layers\.0\.self_attn\.q_proj"),
             "assign_into_a_submodule": (_assign_into_a_submodule,
                                         r"model\.layers\.0\.self_attn\.q_proj\.(base_layer\.)?weight")}


@pytest.mark.parametrize("surgery,lora", [(surgery, lora) for surgery in sorted(SURGERIES) for lora in (True, False)
                                           if lora or surgery != "merge_and_unload"])
def test_module_surgery_on_the_actor_after_the_engine_was_built_is_refused_at_the_next_eval_and_generate(surgery, lora):
    """A module or parameter of the actor replaced after deepspeed.initialize (resize_token_embeddings, PEFT's
    merge_and_unload, a load with assign=True into a submodule) left the LoRA copy reading the old parameters (after
    merge_and_unload it merged the adapters a second time), and DeepSpeed's optimizer training them: silent. The next
    eval() and generate say which one was replaced; nothing else is generated from."""
    do, replaced = SURGERIES[surgery]
    model = _lora_model(seed=23) if lora else tiny_model("llama", seed=23)
    engine = _hybrid(make_ds_engine(model))
    ids, mask = left_padded_batch([4, 6], seed=23)
    engine.eval()
    engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    do(model)
    message = rf"the actor's '\S*{replaced}' is no longer the one DeepSpeed's optimizer and this engine were built with"
    with pytest.raises(RuntimeError, match=message):
        engine.eval()
    with pytest.raises(RuntimeError, match=message):
        engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)


def test_module_surgery_then_train_without_generating_is_refused_when_the_train_phase_begins():
    """Surgery was refused at eval() and generate alone: a loop that went on to train() without generating had
    DeepSpeed's optimizer train the old parameter, silently. The train() that begins a train phase refuses it, naming
    it, before the engine leaves eval mode; with the parameter put back, training goes on."""
    model = tiny_model("llama", seed=26)
    engine = _hybrid(make_ds_engine(model))
    ids, mask = left_padded_batch([4, 6], seed=26)
    engine.eval()
    engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    q_proj = model.model.layers[0].self_attn.q_proj
    weight = q_proj._parameters["weight"]
    _assign_into_a_submodule(model)
    with pytest.raises(RuntimeError, match=r"the actor's 'model\.layers\.0\.self_attn\.q_proj\.weight' is no longer"):
        engine.train()
    assert not model.training
    q_proj._parameters["weight"] = weight
    engine.train()
    assert model.training


def test_a_parameter_replaced_in_a_new_table_of_its_module_is_refused_and_the_new_table_alone_is_not():
    """DeepSpeed may put a new ``_parameters`` table in a module after the engine was built (ZeRO-3's
    ensure_zero_ordered_dict): the check read the table it had seen at the build, so a parameter replaced in the new
    one went unseen. The same parameters in a new table are no surgery."""
    model = tiny_model("llama", seed=24)
    engine = _hybrid(make_ds_engine(model))
    ids, mask = left_padded_batch([3, 5], seed=24)
    engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    o_proj = model.model.layers[1].self_attn.o_proj
    o_proj._parameters = dict(o_proj._parameters)
    engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    o_proj._parameters["weight"] = torch.nn.Parameter(o_proj.weight.detach().clone())
    with pytest.raises(RuntimeError, match=r"the actor's 'model\.layers\.1\.self_attn\.o_proj\.weight' is no longer"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=4)


def test_under_zero3_on_several_ranks_surgery_on_another_rank_alone_stops_this_rank_too(monkeypatch):
    """Under ZeRO-3 the refresh gathers over the world: a parameter replaced on one rank alone raised there only,
    and the other ranks went on into the gather, waiting for ever (or paired with that rank's next call). The ranks
    agree on it in the weight check's all-reduce: this rank, whose parameters are in place, raises too, at eval()
    and at generate, before any gather (the other rank is simulated: one process)."""
    from dschat.hybrid_engine import engine as engine_module

    engine = _hybrid(make_ds_engine(tiny_model("llama", seed=25), 3))
    ids, mask = left_padded_batch([4, 2], seed=25)
    engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    refreshes = engine.inference_weights.refresh_count
    asked = []

    def ranks_agree_on(meeting, flags, device, group=None):  # rank 1's parameters are not in place (this is rank 0)
        asked.append((meeting, tuple(flags)))
        mine = [None if flag else 0 for flag in flags]
        return [*mine[:-1], 1] if meeting != "generate()" else mine

    monkeypatch.setattr(engine_module, "_world_size", lambda: 2)
    monkeypatch.setattr(engine_module, "_ranks_agree_on", ranks_agree_on)
    engine.mark_weights_stale()  # (nothing is gathered once the ranks know)
    message = r"on another rank, rank 1 \(the lowest if several\), a parameter of the actor \(its error names it\)"
    with pytest.raises(RuntimeError, match=message):
        engine.eval()
    with pytest.raises(RuntimeError, match=message):
        engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert engine.inference_weights.refresh_count == refreshes
    assert asked == [("eval()", (False, True)), ("generate()", (True,)), ("generate()'s weight check", (False, True))]


def test_under_zero3_on_several_ranks_a_copy_stale_on_another_rank_alone_is_refreshed_on_every_rank(monkeypatch):
    """The refresh gathers over the world: a load on rank 0 alone (into GatheredParameters(modifier_rank=0), the
    usual way to load under ZeRO-3) marked rank 0's copy stale only, and rank 0 would gather alone. The ranks now
    agree: this rank's copy, fresh here, is refreshed since another rank's is stale (the other rank is simulated:
    one process)."""
    from dschat.hybrid_engine import engine as engine_module

    engine = _hybrid(make_ds_engine(tiny_model("llama", seed=9), 3))
    ids, mask = left_padded_batch([4, 2], seed=9)
    engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    weights = engine.inference_weights
    assert weights.refresh_count == 1
    answers = []  # what the other rank answers: its arguments are fine (the first question), its copy is stale

    def ranks_agree_on(meeting, flags, device, group=None):  # (this is rank 0, the other rank 1)
        first, *rest = flags  # (the weight check's second flag, its parameters in place, as this rank's)
        return [None if first and answers.pop(0) else 1, *(None if flag else 0 for flag in rest)]

    monkeypatch.setattr(engine_module, "_world_size", lambda: 2)
    monkeypatch.setattr(engine_module, "_ranks_agree_on", ranks_agree_on)
    answers[:] = [True, True]
    engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert weights.refresh_count == 1 and not answers
    answers[:] = [True, False]
    engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert weights.refresh_count == 2 and not answers


# -- in-place writes into the actor's parameters -------------------------------------------------------------------
def _write_under_no_grad(param, value):
    with torch.no_grad():
        param.copy_(value)


def _rebind_data(param, value):
    param.data = value.clone()


@pytest.mark.parametrize("write", [_write_under_no_grad, _rebind_data], ids=["no_grad_copy", "data_rebound"])
@pytest.mark.parametrize("stage", [0, 2])
def test_an_in_place_write_into_a_lora_actors_parameters_is_seen_by_the_next_generation(stage, write):
    """A copy into the actor's parameters (an EMA or reference model's weights written back, a reset) left the LoRA
    actor's merged copy as it was, without mark_weights_stale(): generation went on from the weights before the
    write. A base weight LoRA adapts, a LoRA matrix and a weight the copy shares with training are written in turn;
    a generation with nothing written refreshes nothing."""
    model = _lora_model(seed=11)
    engine = _hybrid(make_ds_engine(model, stage))
    weights = engine.inference_weights
    ids, mask = left_padded_batch([5, 3, 6], seed=11)
    answer = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), answer)
    assert weights.refresh_count == 1
    other = dict(_lora_model(seed=12).named_parameters())
    named = dict(model.named_parameters())
    for name in ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
                 "base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight",
                 "base_model.model.model.layers.0.mlp.up_proj.weight"):
        write(named[name], other[name].detach())
        expected = hf_generate(model, ids, mask, MAX_NEW)
        assert not torch.equal(expected, answer), f"writing {name} changed no answer: the test could not see it"
        answer = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
        assert torch.equal(answer, expected), name
    refreshes = weights.refresh_count
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), answer)
    assert weights.refresh_count == refreshes


@pytest.mark.parametrize("idiom", ["data_copy", "no_grad_copy"])
def test_under_zero3_a_write_inside_gathered_parameters_is_seen_by_the_next_generation(idiom):
    """ZeRO-3 writes go through GatheredParameters(modifier_rank=...), whose repartition writes each rank's shard so
    that its version moves, even for ``p.data.copy_``; the pinned copy generated from the weights before."""
    import deepspeed

    model = tiny_model("llama", seed=13)
    reference = copy.deepcopy(model)
    ds_engine = make_ds_engine(model, 3)
    engine = _hybrid(ds_engine)
    weights = engine.inference_weights
    assert weights.kind == "pinned_copy"
    ids, mask = left_padded_batch([4, 6], seed=13)
    first = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    other = dict(tiny_model("llama", seed=14).named_parameters())
    param = dict(ds_engine.module.named_parameters())["model.layers.0.self_attn.o_proj.weight"]
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        if idiom == "data_copy":
            param.data.copy_(other["model.layers.0.self_attn.o_proj.weight"].data)
        else:
            _write_under_no_grad(param, other["model.layers.0.self_attn.o_proj.weight"])
    expected = _reference_generate(ds_engine, reference, ids, mask)
    assert not torch.equal(expected, first), "the write changed no answer: the test could not see stale weights"
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), expected)
    refreshes = weights.refresh_count
    engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert weights.refresh_count == refreshes  # (the refresh's own gather writes nothing)


@pytest.mark.parametrize("stage", [0, 2])
def test_a_write_through_p_data_leaves_no_mark_and_misses_only_the_tensors_the_lora_copy_owns(stage):
    """The limit README states, pinned: p.data.copy_ outside ZeRO-3 moves neither the parameter's version counter nor
    its storage (each .data is a new tensor whose own counter starts at 0), so no host-side mark sees it (should torch
    ever keep one, write_mark must read it: this test then fails). A weight the LoRA copy shares with training follows
    anyway (same storage); an adapted one, merged into the copy, stays behind until mark_weights_stale()."""
    from dschat.hybrid_engine.weights import write_mark

    model = _lora_model(seed=25)
    engine = _hybrid(make_ds_engine(model, stage))
    weights = engine.inference_weights
    ids, mask = left_padded_batch([5, 2, 4], seed=25)
    first = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    named, other = dict(model.named_parameters()), dict(_lora_model(seed=26).named_parameters())
    shared = "base_model.model.model.layers.0.mlp.up_proj.weight"
    mark = write_mark(named[shared])
    named[shared].data.copy_(other[shared].data)
    assert write_mark(named[shared]) == mark and named[shared].data._version == 0
    expected = hf_generate(model, ids, mask, MAX_NEW)
    assert not torch.equal(expected, first), "the write changed no answer: the test could not see stale weights"
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), expected)
    adapted = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    named[adapted].data.copy_(other[adapted].data)
    written = hf_generate(model, ids, mask, MAX_NEW)
    assert not torch.equal(written, expected), "the write changed no answer: the test could not see stale weights"
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), expected)  # behind
    assert weights.refresh_count == 1
    engine.mark_weights_stale()
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), written)


@pytest.mark.parametrize("stage", [0, 2])
def test_dschat_check_weights_finds_a_write_through_p_data_says_it_and_refreshes(stage, monkeypatch):
    """p.data.copy_ outside ZeRO-3 bumps no version counter and moves no storage: the engine cannot see it and a LoRA
    actor's merged copy stays behind without mark_weights_stale(). DSCHAT_CHECK_WEIGHTS=1 compares the training
    tensors' checksums at each generation: the write is said (naming a tensor) and the copy refreshed; nothing
    written, nothing said and no refresh."""
    import warnings

    monkeypatch.setenv("DSCHAT_CHECK_WEIGHTS", "1")
    model = _lora_model(seed=15)
    engine = _hybrid(make_ds_engine(model, stage))
    weights = engine.inference_weights
    ids, mask = left_padded_batch([4, 6, 2], seed=15)
    first = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no warning: nothing was written)
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), first)
    assert weights.refresh_count == 1
    name = "base_model.model.model.layers.1.self_attn.v_proj.base_layer.weight"
    dict(model.named_parameters())[name].data.copy_(dict(_lora_model(seed=16).named_parameters())[name].data)
    expected = hf_generate(model, ids, mask, MAX_NEW)
    assert not torch.equal(expected, first), "the write changed no answer: the test could not see stale weights"
    with pytest.warns(RuntimeWarning, match=r"DSCHAT_CHECK_WEIGHTS: 1 training tensor.*model\.layers\.1\.self_attn"
                                            r"\.v_proj\.weight.*mark_weights_stale"):
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), expected)
    assert weights.refresh_count == 2


@pytest.mark.parametrize("through", ["hybrid_engine", "raw_deepspeed_engine"])
def test_dschat_check_weights_says_nothing_of_an_optimizer_steps_own_writes(through, monkeypatch):
    """DeepSpeed's optimizer steps write the weights through .data (ZeRO-2's here), leaving no write mark: with
    DSCHAT_CHECK_WEIGHTS=1 the generation after each step compared checksums too, and warned that the step's own
    writes were unseen ones (every PPO iteration of a run, making the warning meaningless). A copy a step already made
    stale is refreshed without that check; the next generation from the stepped weights is right and says nothing."""
    import warnings

    monkeypatch.setenv("DSCHAT_CHECK_WEIGHTS", "1")
    model = _lora_model(seed=17)
    ds_engine = make_ds_engine(model, 2)
    engine = _hybrid(ds_engine)
    weights = engine.inference_weights
    ids, mask = left_padded_batch([5, 2, 6], seed=17)
    first = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    train_step(engine if through == "hybrid_engine" else ds_engine, first)
    expected = hf_generate(model, ids, mask, MAX_NEW)
    assert not torch.equal(expected, first), "the step changed no answer: the test could not see stale weights"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), expected)
    assert weights.refresh_count == 2
