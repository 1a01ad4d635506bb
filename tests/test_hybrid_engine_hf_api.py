"""Hybrid engine generate called as HF's generate is: HF's argument names and types, and the generation_config HF
reads (the actor's live one, or a call's own), give HF's greedy tokens or a clear error."""
import copy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import hybrid_common  # noqa: E402
from hybrid_common import PAD, answer_logprobs_and_live, early_token, hf_generate, make_ds_engine  # noqa: E402

from dschat.errors import UsageError  # noqa: E402
from dschat.hybrid_engine import HybridEngine, HybridEngineConfig  # noqa: E402


def _device():
    """The accelerator's device: a DeepSpeed engine moves its model there (the GPU, where these tests also run)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def tiny_model(family, seed):
    return hybrid_common.tiny_model(family, seed=seed).to(_device())


def left_padded_batch(lengths, seed):
    return tuple(t.to(_device()) for t in hybrid_common.left_padded_batch(lengths, seed=seed))


def _engine(model, pad_token_id=PAD):
    return HybridEngine(make_ds_engine(model), HybridEngineConfig(enabled=True, max_out_tokens=32),
                        pad_token_id=pad_token_id)


def test_hf_argument_forms_inputs_keyword_tensor_eos_and_no_pad_at_all():
    model = tiny_model("llama", seed=2)
    engine = _engine(model)
    ids, mask = left_padded_batch([7, 2, 4], seed=2)
    plain = hf_generate(model, ids, mask, 10)
    eos = early_token(plain[0, ids.shape[1]:])
    expected = hf_generate(model, ids, mask, 10, eos_token_id=eos)
    engine.eval()
    assert torch.equal(engine.module.generate(inputs=ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos),
                       expected)  # HF's own name for the prompts
    for eos_form in (torch.tensor(eos), torch.tensor([eos]), np.int64(eos)):
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos_form),
                           expected)
    # neither a pad nor an EOS anywhere: HF generates (nothing is ever padded), and so must the engine
    bare = _engine(tiny_model("llama", seed=2), pad_token_id=None)
    bare.eval()
    assert torch.equal(bare.generate(ids, attention_mask=mask, max_new_tokens=10), plain)
    assert torch.equal(bare.generate(ids, max_new_tokens=10),
                       type(model).generate(bare.module, ids, max_new_tokens=10, do_sample=False))


def test_right_padded_prompts_are_an_error_not_a_wrong_answer():
    """A tokenizer pads on the right by default (dschat's load_tokenizer too): the first answer token of a
    right-padded row would be predicted from a pad, silently (HF's generate only warns)."""
    engine = _engine(tiny_model("gpt2", seed=1))
    ids, mask = left_padded_batch([5, 3, 0], seed=1)  # a row of padding only (an empty prompt) passes
    engine.eval()
    assert engine.generate(ids, attention_mask=mask, max_new_tokens=3).shape[0] == 3
    right_ids, right_mask = ids[:2].flip(1), mask[:2].flip(1)
    with pytest.raises(ValueError, match=r"LEFT-padded, but row\(s\) \[1\].*padding_side='left'"):
        engine.generate(right_ids, attention_mask=right_mask, max_new_tokens=3)
    with pytest.raises(ValueError, match="LEFT-padded"):  # the mask HF's rule derives from the pad ids
        engine.module.generate(right_ids, max_new_tokens=3)


@pytest.mark.parametrize("kwargs, message", [({"top_k": 5.0}, "top_k has to be an integer"),
                                             ({"top_k": "5"}, "top_k has to be an integer"),
                                             ({"top_p": -0.1}, r"top_p has to be in \[0, 1\]")])
def test_a_top_k_that_is_no_integer_or_a_negative_top_p_is_a_clear_error(kwargs, message):
    """HF refuses them; unchecked, a float top_k failed inside torch.topk and a negative top_p sampled greedily."""
    engine = _engine(tiny_model("gpt2", seed=1))
    ids, mask = left_padded_batch([4, 2], seed=1)
    engine.eval()
    with pytest.raises(ValueError, match=message):
        engine.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=True, **kwargs)
    assert engine.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, **kwargs).shape[0] == 2


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {"temperature": float("nan")}, {"top_k": 2.5},
                                    {"repetition_penalty": 0.0}, {"max_new_tokens": 0}])
def test_bad_arguments_fail_before_the_engine_changes_any_state(kwargs):
    """Checked before the train phase ends and the inference weights refresh (a gather under ZeRO-3): a refused call
    leaves the engine as it was."""
    engine = _engine(tiny_model("gpt2", seed=1))
    ids, mask = left_padded_batch([4, 2], seed=1)
    engine.eval()
    engine._refresh_weights = lambda: pytest.fail("the weights refreshed before the arguments were checked")
    before = copy.deepcopy(vars(engine._iteration))
    with pytest.raises(ValueError):
        engine.generate(ids, attention_mask=mask, **{"max_new_tokens": 3, "do_sample": True, **kwargs})
    assert vars(engine._iteration) == before  # the iteration's clock and counts untouched


@pytest.mark.parametrize("kwargs", [{"max_new_tokens": 4.0}, {"max_new_tokens": -1}, {"max_length": 9.5},
                                    {"min_new_tokens": True}, {"min_length": "3"}])
