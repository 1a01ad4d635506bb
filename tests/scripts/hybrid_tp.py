"""2 ranks, inference_tp_size=2: both ranks form one tensor-parallel group, each holding half of every split layer.

Checks, for a GQA Llama (2 key/value heads: split), an MQA Llama (1 key/value head: replicated), OPT (no plan in
transformers: split by projection names) and a GQA Llama with LoRA adapters (merged, then sliced), under ZeRO-0 and
ZeRO-3, and for the fused q/k/v projections of dschat's plans (Falcon multi-query, also under ZeRO-3; Falcon with
ALiBi; Falcon's new_decoder_architecture; GPTBigCode with and without multi-query; Bloom; GPT-2's Conv1D layers and
all-queries-then-keys-then-values c_attn; Phi-3's packed qkv_proj and gate_up_proj) under ZeRO-0:
* greedy answers equal HF ``generate`` on the unsplit model (= inference_tp_size 1), although the ranks' prompt
  batches differ in rows and length and rank 0's answers end long before rank 1's; again after an optimizer step;
* each rank's copy holds half of the split weights;
* sampling is the group leader's: rank 1's own generator seed does not change anything, rank 0's does;
* ``return_logprobs`` gives each rank its rows' log-probabilities, equal to the unsplit model's forward (greedy, and
  sampled at temperature 0.7: of softmax(logits / 0.7));
* (GQA Llama) greedy answers with a repetition penalty equal HF's on the unsplit model, eager and in the graph step.

Run by tests/test_hybrid_engine_tp.py through the deepspeed launcher, several (stage, families) runs in one launch
(the launcher and the ranks' start take ~20 s each time):  hybrid_tp.py --runs 0:llama,opt 3:llama
With ``--release``, first: releasing an engine destroys its group's process group, and an engine built afterwards works.
With ``--surgery``: a parameter replaced on rank 0 alone stops both ranks' generate, rank 0's error naming it, rank 1's
naming rank 0 (also where rank 0's arguments are refused in the same call), and both ranks' train() with no generate
before it; a generate on rank 0 alone is caught at rank 1's next train().
With ``--recurrent-gemma``: RecurrentGemma's rows of each prompt length generate together across the group, as alone.
"""
import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_common import (PAD, answer_logprobs_and_live, check_refresh_after_step,  # noqa: E402
                           biased_recurrent_gemma, check_surgery_on_rank_0_refused, ds_config, early_token,
                           hf_generate, hf_generate_alone, make_ds_engine, rank_0_replaces, tiny_model, train_step)
from hybrid_zero3 import build_zero3_actor, rank_prompts  # noqa: E402

MAX_NEW = 20
NUM_LAYERS = 2
# a seed whose rank-0 answers give an EOS that rank 1's never emit (expected_answers); 31 where it does
SEEDS = {"falcon_alibi": 32}


def reference_model(family):
    if family == "llama-lora":
        return with_lora(tiny_model("llama", seed=31, num_layers=NUM_LAYERS))
    if family == "llama-mqa":
        model = tiny_model("llama", seed=31, num_layers=NUM_LAYERS)
        config = copy.deepcopy(model.config)
        config.num_key_value_heads = 1
        torch.manual_seed(31)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
        model.generation_config.eos_token_id = None
        return model.eval()
    if family == "olmo2":
        # transformers' plan replicates Olmo2's attention (q/k norms over all heads): only the MLP is split, and the
        # KV cache holds every key/value head on every rank
        from transformers import AutoModelForCausalLM, Olmo2Config

        torch.manual_seed(31)
        config = Olmo2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             bos_token_id=None, eos_token_id=None, pad_token_id=None)
        model = AutoModelForCausalLM.from_config(config)
        model.generation_config.eos_token_id = None
        return model.eval()
    model = tiny_model(family, seed=SEEDS.get(family, 31), num_layers=NUM_LAYERS)
    # zero.Init's from_config would zero the padding row of an empty embedding shard; the weights are copied in anyway.
    model.config.pad_token_id = None
    return model.eval()


