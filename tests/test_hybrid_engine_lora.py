"""LoRA actors: generation from merged inference weights; the training weights are never touched."""
import copy
import sys
from pathlib import Path

import peft
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from hybrid_common import PAD, early_token, hf_generate, left_padded_batch, make_ds_engine, tiny_model  # noqa: E402

from dschat.hybrid_engine import HybridEngine, HybridEngineConfig  # noqa: E402
from dschat.hybrid_engine.weights import InferenceCopy  # noqa: E402
from dschat.models.lora import lora_layers  # noqa: E402

TARGETS = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}


def lora_model(family="llama", seed=0, dtype=torch.float32):
    model = tiny_model(family, seed=seed, dtype=dtype)
    torch.manual_seed(seed + 100)
    # init_lora_weights=False: random, non-zero B, so the adapters change the output from the start.
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS[family], init_lora_weights=False,
                             fan_in_fan_out=family == "gpt2")
    return peft.get_peft_model(model, config).to(dtype)


def expected_merged(peft_model):
    """{plain name: W + scale * B @ A}, in fp32 and rounded once, computed here independently of the engine."""
    out = {}
    for name, layer in lora_layers(peft_model.get_base_model()).items():
        w = layer.get_base_layer().weight.detach()
        delta = (layer.lora_B["default"].weight.float() @ layer.lora_A["default"].weight.float())
        if layer.fan_in_fan_out:
            delta = delta.t()
        out[f"{name}.weight"] = (w.float() + layer.scaling["default"] * delta).to(w.dtype)
    return out


def _engine(model, stage=0, **config):
    return HybridEngine(make_ds_engine(model, stage), HybridEngineConfig(enabled=True, max_out_tokens=24, **config),
                        pad_token_id=PAD)


@pytest.mark.parametrize("family,stage", [("llama", 0), ("gpt2", 0), ("llama", 2)])
def test_lora_generation_equals_peft_generate_before_and_after_a_step(family, stage):
    model = lora_model(family)
    engine = _engine(model, stage)
    weights = engine.inference_weights
    assert weights.kind == "lora_copy" and weights.model is not engine.module
    ids, mask = left_padded_batch([6, 2, 4], seed=1)
    no_eos = hf_generate(model, ids, mask, 12)
    eos = early_token(no_eos[0, 6:])
    expected = hf_generate(model, ids, mask, 12, eos_token_id=eos)
    with model.disable_adapter():
        base_only = hf_generate(model, ids, mask, 12, eos_token_id=eos)
    assert not torch.equal(expected, base_only), "the adapters must matter for this test to mean anything"

    engine.eval()
    assert torch.equal(engine.module.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos),
                       expected)

    # A step changes the adapters (the base is frozen); the next generation must see them.
    engine.train()
    seq = expected
    loss = engine(input_ids=seq, attention_mask=(seq != PAD).long(), labels=seq).loss
    engine.backward(loss)
    engine.step()
    engine.eval()
    expected_after = hf_generate(model, ids, mask, 12, eos_token_id=eos)
    assert not torch.equal(expected_after, expected)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos),
                       expected_after)
    assert weights.refresh_count == 2


def test_inference_copy_holds_merged_weights_and_shares_the_rest():
    model = lora_model("llama", seed=3)
    engine = _engine(model)
    engine.eval()
    weights = engine.inference_weights
    merged = expected_merged(model)
    assert len(merged) == 2 * 3  # 2 layers x 3 target modules
    inference = dict(weights.model.named_parameters())
    for name, value in merged.items():
        assert torch.equal(inference[name], value), name
    base = dict(model.get_base_model().named_parameters())
    shared = [c for c in weights.copies if c.aliased]
    assert len(shared) == len(weights.copies) - len(merged)
    for c in shared:  # unadapted parameters cost nothing: same storage as the training tensors
        assert c.target.data_ptr() == base[c.name].data_ptr()
    assert weights.nbytes == sum(v.nbytes for v in merged.values())


def test_fifty_refresh_cycles_leave_training_weights_bitwise_unchanged():
    model = lora_model("llama", seed=4)
    engine = _engine(model)
    training = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = engine.inference_weights
    for _ in range(50):
        engine.mark_weights_stale()
        engine.eval()
        engine.train()
    assert weights.refresh_count == 50
    for name, p in model.named_parameters():
        assert torch.equal(p, training[name]), name
    inference = dict(weights.model.named_parameters())
    for name, value in expected_merged(model).items():
        assert torch.equal(inference[name], value), name