def test_token_counts_that_are_no_integers_are_a_clear_error(kwargs):
    """A float failed deep in the decode loop; a negative max_new_tokens was called a max_length shorter than the
    prompt."""
    engine = _engine(tiny_model("gpt2", seed=1))
    ids, mask = left_padded_batch([4, 2], seed=1)
    engine.eval()
    name = next(iter(kwargs))
    bound = "" if name.startswith("min") else " >= 0"  # (a minimum <= 0 is none, as in HF)
    with pytest.raises(ValueError, match=rf"{name} has to be an integer{bound}, got {kwargs[name]!r}"):
        engine.generate(ids, attention_mask=mask, **{"max_new_tokens": 3, **kwargs})
    counts = {"max_new_tokens": torch.tensor(3), "min_new_tokens": np.int64(1)}  # int-like values are counts
    assert engine.generate(ids, attention_mask=mask, **counts).shape == (2, ids.shape[1] + 3)


def test_trl_ppo_generation_kwargs_and_harmless_hf_kwargs_generate_as_in_hf():
    """TRL's PPO examples pass min_length=-1 and top_k=0.0 (HF: no minimum, no top-k); bos_token_id (HF's prompt when
    none is given) and renormalize_logits (its output scores) leave HF's tokens as they are. All were refused."""
    model = tiny_model("llama", seed=3)
    engine = _engine(model)
    ids, mask = left_padded_batch([5, 3], seed=3)
    expected = hf_generate(model, ids, mask, 6)
    engine.eval()
    for kwargs in ({"min_length": -1}, {"min_new_tokens": -2}, {"bos_token_id": 1}, {"renormalize_logits": True}):
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=6, **kwargs), expected), kwargs
    sampled = {}
    for top_k in (0, 0.0):
        torch.manual_seed(11)
        sampled[top_k] = engine.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=top_k,
                                         top_p=1.0, min_length=-1)
    assert torch.equal(sampled[0], sampled[0.0])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_default_length_stays_within_the_models_positions_as_in_hf(family):
    """No length anywhere: HF generates 20 new tokens, at most up to max_position_embeddings in all. The engine
    generated 20 past it: a learned position table (GPT-2's) failed with an IndexError, rotary ones ran on."""
    config = hybrid_common.tiny_config(family)
    config.max_position_embeddings = 24  # (GPT-2: n_positions)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(_device())
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    engine = _engine(model)
    ids, mask = left_padded_batch([10, 14], seed=1)
    expected = type(model).generate(model.eval(), input_ids=ids, attention_mask=mask, pad_token_id=PAD)
    assert expected.shape[1] == 24
    engine.eval()
    assert torch.equal(engine.generate(ids, attention_mask=mask), expected)


@pytest.mark.parametrize("family", ["opt", "gpt2", "gptj"])
def test_max_new_tokens_past_a_learned_position_table_is_a_clear_error_and_padding_takes_no_position(family):
    """An explicit max_new_tokens past GPT-2's or OPT's learned position table failed with an IndexError from inside
    the model (a device-side assert on CUDA); so did GPT-J's past its precomputed rotary table (a buffer of
    n_positions rows). The last new token is never fed back, so HF generates one past the table; and positions count
    a row's tokens, so a left-padded batch may reach the table's end: the engine does as HF. GPT-J's table is said to be
    precomputed (it was called learned)."""
    config = hybrid_common.tiny_config(family)
    config.max_position_embeddings = 24  # (GPT-2: n_positions)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(_device())
    engine = _engine(model)
    ids, mask = left_padded_batch([10, 14], seed=1)
    table = "precomputed" if family == "gptj" else "learned"
    with pytest.raises(ValueError, match=rf"a prompt of 14 tokens \+ max_new_tokens=12 is past the model's table of "
                                         rf"24 {table} positions: lower max_new_tokens to at most 11"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=12)
    engine.eval()
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=11), hf_generate(model, ids, mask, 11))
    ids, mask = ids[:1, -12:], mask[:1, -12:]  # the 10-token row, left-padded by 2: 10 + 15 tokens
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=15), hf_generate(model, ids, mask, 15))


def test_step_flags_past_gpt_js_rotary_position_table_are_a_flag_error_not_a_warning():
    """Step 3 with a GPT-J actor and --max_prompt_seq_len + --max_answer_seq_len past its n_positions printed a warning
    ('past the 32 positions the model was configured for') and then failed with 'IndexError: index 32 is out of bounds
    for dimension 0 with size 32' from the rotary table (a device-side assert on CUDA); it is a flag error now, as for
    GPT-2's learned table (the table is said to be precomputed: it was called learned)."""
    from dschat.models.loading import check_sequence_fits

    config = hybrid_common.tiny_config("gptj")
    config.max_position_embeddings = 32  # (n_positions)
    with torch.device("meta"):  # as step 3's early checks build the actor (model_skeleton)
        model = AutoModelForCausalLM.from_config(config)
    check_sequence_fits(model, 32, "--max_prompt_seq_len + --max_answer_seq_len")
    with pytest.raises(UsageError, match=r"= 33 tokens, but the model has a table of 32 precomputed positions"):
        check_sequence_fits(model, 33, "--max_prompt_seq_len + --max_answer_seq_len")