def unsplittable_model():
    """A family inference tensor parallelism refuses: CTRL (no plan, projections named Wq, Wk, Wv, dense)."""
    from transformers import AutoModelForCausalLM, CTRLConfig

    torch.manual_seed(31)
    return AutoModelForCausalLM.from_config(CTRLConfig(vocab_size=96, n_embd=64, n_layer=1, n_head=4, dff=128)).eval()


def lora_config():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                           init_lora_weights=False)


def with_lora(reference):
    """The reference wrapped in (non-zero) LoRA adapters: the copy merges them, then slices the merged weights."""
    import peft

    torch.manual_seed(32)
    return peft.get_peft_model(reference, lora_config()).eval()


def build_actor(reference, stage, lora):
    if stage == 3:
        return build_zero3_actor(reference, lora_config() if lora else None, ds_config(stage=3, lr=5e-2), "layer")
    return make_ds_engine(copy.deepcopy(reference), stage=stage, lr=5e-2)


def expected_answers(reference, ids, mask, world):
    """HF greedy answers with an EOS that rank 0's rows emit within 3 steps and rank 1's never do."""
    no_eos = hf_generate(reference, ids, mask, MAX_NEW)[:, ids.shape[1]:]
    answers = [None] * world
    dist.all_gather_object(answers, no_eos.tolist())
    eos = early_token(answers[0][0], avoid=[t for row in answers[1] for t in row])
    assert eos is not None, "no usable EOS token for this seed"
    return eos, hf_generate(reference, ids, mask, MAX_NEW, eos_token_id=eos)


def check_split(engine, reference):
    """Every split linear of the copy holds half of the reference's rows or columns (a fused q/k/v projection: its
    half of the query heads and the key/value heads they read)."""
    plan = engine.inference_weights.shard_plan
    assert plan is not None and plan.styles, "no layer was split"
    reference = reference.get_base_model() if hasattr(reference, "get_base_model") else reference
    model = engine.inference_weights.model
    for name, style in plan.styles.items():
        full = reference.get_submodule(name).weight
        mine = model.get_submodule(name).weight
        # transformers' Conv1D (GPT-2) stores its weight (in, out)
        out_dim = 1 if type(model.get_submodule(name)).__name__ == "Conv1D" else 0
        if style == "colwise_stacked_pair":  # Phi-3's gate_up_proj: half of each half
            assert mine.shape[out_dim] * 2 == full.shape[out_dim], name
            continue
        if style in ("colwise_qkv", "colwise_stacked_qkv"):
            rows = (plan.local_heads + 2 * plan.local_kv_heads) * plan.layout.head_dim
            assert mine.shape[out_dim] == rows and mine.shape[1 - out_dim] == full.shape[1 - out_dim], name
            assert plan.local_heads * 2 == plan.layout.num_heads, name
            continue
        dim = out_dim if style == "colwise" else 1 - out_dim
        # MQA: the one key/value head is kept whole on both ranks.
        replicated_kv = style == "colwise" and plan.layout.num_kv_heads == 1 and full.shape[0] == plan.layout.head_dim
        assert mine.shape[dim] * (1 if replicated_kv else 2) == full.shape[dim], (name, mine.shape, full.shape)


def check_logprobs(engine, reference, ids, mask, eos, expected):
    """The group's decode-step log-probabilities come back to each rank with its own rows and answer length, equal
    to a full forward of the unsplit model over its sequences (up to the row's EOS)."""
    seq, logprobs = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                    return_logprobs=True)
    assert torch.equal(seq, expected)
    full, live = answer_logprobs_and_live(reference, seq, mask, eos)
    assert logprobs.shape == full.shape, (logprobs.shape, full.shape)
    torch.testing.assert_close(logprobs[live], full[live], atol=1e-4, rtol=1e-4)
    # sampled at 0.7 (the group leader's draws): at the sampling temperature, as step 3 scores them
    seq, logprobs = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos,
                                    do_sample=True, temperature=0.7, top_k=0, return_logprobs=True,
                                    generator=torch.Generator().manual_seed(11))
    full, live = answer_logprobs_and_live(reference, seq, mask, eos, temperature=0.7)
    torch.testing.assert_close(logprobs[live], full[live], atol=1e-4, rtol=1e-4)