def test_bf16_merge_rounds_once_and_never_writes_the_training_weights():
    # A merge/unmerge of the training weights in bf16 drifts after a few cycles; a rounding of W + s*B@A done in
    # bf16 steps (instead of fp32 then one rounding) differs from the reference below.
    model = lora_model("llama", seed=5, dtype=torch.bfloat16)
    training = {n: p.detach().clone() for n, p in model.named_parameters()}
    weights = InferenceCopy(model, "cpu", gather_group_size=1, share_unadapted=True)
    assert len(weights.groups) == 1 + 2  # non-layer parameters, then one group per decoder layer
    for _ in range(50):
        weights.mark_stale()
        weights.refresh_if_stale()
    for name, p in model.named_parameters():
        assert torch.equal(p, training[name]), name
    inference = dict(weights.model.named_parameters())
    for name, value in expected_merged(model).items():
        assert inference[name].dtype == torch.bfloat16 and torch.equal(inference[name], value), name


def test_refresh_only_when_weights_changed():
    model = lora_model("llama", seed=6)
    engine = _engine(model)
    weights = engine.inference_weights
    ids, mask = left_padded_batch([3, 5], seed=6)
    engine.eval()
    seq = engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    engine.train()
    engine.eval()
    assert weights.refresh_count == 1
    loss = engine(input_ids=seq, attention_mask=(seq != PAD).long(), labels=seq).loss
    engine.backward(loss)
    engine.step()
    engine.generate(ids, attention_mask=mask, max_new_tokens=4)  # generate without eval() refreshes too
    assert weights.refresh_count == 2


def test_unsupported_lora_variants_are_refused():
    model = tiny_model("llama")
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(NotImplementedError, match="DoRA"):
        InferenceCopy(copy.deepcopy(model), "cpu", gather_group_size=8, share_unadapted=True)


def test_lora_on_moe_expert_parameters_is_refused_not_left_out_of_generation():
    # PEFT's target_parameters adapts the experts' 3-D gate_up_proj with a per-expert delta: the copy generated from
    # the base experts (the delta was keyed "experts.weight", which no parameter is) and saving failed with a KeyError
    from transformers import AutoModelForCausalLM, MixtralConfig

    from dschat.models.lora import check_lora_mergeable

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MixtralConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, bos_token_id=None, eos_token_id=None))
    config = peft.LoraConfig(r=2, target_modules=[], target_parameters=["experts.gate_up_proj"],
                             init_lora_weights=False)
    model = peft.get_peft_model(model, config)
    with pytest.raises(NotImplementedError, match="'gate_up_proj' \\(4 experts; PEFT's target_parameters\\)"):
        InferenceCopy(model, "cpu", gather_group_size=8, share_unadapted=True)
    with pytest.raises(NotImplementedError, match="target_parameters"):
        check_lora_mergeable(model)  # (what saving checks on every rank before its gather)


@pytest.mark.parametrize("peft_options", [{"target_modules": ["embed_tokens", "out_proj"]},
                                          {"target_modules": ["out_proj"], "modules_to_save": ["embed_tokens"]}],
                         ids=["embedding_lora", "embedding_saved"])
def test_a_tied_model_with_adapted_embeddings_is_refused_not_generated_differently(peft_options):
    model = peft.get_peft_model(tiny_model("opt", seed=7), peft.LoraConfig(r=4, **peft_options))  # OPT ties its head
    with pytest.raises(ValueError, match="tied input and output embeddings"):
        InferenceCopy(model, "cpu", gather_group_size=8, share_unadapted=True)