@pytest.mark.parametrize("family", ["opt", "gpt2"])
def test_cuda_graph_capture_near_the_end_of_a_learned_position_table_generates_as_hf(family):
    """The graph capture's warm-up fed the loaded prompts' next two positions whatever max_new_tokens was: past
    GPT-2's or OPT's table for a prompt at its end (a device-side assert on CUDA, where this test runs the capture; on
    the CPU the engine decodes eagerly)."""
    config = hybrid_common.tiny_config(family)
    config.max_position_embeddings = 24
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(_device())
    engine = HybridEngine(make_ds_engine(model), HybridEngineConfig(enabled=True, max_out_tokens=32,
                                                                    enable_cuda_graph=True), pad_token_id=PAD)
    ids, mask = left_padded_batch([23, 20], seed=3)
    engine.eval()
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=2), hf_generate(model, ids, mask, 2))


def test_a_generate_inside_inference_mode_leaves_later_calls_working():
    """The KV cache allocated in a caller's torch.inference_mode() was an inference tensor: every later generate
    outside it failed to reset it in place ("Inplace update to inference tensor outside InferenceMode")."""
    model = tiny_model("llama", seed=4)
    engine = _engine(model)
    ids, mask = left_padded_batch([4, 6, 2], seed=9)
    expected = hf_generate(model, ids, mask, 8)
    engine.eval()
    with torch.inference_mode():
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=8), expected)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=8), expected)
    with torch.no_grad():
        assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=8), expected)


def test_no_new_tokens_is_refused_and_a_beam_search_setting_changes_nothing_as_in_hf():
    model = tiny_model("gpt2", seed=1)
    engine = _engine(model)
    ids, mask = left_padded_batch([4, 2], seed=1)
    engine.eval()
    with pytest.raises(ValueError, match="max_new_tokens must be greater than 0"):  # HF's GenerationConfig's check
        engine.generate(ids, attention_mask=mask, max_new_tokens=0)
    with pytest.raises(ValueError, match=rf"max_new_tokens must be greater than 0 \(max_length {ids.shape[1]}"):
        engine.generate(ids, attention_mask=mask, max_length=ids.shape[1])  # a max_length the prompt fills
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=3, early_stopping=True),
                       hf_generate(model, ids, mask, 3, early_stopping=True))


def test_the_call_generation_config_argument_is_honoured_as_in_hf():
    """TRL passes ``generate(input_ids=..., generation_config=GenerationConfig(...))``."""
    model = tiny_model("opt", seed=3)
    engine = _engine(model)
    ids, mask = left_padded_batch([6, 3], seed=3)
    eos = early_token(hf_generate(model, ids, mask, 9)[1, ids.shape[1]:])
    model.generation_config.repetition_penalty = 1.4  # the model's, under the call's config
    expected = hf_generate(model, ids, mask, 9, eos_token_id=eos)
    engine.eval()
    config = GenerationConfig(max_new_tokens=9, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(engine.module.generate(input_ids=ids, attention_mask=mask, generation_config=config), expected)
    with pytest.raises(UsageError, match="no_repeat_ngram_size"):
        engine.generate(ids, attention_mask=mask, generation_config=GenerationConfig(no_repeat_ngram_size=2))


def test_eos_and_pad_of_a_generation_config_win_over_the_engines_tokenizer_ids_as_in_hf():
    """Qwen2.5-Instruct and Llama-3-Instruct list a second EOS id in their generation_config; HF stops on it. The
    engine's own ids (its tokenizer's, as step 3 builds it) apply only where neither the call nor a config sets one."""
    model = tiny_model("llama", seed=4)
    ids, mask = left_padded_batch([6, 3], seed=4)
    plain = hf_generate(model, ids, mask, 10)
    own_eos = early_token(plain[0, ids.shape[1]:], steps=(5, 6, 7))
    extra_eos = early_token(plain[1, ids.shape[1]:], avoid=[own_eos])
    engine = HybridEngine(make_ds_engine(model), HybridEngineConfig(enabled=True, max_out_tokens=32),
                          pad_token_id=PAD, eos_token_id=own_eos)
    engine.eval()
    # the engine's own ids alone
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=10),
                       hf_generate(model, ids, mask, 10, eos_token_id=own_eos))
    # the model's generation_config, and a call's generation_config, list both: HF stops on either, pads with theirs
    both = hf_generate(model, ids, mask, 10, eos_token_id=[own_eos, extra_eos], pad_token_id=PAD + 1)
    assert not torch.equal(both, plain)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = [own_eos, extra_eos], PAD + 1
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=10), both)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    config = GenerationConfig(max_new_tokens=10, eos_token_id=[own_eos, extra_eos], pad_token_id=PAD + 1)
    assert torch.equal(engine.generate(ids, attention_mask=mask, generation_config=config), both)
    # the call's own keywords win over every config
    assert torch.equal(engine.generate(ids, attention_mask=mask, generation_config=config, eos_token_id=own_eos,
                                       pad_token_id=PAD), hf_generate(model, ids, mask, 10, eos_token_id=own_eos))