def check_leader_sampling(engine, ids, mask, rank):
    """Rank 1's generator does not matter; rank 0's decides, for both ranks' answers."""
    def sample(leader_seed, member_seed):
        generator = torch.Generator().manual_seed(leader_seed if rank == 0 else member_seed)
        return engine.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, temperature=1.0, top_k=0,
                               generator=generator)

    first = sample(5, 100)
    assert torch.equal(sample(5, 200), first), "a group member's own generator changed the group's sampling"
    changed = [None, None]
    dist.all_gather_object(changed, not torch.equal(sample(6, 100), first))
    assert any(changed), "the group leader's seed did not change any sample"


def check_group_agrees_on_graphs(engine, ids, mask, eos, expected, rank):
    """The graph path's logic (``capture_graphs=False``: same buffers and steps, not captured) under TP gives the
    eager answers; when one rank has to capture again, both do; a capture failing on rank 1 only makes both ranks
    decode eagerly, still correctly, from then on (without the agreements the ranks would run different collectives:
    warm-up steps against replays, replays against the eager loop)."""
    from dschat.hybrid_engine.graphs import GraphDecoder

    def graph_decoder():
        return GraphDecoder(engine.kv_cache, capture_graphs=False, token_sync=engine.tp.share_tokens,
                            group_agrees=engine._group_agrees)

    engine.graph_decoder = graph_decoder()
    engine.eval()
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert torch.equal(got, expected) and engine.graph_decoder.replays > 0, (rank, got, expected)
    assert engine.graph_decoder.captures == 1
    # rank 1 alone has to capture again (as when its storage moved): the whole group captures with it
    if rank == 1:
        engine.graph_decoder.decoders.clear()
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert torch.equal(got, expected) and engine.graph_decoder.captures == 2, (rank, engine.graph_decoder.captures)

    engine.graph_decoder = graph_decoder()
    if rank == 1:
        def failing_capture(*args, **kwargs):
            raise RuntimeError("capture failed on this rank only")

        engine.graph_decoder._capture = failing_capture
    for _ in range(2):
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
        assert torch.equal(got, expected), (rank, got, expected)
    reason = engine.graph_decoder.disabled_reason or ""
    assert ("failed on this rank only" in reason) if rank == 1 else ("another rank" in reason), (rank, reason)
    assert engine.graph_decoder.replays == 0, "no rank may replay once one rank could not capture"
    engine.graph_decoder = None
    engine.train()


def check_repetition_penalty(engine, reference, ids, mask, rank, world):
    """HF's repetition penalty in the group (the group's prompts are padded to the longest, the penalty's record of
    seen tokens is updated with the shared tokens): each rank's answers are HF's on the unsplit model for its own
    prompts, in the eager loop and in the graph step's logic; ranks asking for different penalties fail together."""
    from dschat.hybrid_engine.graphs import GraphDecoder

    expected = hf_generate(reference, ids, mask, MAX_NEW, repetition_penalty=1.3)
    changed = [None] * world
    dist.all_gather_object(changed, not torch.equal(expected, hf_generate(reference, ids, mask, MAX_NEW)))
    assert any(changed), "the penalty changed no answer: the check could not see it"
    engine.eval()
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, repetition_penalty=1.3)
    assert torch.equal(got, expected), (rank, got, expected)
    engine.graph_decoder = GraphDecoder(engine.kv_cache, capture_graphs=False, token_sync=engine.tp.share_tokens,
                                        group_agrees=engine._group_agrees)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, repetition_penalty=1.3)
    assert torch.equal(got, expected) and engine.graph_decoder.replays > 0, (rank, got, expected)
    engine.graph_decoder = None
    try:
        engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, repetition_penalty=1.3 if rank else 1.2)
    except ValueError as error:
        assert "asked for different generations" in str(error) and "repetition_penalty" in str(error), error
    else:
        raise AssertionError("ranks of one group asked for different repetition penalties: must fail everywhere")
    engine.train()