@pytest.mark.parametrize("family,out_proj", [("llama", "o_proj"), ("opt", "out_proj")])  # OPT ties its head
def test_embedding_lora_and_modules_to_save_map_generically(family, out_proj):
    from dschat.hybrid_engine.cache import KVCache
    from dschat.hybrid_engine.decode import generate_tokens

    model = tiny_model(family, seed=7)
    torch.manual_seed(8)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", out_proj], init_lora_weights=False,
                             modules_to_save=["lm_head"])
    model = peft.get_peft_model(model, config)
    with torch.no_grad():  # make the saved copy differ from the original head
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(-1.5)
    model.eval()
    weights = InferenceCopy(model, "cpu", gather_group_size=8, share_unadapted=True)
    weights.refresh_if_stale()
    inference = dict(weights.model.named_parameters())
    assert torch.equal(inference["lm_head.weight"], model.base_model.model.lm_head.modules_to_save["default"].weight)
    emb = model.base_model.model.get_input_embeddings()
    expected_emb = emb.get_base_layer().weight + emb.scaling["default"] * (
        emb.lora_embedding_B["default"] @ emb.lora_embedding_A["default"]).t()
    copy_embeddings = weights.model.get_input_embeddings().weight
    emb_name = next(name for name, p in weights.model.named_parameters() if p is copy_embeddings)
    assert torch.allclose(inference[emb_name], expected_emb, atol=1e-6)

    ids, mask = left_padded_batch([5, 3], seed=9)
    expected = hf_generate(model, ids, mask, 10)
    cache = KVCache(weights.model.config).acquire(2, ids.shape[1] + 10, torch.float32, "cpu")
    got = generate_tokens(weights.model, ids, mask, cache, 10, pad_token_id=PAD)
    assert torch.equal(got, expected)


def test_the_inference_copy_generates_with_the_checkpoints_generation_config(distributed):
    # the copy was built from the config alone: its generation_config (lengths, EOS, sampling) was HF's default, so
    # generate's defaults changed with LoRA (and ZeRO-3's pinned copy)
    model = lora_model("llama")
    model.get_base_model().generation_config.max_new_tokens = 5
    engine = _engine(model)
    assert engine.inference_weights.kind == "lora_copy"
    ids, mask = left_padded_batch([6, 2, 4], seed=1)
    engine.eval()
    got = engine.generate(ids, attention_mask=mask)  # no length given: the generation_config's 5 new tokens
    assert got.shape == (3, 6 + 5)
    assert torch.equal(got, hf_generate(model, ids, mask, 5))


def test_a_generation_config_setting_the_decode_does_not_apply_is_an_error_unless_the_call_overrides_it(
        distributed):
    from dschat.errors import UsageError

    model = tiny_model("llama")
    model.generation_config.no_repeat_ngram_size = 2
    engine = _engine(model)
    ids, mask = left_padded_batch([6, 2, 4], seed=1)
    engine.eval()
    with pytest.raises(UsageError, match="generation_config sets no_repeat_ngram_size=2, which HF's generate applies"):
        engine.generate(ids, attention_mask=mask, max_new_tokens=4)
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=4, no_repeat_ngram_size=0)
    model.generation_config.no_repeat_ngram_size = 0
    assert torch.equal(got, hf_generate(model, ids, mask, 4))


def test_lora_on_a_moe_model_with_dense_and_shared_expert_mlps_adapts_the_linears_it_names_and_generates():
    """DeepSeek-V3-style MoE (a dense first layer, shared experts beside fused routed experts): --actor_lora_dim put no
    adapter on the dense and shared MLPs' Linear modules it targeted, because PEFT (with transformers 5) rewrote every
    target ending in down_proj / gate_proj + up_proj into LoRA on the routed experts' 3-D parameters, and the hybrid
    engine then refused the actor ("LoRA on the parameter 'down_proj' (4 experts; PEFT's target_parameters) is not
    supported by the LoRA merge"). Now the named Linear modules get the adapters, and the engine generates as PEFT's
    model does."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from dschat.models.lora import apply_lora, lora_target_modules

    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=96, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                              first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                              qk_nope_head_dim=16, v_head_dim=16, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=4, max_position_embeddings=256, bos_token_id=None,
                              eos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = None
    targets = lora_target_modules(model)
    assert "model.layers.0.mlp.down_proj" in targets and "model.layers.1.mlp.shared_experts.down_proj" in targets
    model = apply_lora(model, 4, lora_alpha=16)
    adapted = set(lora_layers(model.get_base_model()))
    assert adapted == set(targets), sorted(set(targets) ^ adapted)
    assert not any(type(m).__name__ == "ParamWrapper" for m in model.modules())
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.3)  # non-zero adapters, so that they change the answers

    engine = _engine(model)
    assert engine.inference_weights.kind == "lora_copy"
    ids, mask = left_padded_batch([6, 2, 4], seed=1)
    expected = hf_generate(model, ids, mask, 8)
    with model.disable_adapter():
        assert not torch.equal(hf_generate(model, ids, mask, 8), expected)
    engine.eval()
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=8), expected)