def test_generation_config_changed_after_the_engine_was_built_counts_with_an_inference_copy():
    """A LoRA actor generates from a merged copy whose generation_config was a snapshot: HF reads the actor's."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_hybrid_engine_lora import lora_model

    model = lora_model("llama", seed=1).to(_device())
    engine = _engine(model)
    assert engine.inference_weights.model is not engine.module
    ids, mask = left_padded_batch([5, 3], seed=6)
    unpenalised = hf_generate(model, ids, mask, 10)
    model.get_base_model().generation_config.repetition_penalty = 1.5
    expected = hf_generate(model, ids, mask, 10)
    assert not torch.equal(expected, unpenalised)
    engine.eval()
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=10), expected)


@pytest.mark.parametrize("key,value", [("suppress_tokens", [5]), ("bad_words_ids", [[5]]), ("forced_eos_token_id", 5),
                                       ("sequence_bias", {(5,): -9.0}), ("begin_suppress_tokens", [5])])
def test_generation_config_settings_hf_applies_and_the_decode_does_not_are_refused(key, value):
    model = tiny_model("gpt2", seed=1)
    engine = _engine(model)
    ids, mask = left_padded_batch([3], seed=1)
    setattr(model.generation_config, key, value)
    with pytest.raises(UsageError, match=f"generation_config sets {key}="):
        engine.generate(ids, attention_mask=mask, max_new_tokens=3)


def test_ranks_that_generate_together_agree_on_their_arguments_over_the_world_under_zero3(monkeypatch):
    """Under ZeRO-3 the weight gather spans every rank, so the agreement does too (with tensor-parallel groups as
    well: a group agreeing alone left the other groups waiting in the gather); otherwise the group's ranks agree. Any
    error of this rank is agreed on before it is raised."""
    from types import SimpleNamespace

    from dschat.hybrid_engine import engine as hybrid

    asked = []

    def ranks_agree_on(meeting, flags, device, group):  # rank 1's arguments were refused, its parameters not
        asked.append((meeting, tuple(flags), group))
        return [1, *[None] * (len(flags) - 1)]

    monkeypatch.setattr(hybrid, "_world_size", lambda: 4)
    monkeypatch.setattr(hybrid, "_ranks_agree_on", ranks_agree_on)

    def engine_at(stage, tp=None):
        return SimpleNamespace(tp=tp, _engine=SimpleNamespace(zero_optimization_stage=lambda: stage),
                               _parameter_places=SimpleNamespace(replaced=lambda: None))

    tp = SimpleNamespace(group="the tp group")
    # (a group without ZeRO-3 agrees on module surgery too: no other meeting of it could)
    for fake, flags, group in ((engine_at(3, tp), (True,), None), (engine_at(2, tp), (True, True), "the tp group"),
                               (engine_at(3), (True,), None)):
        with pytest.raises(ValueError, match=r"another rank, rank 1 \(the lowest if several\), refused its arguments"):
            with hybrid.HybridEngine._failing_together(fake, "cpu"):
                pass  # this rank's arguments are fine; another's were not (ranks_agree_on says False)
        assert asked[-1] == ("generate()", flags, group)
    with pytest.raises(TypeError, match="this rank's"):
        with hybrid.HybridEngine._failing_together(engine_at(3), "cpu"):
            raise TypeError("this rank's")
    assert asked[-1] == ("generate()", (False,), None)
    asked.clear()
    with hybrid.HybridEngine._failing_together(engine_at(2), "cpu"):  # ZeRO 0-2, no group: nothing to agree on
        pass
    assert asked == []


def _agreed_on_two_ranks(monkeypatch, flags_by_rank, meeting="generate()'s weight check"):
    """What ``_ranks_agree_on`` returns on each of two ranks (threads) whose flags are ``flags_by_rank``, through an
    all-reduce faked as the MIN of both ranks' tensors."""
    import threading

    import torch.distributed as dist

    from dschat.hybrid_engine import engine as hybrid

    barrier, sent, where = threading.Barrier(2, timeout=30), {}, threading.local()

    def all_reduce(t, op, group=None):
        assert op == dist.ReduceOp.MIN and group is None and t.dtype == torch.int32 and t.shape == (4,), (op, t)
        sent[where.rank] = t.clone()
        barrier.wait()
        torch.minimum(sent[0], sent[1], out=t)
        barrier.wait()  # (before either rank's next reduce overwrites what it sent)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: where.rank)
    agreed = {}

    def rank(number):
        where.rank = number
        agreed[number] = hybrid._ranks_agree_on(meeting, flags_by_rank[number], "cpu")

    threads = [threading.Thread(target=rank, args=(number,)) for number in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return agreed[0], agreed[1]


def test_ranks_agree_on_each_flag_naming_the_lowest_rank_where_it_is_unset(monkeypatch):
    """Each rank learns, for each flag, the lowest global rank where it is unset (None where it is set on every
    rank): a rank whose parameters are in place says which rank's were replaced (its error names the parameter),
    where it only learned that some rank's were. Still one int32 all-reduce of the same size in every meeting (2 ranks
    simulated by threads; the flags: copy fresh, parameters in place)."""
    for flags, expected in (([(True, True), (True, False)], [None, 1]),  # rank 1's parameter replaced
                            ([(False, True), (True, True)], [0, None]),  # rank 0's copy stale
                            ([(False, False), (True, False)], [0, 0]),  # both replaced: the lowest
                            ([(True, True), (True, True)], [None, None])):
        assert _agreed_on_two_ranks(monkeypatch, flags) == (expected, expected), flags
    # a meeting with one flag reduces as many (the rest set): still None or a rank for its own flag alone
    assert _agreed_on_two_ranks(monkeypatch, [(True,), (False,)], meeting="train()") == ([1], [1])


def test_in_a_tensor_parallel_group_the_rank_with_a_replaced_parameter_names_it_before_its_argument_error(
        monkeypatch):
    """ZeRO 0-2, a tensor-parallel group: the ranks agree on module surgery in generate's argument all-reduce. A rank
    whose parameter was replaced and whose arguments were refused in the same call raised its argument error alone,
    while the other ranks said that its error names the parameter: it names it now, the argument error its cause. A
    rank with its parameters in place raises its own argument error, or else that another rank's parameter was
    replaced (the group is simulated: one process)."""
    from types import SimpleNamespace

    from dschat.hybrid_engine import engine as hybrid

    monkeypatch.setattr(hybrid, "_world_size", lambda: 2)
    # rank 1 refused its arguments and a parameter was replaced there (and on this rank too where it names one)
    monkeypatch.setattr(hybrid, "_ranks_agree_on", lambda meeting, flags, device, group: [1, 1])

    def rank(replaced):
        return SimpleNamespace(tp=SimpleNamespace(group="the tp group"),
                               _engine=SimpleNamespace(zero_optimization_stage=lambda: 2),
                               _parameter_places=SimpleNamespace(replaced=lambda: replaced))

    with pytest.raises(RuntimeError, match=r"the actor's 'lm_head\.weight' is no longer the one") as raised:
        with hybrid.HybridEngine._failing_together(rank("lm_head.weight"), "cpu"):
            raise ValueError("this rank's prompt is too long")
    assert isinstance(raised.value.__cause__, ValueError)
    with pytest.raises(ValueError, match="this rank's prompt is too long"):
        with hybrid.HybridEngine._failing_together(rank(None), "cpu"):
            raise ValueError("this rank's prompt is too long")
    with pytest.raises(RuntimeError, match=r"on another rank, rank 1 \(the lowest if several\), a parameter of the "
                                           r"actor \(its error names it\)"):
        with hybrid.HybridEngine._failing_together(rank(None), "cpu"):
            pass


# (ZeRO stage, a tensor-parallel group?) -> whom the train() that begins a train phase asks: ZeRO-3's forwards gather
# over the world, so its ranks train in step and meet over the world (a group's too); a group under ZeRO 0-2 meets
# alone (groups train apart until their gradient all-reduce)
TRAIN_MEETINGS = {(2, True): "the tp group", (3, False): None, (3, True): None}


@pytest.mark.parametrize("stage,tp", sorted(TRAIN_MEETINGS), ids=lambda v: str(v))
def test_the_train_phase_begins_with_one_meeting_on_module_surgery_of_the_ranks_that_train_in_step(monkeypatch, stage,
                                                                                                   tp):
    """The train() that begins a train phase asks the ranks that train in step (``TRAIN_MEETINGS``) whether every
    rank's parameters are in place, once per phase and not at the train() before each micro-batch: every rank of a
    correct loop meets as often. A rank whose parameters are in place raises that another rank's was replaced, before
    the DeepSpeed engine is switched to training. Under ZeRO-3 on several ranks train() met nobody: surgery on one
    rank, then train(), was not refused on any. ZeRO 0-2 without a group, or once released, train() meets nobody (the
    ranks are simulated: one process)."""
    from types import SimpleNamespace

    from dschat.hybrid_engine import engine as hybrid

    asked = []

    def ranks_agree_on(meeting, flags, device, group=None):  # rank 1's parameter was replaced
        asked.append((meeting, tuple(flags), group))
        return [1]

    monkeypatch.setattr(hybrid, "_world_size", lambda: 2)
    monkeypatch.setattr(hybrid, "_ranks_agree_on", ranks_agree_on)
    monkeypatch.setattr(hybrid, "is_released", lambda engine: engine.released)

    def rank(stage, tp, released=False):
        modes = []
        fake = SimpleNamespace(tp=SimpleNamespace(group="the tp group") if tp else None, released=released,
                               modes=modes, _engine=SimpleNamespace(zero_optimization_stage=lambda: stage,
                                                                   device="cpu", train=modes.append),
                               _parameter_places=SimpleNamespace(replaced=lambda: None),
                               _train_start=None, _iteration=None)
        fake._refuse_surgery_before_training = lambda: hybrid.HybridEngine._refuse_surgery_before_training(fake)
        return fake

    fake = rank(stage, tp)
    with pytest.raises(RuntimeError, match=r"on another rank, rank 1 \(the lowest if several\), a parameter"):
        hybrid.HybridEngine.train(fake)
    assert asked == [("train()", (True,), TRAIN_MEETINGS[stage, tp])] and fake.modes == []  # (before training mode)
    monkeypatch.setattr(hybrid, "_ranks_agree_on", lambda *args: asked.append(args) or [None])
    for _ in range(3):  # one phase: DeepSpeed-Chat's train() before each micro-batch
        hybrid.HybridEngine.train(fake)
    assert len(asked) == 2 and fake.modes == [True] * 3
    asked.clear()
    for fake in (rank(2, False), rank(stage, tp, released=True)):
        hybrid.HybridEngine.train(fake)
        assert fake.modes == [True]
    assert asked == []


def test_gpt_neo_local_attention_generates_as_hf_within_its_window_and_is_refused_past_it():
    # GPT-Neo's local layers take their window from the causal table's rows at the cache's length, not at the token's
    # position: a static cache longer than window_size gave other tokens than HF's generate, silently
    from transformers import AutoModelForCausalLM, GPTNeoConfig

    config = GPTNeoConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
                          attention_types=[[["global", "local"], 1]], window_size=12, bos_token_id=None,
                          eos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model = model.to(_device())
    engine = _engine(model)
    engine.eval()
    ids, mask = left_padded_batch([7, 3, 5, 1], seed=0)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=5)  # 7 + 5 slots: the window sees them all
    assert torch.equal(got, hf_generate(model, ids, mask, 5))
    with pytest.raises(ValueError, match=r"longer than the model's local attention window \(12 tokens\).*"
                                         r"without the hybrid engine.*--no-enable_hybrid_engine"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=6)