def check_too_long_fails_on_every_rank(engine, ids, mask, eos):
    """Rank 1's prompts (7 tokens) + 58 new ones exceed max_out_tokens=64, rank 0's (6) do not: the group decides
    together, or rank 0 would wait forever in the collective rank 1 never reaches. Rank 1 says why, rank 0 that
    rank 1 refused."""
    try:
        engine.generate(ids, attention_mask=mask, max_new_tokens=58, eos_token_id=eos)
    except ValueError as error:
        expected = "exceeds hybrid_engine.max_out_tokens=64" if dist.get_rank() else \
            "another rank, rank 1 (the lowest if several), refused its arguments"
        assert expected in str(error), error
    else:
        raise AssertionError("the group's longest prompt + 58 new tokens exceed max_out_tokens: must fail everywhere")


def plan_leaves(engine):
    return {name.rsplit(".", 1)[-1] for name in engine.inference_weights.shard_plan.styles}


def run_case(family, stage, rank, world):
    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig

    reference = reference_model(family)
    ids, mask = rank_prompts(rank)  # rank 0: 2 rows of 6 tokens, rank 1: 3 rows of 7
    eos, expected = expected_answers(reference, ids, mask, world)

    ds_engine = build_actor(reference, stage, lora=family.endswith("-lora"))
    # ZeRO-0 runs also fuse the column-parallel slices that read one input (as "auto" does on CUDA)
    fuse = "on" if stage == 0 else "off"
    engine = HybridEngine(ds_engine, HybridEngineConfig(enabled=True, max_out_tokens=64, inference_tp_size=2,
                                                        tp_gather_partition_size=1), pad_token_id=PAD,
                          fuse_projections=fuse)
    assert engine.tp is not None and engine.tp.ranks == [0, 1]
    expected_kind = "lora_copy_tp2" if family.endswith("-lora") else "pinned_copy_tp2"
    assert engine.inference_weights.kind == expected_kind, engine.inference_weights.kind
    check_split(engine, reference)
    if family == "olmo2":
        plan = engine.inference_weights.shard_plan
        assert not plan.splits_attention and not any("self_attn" in name for name in plan.styles), plan.styles
        assert (plan.local_heads, plan.local_kv_heads) == (4, 2), (plan.local_heads, plan.local_kv_heads)
        assert engine.kv_cache.num_kv_heads == 2, engine.kv_cache.num_kv_heads
    engine.eval()
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=eos)
    assert torch.equal(got, expected), (family, stage, rank, got, expected)
    if fuse == "on" and "q_proj" in plan_leaves(engine):  # the row-parallel projections (all-reduce hooks) stay alone
        fused = {name.rsplit(".", 1)[-1] for name, module in engine.inference_weights.model.named_modules()
                 for group in engine.fusion.groups if module in group.members}
        assert fused >= {"q_proj", "k_proj", "v_proj"} and not fused & {"o_proj", "out_proj", "down_proj", "fc2"}, fused
    check_logprobs(engine, reference, ids, mask, eos, expected)

    check_refresh_after_step(engine, reference, got, ids, mask, MAX_NEW, eos, expected, world)

    check_leader_sampling(engine, ids, mask, rank)
    if family == "llama":
        check_too_long_fails_on_every_rank(engine, ids, mask, eos)
        # the reference holds the trained weights since check_refresh_after_step
        now = hf_generate(reference, ids, mask, MAX_NEW, eos_token_id=eos)
        check_group_agrees_on_graphs(engine, ids, mask, eos, now, rank)
        check_repetition_penalty(engine, reference, ids, mask, rank, world)
    print(f"rank {rank} {family} stage={stage}: OK", flush=True)


def refuse_build(ds_engine, error_type, message, **kwargs):
    """A HybridEngine of 2-rank tensor parallelism around ``ds_engine`` must fail with ``error_type`` saying ``message``."""
    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig

    try:
        HybridEngine(ds_engine, HybridEngineConfig(enabled=True, max_out_tokens=64, inference_tp_size=2),
                     pad_token_id=PAD, **kwargs)
    except error_type as error:
        assert message in str(error), error
    else:
        raise AssertionError(f"built, where {message!r} was expected")


def check_release_destroys_the_group(rank, world):
    """``release_engine`` destroys the engine's tensor-parallel process group (torch kept every one, so a notebook
    building engine after engine added a group each time), and a build that fails destroys the group it made, and a
    released_engines block releases it with the DeepSpeed engine it made; an engine built after the release makes its
    own and generates as the unsplit model; the released engine refuses to generate. Two HybridEngines around one
    DeepSpeed engine in a released_engines block each destroy their group."""
    from torch.distributed import distributed_c10d

    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig
    from dschat.models.training_engine import initialize_frozen, release_engine, released_engines

    reference = reference_model("llama")
    ids, mask = rank_prompts(rank)
    expected = hf_generate(reference, ids, mask, MAX_NEW)
    groups = distributed_c10d._world.pg_map
    # an engine that cannot be built (CTRL: no plan, no projection of a usual name) leaves no group behind either
    ctrl = build_actor(unsplittable_model(), 0, lora=False)
    before = len(groups)  # (after the first DeepSpeed engine: DeepSpeed makes a group of its own, once per process)
    refuse_build(ctrl, NotImplementedError, "no tensor-parallel plan for CTRLLMHeadModel")
    assert len(groups) == before, ("a failed build", before, len(groups))
    release_engine(ctrl)
    # nor one of a model it can split whose settings are refused once the group is made (a misspelt decode_attention)
    llama = build_actor(reference, 0, lora=False)
    refuse_build(llama, ValueError, "decode_attention must be one of", decode_attention="trition")
    assert len(groups) == before, ("a build refusing its settings", before, len(groups))
    release_engine(llama)
    # a released_engines block (a step run's: ppo.main; a notebook engine's whose later model fails to load) releases
    # the engines it made: the DeepSpeed engine, and the group of each HybridEngine around it (a second one's too)
    with released_engines():
        frozen = initialize_frozen(copy.deepcopy(reference), {"train_micro_batch_size_per_gpu": 2,
                                                              "zero_optimization": {"stage": 0}})
        for wrappers in (1, 2):
            HybridEngine(frozen, HybridEngineConfig(enabled=True, max_out_tokens=64, inference_tp_size=2),
                         pad_token_id=PAD)
            assert len(groups) == before + wrappers, ("released_engines", wrappers, before, len(groups))
    assert len(groups) == before, ("released_engines", before, len(groups))
    for build in range(2):
        ds_engine = build_actor(reference, 0, lora=False)
        assert len(groups) == before, (build, before, len(groups))  # the first engine's group is gone
        engine = HybridEngine(ds_engine, HybridEngineConfig(enabled=True, max_out_tokens=64, inference_tp_size=2),
                              pad_token_id=PAD)
        group = engine.tp.group
        assert group in groups and len(groups) == before + 1, (build, before, len(groups))
        engine.eval()
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
        assert torch.equal(got, expected), (build, rank, got, expected)
        release_engine(engine)
        assert group not in groups and len(groups) == before, (build, before, len(groups))
        try:
            engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
        except RuntimeError as error:
            assert "was released" in str(error), error
        else:
            raise AssertionError("a released engine generated")
        dist.barrier()
    print(f"rank {rank} release: OK", flush=True)