def test_mpt_generates_as_hf_within_its_position_bias_and_is_refused_past_it():
    # MPT adds an ALiBi bias built max_seq_len keys long to its scores: a longer KV cache (prompt columns + new tokens)
    # failed inside the model with "The size of tensor a (17) must match the size of tensor b (16)"
    from transformers import MptConfig

    config = MptConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=96, max_seq_len=16, bos_token_id=None,
                       eos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().to(_device())
    engine = _engine(model)
    engine.eval()
    ids, mask = left_padded_batch([7, 3, 5, 1], seed=0)
    with pytest.raises(ValueError, match=r"a prompt of 7 tokens \(left padding included\) \+ max_new_tokens=10 is "
                                         r"past the model's position bias of 16 keys"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=10)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=9), hf_generate(model, ids, mask, 9))


def _rwkv_config():  # a recurrent state passed as `state`
    from transformers import RwkvConfig

    return RwkvConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                      intermediate_size=64, context_length=64, bos_token_id=None, eos_token_id=None)


def _openai_gpt_config():  # no cache at all
    from transformers import OpenAIGPTConfig

    return OpenAIGPTConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64)


@pytest.mark.parametrize("config", [_rwkv_config, _openai_gpt_config], ids=["rwkv", "openai_gpt"])
def test_a_model_whose_forward_takes_no_kv_cache_is_refused_with_the_way_out(config):
    """Their forward took the static cache into **kwargs and dropped it, so every decode step saw one token alone: RWKV
    generated other tokens than HF's generate without a word (GPT-1 failed on shapes). HF's generate, which
    --no-enable_hybrid_engine uses, runs them."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).eval().to(_device())
    ids, mask = left_padded_batch([5, 5], seed=0)  # (no padding: RWKV reads no mask)
    assert hf_generate(model, ids, mask, 4).shape == (2, 9)
    with pytest.raises(UsageError, match=rf"{type(model).__name__}'s forward takes no past_key_values.*"
                                         r"--no-enable_hybrid_engine"):
        _engine(model)


def _cpmant_config():  # its forward prepends prompt tokens and wants the whole sequence at every step
    from transformers import CpmAntConfig

    return CpmAntConfig(vocab_size=96, hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=64,
                        num_hidden_layers=2, prompt_length=4, prompt_types=3, segment_types=3,
                        position_bias_num_buckets=32, position_bias_max_distance=64)


def test_cpmant_is_refused_when_the_engine_is_built_with_the_way_out():
    """CPMAnt's forward takes transformers' cache, yet prepends config.prompt_length virtual prompt tokens and wants
    the whole sequence at every step: the engine failed at its first generation with an IndexError deep in the
    static cache (short answers) or with other shapes (long ones). HF's generate, which --no-enable_hybrid_engine
    uses, runs it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_cpmant_config()).eval().to(_device())
    ids, mask = left_padded_batch([5, 5], seed=0)
    assert hf_generate(model, ids, mask, 4).shape == (2, 9)
    with pytest.raises(UsageError, match=r"CpmAntForCausalLM cannot be decoded one token at a time.*prompt_length"
                                         r".*--no-enable_hybrid_engine"):
        _engine(model)