def check_surgery_on_rank_0_alone_stops_the_group(rank):
    """A parameter of the actor replaced on rank 0 alone (module surgery after the engine was built), ZeRO-0: rank 0
    raised at its eval() alone, while rank 1 went on into generate's all-reduce with the group and waited there (or
    paired with rank 0's next generate and returned answers). Both ranks' generate now raise, rank 0's naming the
    parameter; with it put back, both generate in step again."""
    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig

    reference = reference_model("llama")
    ids, mask = rank_prompts(rank)
    expected = hf_generate(reference, ids, mask, MAX_NEW)
    ds_engine = build_actor(reference, 0, lora=False)
    engine = HybridEngine(ds_engine, HybridEngineConfig(enabled=True, max_out_tokens=64, inference_tp_size=2),
                          pad_token_id=PAD)
    o_proj = engine.module.model.layers[1].self_attn.o_proj

    def eval_and_generate():
        engine.eval()
        engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)

    with rank_0_replaces(o_proj, rank):
        check_surgery_named_before_arguments_refused_with_it(engine, ids, mask, rank)
        check_surgery_on_rank_0_refused(rank, eval_and_generate)
    engine.eval()
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(got, expected), (rank, got, expected)
    print(f"rank {rank} surgery undone: in step", flush=True)
    check_surgery_before_training_stops_the_group(engine, o_proj, got, rank)
    check_lone_generate_meets_the_others_train(engine, ids, mask, rank)


def check_surgery_before_training_stops_the_group(engine, o_proj, sequences, rank):
    """The same replacement on rank 0 alone, then train() with no generate: the group met at generate alone, so rank 0
    trained (DeepSpeed's optimizer on the old parameter) while rank 1 did not know. The train() that begins a train
    phase is a meeting of the group now: both ranks refuse there; put back, both train in step."""
    with rank_0_replaces(o_proj, rank):
        check_surgery_on_rank_0_refused(rank, engine.train)
    train_step(engine, sequences)
    print(f"rank {rank} surgery before train(): refused by the group", flush=True)


def check_lone_generate_meets_the_others_train(engine, ids, mask, rank):
    """A sample generated on rank 0 alone between iterations (``if rank == 0:`` eval() + generate) pairs with rank
    1's next generate, and rank 0's own next generate met nothing of rank 1's until rank 1's gradient all-reduce: a
    hang. Rank 1's train() meets it now: both ranks stop, each saying which call it is in."""
    if rank == 0:
        engine.eval()
        engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    mine = "generate()" if rank == 0 else "train()"
    try:
        engine.eval()
        engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
        engine.train()
    except RuntimeError as error:
        assert f"out of step: this rank is in {mine} while another" in str(error), (rank, error)
    else:
        raise AssertionError(f"rank {rank}: a generate on rank 0 alone was not caught")
    print(f"rank {rank} lone generate: out of step at train()", flush=True)


def check_surgery_named_before_arguments_refused_with_it(engine, ids, mask, rank):
    """Rank 0, whose parameter is replaced, also asks for too many tokens (past max_out_tokens=64) in the same call:
    rank 1 says that rank 0's error names the replaced parameter, so rank 0's must name it (it raised its
    argument error alone, and no rank's error named the parameter); the argument error is its cause."""
    try:
        engine.generate(ids, attention_mask=mask, max_new_tokens=100 if rank == 0 else MAX_NEW)
    except RuntimeError as error:
        message, cause = str(error), error.__cause__
    else:
        raise AssertionError(f"rank {rank}: a parameter replaced on rank 0 alone was not refused here")
    assert "no longer the one DeepSpeed's optimizer and this engine were built with" in message, (rank, message)
    if rank == 0:
        assert "'model.layers.1.self_attn.o_proj.weight'" in message, message
        assert "exceeds hybrid_engine.max_out_tokens=64" in str(cause), cause
    else:
        assert "on another rank, rank 0 (the lowest if several), a parameter of the actor (its error names it)" \
            in message, message
    print(f"rank {rank} surgery with arguments refused on rank 0: named", flush=True)


def check_recurrent_gemma_groups_prompt_lengths_across_the_group(rank):
    """RecurrentGemma under inference_tp_size 2: the group's gathered batch (both ranks' prompts, left-padded to the
    longest) generates its rows of each prompt length together without their padding (``prompt_length_groups``,
    the same lengths in the same order on both ranks), each rank's split attention and MLP and whole recurrent
    layers. Each rank's greedy answers are its rows' answers alone (HF's generate, one row at a time) token for
    token, and its log-probabilities the one-rank engine's (inference_tp_size 1) on the same prompts."""
    from hybrid_common import left_padded_batch

    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig

    reference = biased_recurrent_gemma()
    lengths = [5, 2] if rank == 0 else [3, 7, 2, 1]  # (the group's lengths: 1, 2, 3, 5, 7; 2 on both ranks)
    ids, mask = left_padded_batch(lengths, seed=40 + rank)
    width = ids.shape[1]

    alone = [hf_generate_alone(reference, ids[row:row + 1, width - n:], MAX_NEW) for row, n in enumerate(lengths)]
    with torch.no_grad():  # (the padding moves the model's scores: a padded generation would show in the log-probs)
        padded = reference(input_ids=ids, attention_mask=mask).logits[:, -1]
        unpadded = torch.cat([reference(input_ids=ids[row:row + 1, width - n:]).logits[:, -1]
                              for row, n in enumerate(lengths)])
    assert (padded - unpadded).abs().max() > 1e-2, "left padding moved no score: the check could not see it"

    def engine_of(tp_size):
        config = HybridEngineConfig(enabled=True, max_out_tokens=64, inference_tp_size=tp_size)
        return HybridEngine(build_actor(reference, 0, lora=False), config, pad_token_id=PAD)

    single = engine_of(1)
    single.eval()
    expected, expected_logprobs = single.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW,
                                                  return_logprobs=True)
    engine = engine_of(2)
    assert engine.inference_weights.shard_plan.splits_attention, engine.inference_weights.shard_plan.styles
    engine.eval()
    got, logprobs = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, return_logprobs=True)
    assert torch.equal(got, expected), (rank, got, expected)
    for row, (n, answer) in enumerate(zip(lengths, alone)):
        assert torch.equal(got[row, width:], answer[0, n:]), (rank, row, got[row], answer)
    torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=1e-5)
    print(f"rank {rank} recurrent_gemma: OK", flush=True)


def main():
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--runs", nargs="+", default=[], metavar="STAGE:FAMILIES",
                        help="each STAGE (0|3) with its comma-separated FAMILIES, in turn, in one launch")
    parser.add_argument("--release", action="store_true",
                        help="(first) check that releasing an engine destroys its tensor-parallel group")
    parser.add_argument("--surgery", action="store_true",
                        help="(first) check that a parameter replaced on rank 0 alone stops both ranks")
    parser.add_argument("--recurrent-gemma", action="store_true",
                        help="(first) check RecurrentGemma's rows grouped by prompt length across the group")
    parser.add_argument("--local_rank", type=int, default=0)  # passed by the deepspeed launcher
    args = parser.parse_args()
    runs = [(int(stage), families.split(",")) for stage, families in (run.split(":") for run in args.runs)]
    assert all(stage in (0, 3) for stage, _ in runs), args.runs

    from dschat.utils.dist import ensure_distributed

    rank, world = ensure_distributed()
    assert world == 2, world
    if args.release:
        check_release_destroys_the_group(rank, world)
    if args.surgery:
        check_surgery_on_rank_0_alone_stops_the_group(rank)
    if args.recurrent_gemma:
        check_recurrent_gemma_groups_prompt_lengths_across_the_group(rank)
    for stage, families in runs:
        for family in families:
            run_case(family, stage, rank, world)
            dist.barrier()
        print(f"rank {rank} stage={stage} {','.join(families)}: ALL OK", flush=True)
    print(f"rank {rank} ALL OK", flush=True)


if __name__ == "__main__":
    from dschat.utils.cli import end_script

    main()
    end_script()  # (a gloo rank aborted in the interpreter's teardown now and then: exit 250)