def test_xlstm_is_refused_when_the_engine_is_built_with_the_way_out():
    """xLSTM's forward takes a ``cache``, by the name of transformers' KV cache, but its own: an xLSTMCache of
    recurrent states. The engine handed it its static cache and failed at the first generation with "AttributeError:
    'StaticCache' object has no attribute 'rnn_state'" (hidden in bench/family_sweep.py behind transformers' own
    xLSTM cache failing first on the tiny config). HF's generate, which --no-enable_hybrid_engine uses, runs it."""
    from transformers import xLSTMConfig

    torch.manual_seed(0)  # (128 wide: transformers' own cache fits its layers, as it does not at 64)
    model = AutoModelForCausalLM.from_config(xLSTMConfig(vocab_size=96, hidden_size=128, num_hidden_layers=2,
                                                         num_heads=4, bos_token_id=None, eos_token_id=None,
                                                         pad_token_id=None)).eval().to(_device())
    ids = left_padded_batch([5, 5], seed=0)[0]
    assert hf_generate(model, ids, torch.ones_like(ids), 4).shape == (2, 9)
    with pytest.raises(UsageError, match=r"xLSTMForCausalLM cannot be decoded one token at a time.*xLSTMCache"
                                         r".*--no-enable_hybrid_engine"):
        _engine(model)


def _minimax_config():  # keeps a cache of its own: its forward refuses a StaticCache (HF's ValueError)
    from transformers import MiniMaxConfig

    return MiniMaxConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                         num_experts_per_tok=2, layer_types=["full_attention", "linear_attention"], block_size=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _mimo_v2_flash_config():  # its sliding layers' KV heads are not the config's num_key_value_heads
    from transformers import MiMoV2FlashConfig

    return MiMoV2FlashConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, v_head_dim=16,
                             moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                             topk_group=1, sliding_window=32, layer_types=["full_attention", "sliding_attention"],
                             mlp_layer_types=["dense", "sparse"], bos_token_id=None, eos_token_id=None,
                             pad_token_id=None)


@pytest.mark.parametrize("config", [_minimax_config, _mimo_v2_flash_config], ids=["minimax", "mimo_v2_flash"])
def test_a_model_that_fails_on_the_static_cache_is_refused_with_the_way_out(config):
    """MiniMax's forward refuses a StaticCache (a ValueError), MiMo-V2-Flash's attention writes another layout than
    the cache holds (index_copy_'s RuntimeError): both failed deep in the decode loop's first forward, naming no flag.
    HF's generate, which --no-enable_hybrid_engine uses, runs them."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config()).eval().to(_device())
    ids, mask = left_padded_batch([5, 3], seed=0)
    assert hf_generate(model, ids, mask, 4).shape == (2, 9)
    engine = _engine(model)
    engine.eval()
    with pytest.raises(UsageError, match=rf"{type(model).__name__} failed on the hybrid engine's static KV cache .*"
                                         r"--no-enable_hybrid_engine") as refused:
        engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    assert isinstance(refused.value.__cause__, (ValueError, RuntimeError))  # (the model's own error, chained)


def _model_failing_in_the_cache_code(message, where=Path("transformers") / "cache_utils.py"):
    """A stand-in model whose forward raises ``RuntimeError(message)`` from a frame of ``where`` (transformers'
    cache_utils.py: as a failing ``index_copy_`` in ``StaticLayer.update`` does)."""
    raising = compile(f"raise RuntimeError({message!r})", str(where), "exec")

    class Model(torch.nn.Module):
        def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=False):
            exec(raising)

    return Model()


def _prefill(model):
    """decode.prefill of a 3-token prompt through ``model`` (no cache: the stand-ins fail before they would use it)."""
    from dschat.hybrid_engine.decode import ForwardSpec, prefill

    spec = ForwardSpec(cache_kwarg="past_key_values", takes_cache_position=False, takes_logits_to_keep=False)
    ids = torch.ones(1, 3, dtype=torch.long)
    return prefill(model, spec, ids, torch.ones_like(ids), torch.arange(3)[None], torch.arange(3), None)


def test_an_accelerator_fault_met_in_the_cache_code_is_not_taken_for_the_models_refusal():
    """A CUDA error (a device-side assert, an illegal access) is raised by whatever kernel runs next, often one of
    the cache's ``index_copy_``, for a fault of an earlier kernel (a token id past the vocabulary, a bad kernel): it
    says nothing of whether the model can use the static cache, and the device is unusable after it. It reaches the
    caller unchanged; a RuntimeError of the cache code itself (MiMo-V2-Flash's shapes) is the UsageError."""
    with pytest.raises(UsageError, match="--no-enable_hybrid_engine"):
        _prefill(_model_failing_in_the_cache_code("index_copy_(): Source/destination tensor must have same slice "
                                                  "shapes"))
    for fault in ("CUDA error: device-side assert triggered", "CUDA error: an illegal memory access was encountered"):
        with pytest.raises(RuntimeError, match="CUDA error"):  # (a UsageError is a ValueError)
            _prefill(_model_failing_in_the_cache_code(fault))


def test_an_error_of_dschats_own_cache_code_is_not_taken_for_the_models_refusal():
    """The engine's cache code that runs in the forward (TokenWriteLayer.update) fails only through transformers'
    update (whose frames say so) or as a bug of dschat's: that bug reaches the caller as it is, not as a refusal of the
    model with the advice to turn the engine off."""
    model = _model_failing_in_the_cache_code("expected a tensor of dtype Long", Path("dschat") / "hybrid_engine" /
                                             "cache.py")
    with pytest.raises(RuntimeError, match="expected a tensor of dtype Long"):  # (a UsageError is a ValueError)
        _prefill(model)


def test_a_model_with_layers_the_static_cache_cannot_hold_is_refused_when_the_engine_is_built():
    """DeepSeek-V4's compressed attentions are layer types that transformers' StaticCache has no layer for: the
    cache's KeyError ('heavily_compressed_attention') came at the first generation, naming no flag. HF's generate
    (its own dynamic cache), which --no-enable_hybrid_engine uses, runs the model."""
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(vocab_size=96, hidden_size=64, moe_intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, q_lora_rank=32,
                              num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, sliding_window=32,
                              max_position_embeddings=256, qk_rope_head_dim=8,
                              layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
                              mlp_layer_types=["hash_moe", "moe"], bos_token_id=None, eos_token_id=None,
                              pad_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().to(_device())
    ids, mask = left_padded_batch([5, 3], seed=0)
    assert hf_generate(model, ids, mask, 4).shape == (2, 9)
    with pytest.raises(UsageError, match=r"heavily_compressed_attention.*StaticCache.*--no-enable_hybrid_engine"):
        _engine(model)


def _bamba_config():  # a Mamba-2 layer and an attention layer
    from transformers import BambaConfig

    return BambaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16,
                       mamba_d_state=8, mamba_n_groups=1, max_position_embeddings=64, bos_token_id=None,
                       eos_token_id=None, pad_token_id=None)


def _mamba_config():  # recurrent layers only
    from transformers import MambaConfig

    return MambaConfig(vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=2, bos_token_id=None,
                       eos_token_id=None, pad_token_id=None)


def _falcon_h1_config():  # attention beside Mamba-2 in every layer: cache layers of keys and a recurrent state
    from transformers import FalconH1Config

    return FalconH1Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=32, mamba_n_heads=4,
                          mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16,
                          max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.mark.parametrize("config", [_bamba_config, _mamba_config, _falcon_h1_config],
                         ids=["bamba", "mamba", "falcon_h1"])
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda_graph"])
def test_recurrent_models_generate_as_hf(config, cuda_graph):
    """Mamba / short-convolution layers (Bamba, Granite-4, LFM2, Qwen3-Next, ...) mask padded inputs with the 2-D
    mask's last columns: the prefill's cache-long mask zeroed the prompts' last tokens there, as if they were padding.
    Mamba-1 multiplies its inputs by the mask as given: a decode step's cache-long mask spread its one token over every
    slot (log-probs 0.38 off; HF passes no mask after the prefill). Falcon-H1's layers also attend: without a mask
    its decode steps attended to the prompts' left padding. On the GPU, with CUDA graphs asked for, the engine falls
    back to the eager loop (these caches count tokens on the host) and says why: the same tokens, not a failure."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if cuda_graph and _device().type != "cuda":
        pytest.skip("CUDA graphs need the GPU")
    model = AutoModelForCausalLM.from_config(config()).eval().to(_device())
    engine = HybridEngine(make_ds_engine(model), HybridEngineConfig(enabled=True, max_out_tokens=32,
                                                                    enable_cuda_graph=cuda_graph), pad_token_id=PAD)
    engine.eval()
    ids, mask = left_padded_batch([7, 3, 5, 1], seed=0)
    got, logprobs = engine.generate(ids, attention_mask=mask, max_new_tokens=8, return_logprobs=True)
    assert torch.equal(got, hf_generate(model, ids, mask, 8))
    expected, _ = answer_logprobs_and_live(model, got, mask, eos_token_id=-1)
    assert torch.allclose(logprobs, expected, atol=1e-4)
    assert engine.kv_cache.nbytes >= 0  # (a recurrent layer holds no keys: read as none, not an AttributeError)
    if cuda_graph:  # the eager loop, with its reason: recurrent layers (Mamba-1: no KV-head layout at all)
        reason = engine.graph_decoder.unsupported_reason(engine.inference_weights, _device())
        assert engine.graph_decoder.captures == 0 and ("recurrent" in reason or "KV-head layout" in reason), reason


def test_recurrent_gemma_grouped_by_prompt_length_with_cuda_graphs_asked_for_generates_each_row_alone():
    """RecurrentGemma (``LEFT_PADDING_MOVES_SCORES``) generates its rows grouped by prompt length, each group a decode
    of its own shape. With CUDA graphs asked for on the GPU: each row's tokens and log-probs are its prompt's alone
    (HF's tokens), and the engine says whether it captured (a graph per group's bucket and cache length) or fell back
    to the eager loop for the recurrent layers; the count is printed for the GPU log."""
    if _device().type != "cuda":
        pytest.skip("CUDA graphs need the GPU")
    model = hybrid_common.tiny_recurrent_gemma().to(_device())
    with torch.no_grad():  # (non-zero biases and pad embedding: the pads' inputs would move the scores)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
        model.get_input_embeddings().weight[PAD].normal_()
    engine = HybridEngine(make_ds_engine(model), HybridEngineConfig(enabled=True, max_out_tokens=32,
                                                                    enable_cuda_graph=True), pad_token_id=PAD)
    engine.eval()
    lengths = [5, 2, 4, 1, 2]
    ids, mask = hybrid_common.left_padded_batch(lengths, seed=3)
    ids, mask = ids.to(_device()), mask.to(_device())
    width = ids.shape[1]
    got, logprobs = engine.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                    return_logprobs=True)
    for row, n in enumerate(lengths):
        alone = ids[row:row + 1, width - n:]
        expected = hf_generate(model, alone, torch.ones_like(alone), 6)
        assert torch.equal(got[row, width:], expected[0, n:]), row
        scored, _ = answer_logprobs_and_live(model, expected, torch.ones_like(alone), eos_token_id=-1)
        torch.testing.assert_close(logprobs[row], scored[0], atol=1e-4, rtol=0)
    decoder = engine.graph_decoder
    reason = decoder.unsupported_reason(engine.inference_weights, _device())
    print(f"recurrent_gemma grouped: captures={decoder.captures} eager reason={reason!r}")
    assert decoder.captures == 0 and "recurrent" in reason, (decoder.captures, reason)
