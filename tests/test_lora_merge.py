"""The one LoRA merge (dschat.models.lora) behind saving and the actor EMA: PEFT's own merge_and_unload is the
reference; unsupported LoRA variants are refused instead of saved wrongly."""
import copy
import sys
from pathlib import Path

import peft
import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from hybrid_common import make_ds_engine, tiny_model  # noqa: E402

from dschat.models.checkpoint import plain_model_state_dict, save_causal_lm  # noqa: E402
from dschat.rlhf.ema import moving_average  # noqa: E402

# The second adapter overlaps the first on some layers and adapts others alone.
TARGETS = {"llama": (["q_proj", "v_proj", "down_proj"], ["q_proj", "o_proj"]),
           "gpt2": (["c_attn", "c_fc"], ["c_attn", "c_proj"])}


TIED_TARGET = {"opt": "out_proj", "gpt2": "c_proj"}


class _Tok:
    def save_pretrained(self, folder):
        pass


def two_adapter_model(family, seed=0):
    """A PEFT model with two active adapters of different rank and scaling (random, non-zero B)."""
    model = tiny_model(family, seed=seed)
    torch.manual_seed(seed + 100)
    first, second = TARGETS[family]
    conv1d = family == "gpt2"
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=16, target_modules=first,
                                                       init_lora_weights=False, fan_in_fan_out=conv1d))
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=3, target_modules=second, init_lora_weights=False,
                                                fan_in_fan_out=conv1d))
    model.base_model.set_adapter(["default", "second"])
    assert model.base_model.active_adapters == ["default", "second"]
    return model


def peft_merged(model):
    """PEFT's own merge of the active adapters, on a copy (the model itself is left as it is)."""
    return copy.deepcopy(model).merge_and_unload().state_dict()


def assert_state_dicts_close(got, expected, atol=1e-6):
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.allclose(got[name], value, rtol=0, atol=atol), name


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_saved_model_with_two_active_adapters_equals_peft_merge_and_unload(family, tmp_path, distributed):
    model = two_adapter_model(family)
    expected = peft_merged(model)
    base_only = tiny_model(family).state_dict()
    second_only = [n for n in expected if ("o_proj" in n or "c_proj" in n) and n.endswith("weight")]
    assert any(not torch.equal(expected[n], base_only[n]) for n in second_only), "the second adapter must count"
    save_causal_lm(model, _Tok(), str(tmp_path / "out"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).state_dict()
    assert_state_dicts_close(loaded, expected)


def test_embedding_lora_and_modules_to_save_are_saved_as_peft_merges_them(tmp_path, distributed):
    model = tiny_model("llama", seed=7)
    torch.manual_seed(8)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "o_proj"],
                                                       init_lora_weights=False, modules_to_save=["lm_head"]))
    with torch.no_grad():  # make the saved head differ from the original one
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(-1.5)
    expected = peft_merged(model)
    save_causal_lm(model, _Tok(), str(tmp_path / "out"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).state_dict()
    assert_state_dicts_close(loaded, expected)


@pytest.mark.parametrize("family", ["opt", "gpt2"])
def test_a_trained_head_of_a_tied_model_is_saved_untied(family, tmp_path, distributed):
    # modules_to_save=["lm_head"] trains a copy of the head; with tie_word_embeddings left true, from_pretrained
    # would tie the saved head back to the embeddings and lose it
    model = tiny_model(family, seed=3)
    assert model.config.tie_word_embeddings and model.get_output_embeddings().weight is \
        model.get_input_embeddings().weight
    embedding = model.get_input_embeddings().weight.detach().clone()
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=[TIED_TARGET[family]],
                                                       modules_to_save=["lm_head"]))
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(-1.5)
    save_causal_lm(model, _Tok(), str(tmp_path / "out"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert not loaded.config.tie_word_embeddings
    assert torch.equal(loaded.get_output_embeddings().weight, -1.5 * embedding)
    assert torch.equal(loaded.get_input_embeddings().weight, embedding)
    assert model.base_model.model.config.tie_word_embeddings  # the training model's config is left as it was


def test_an_inactive_head_copy_leaves_a_tied_model_tied(tmp_path, distributed):
    # the head's modules_to_save copy belongs to an adapter that is not active: the saved head is the embedding
    model = tiny_model("opt", seed=3)
    embedding = model.get_input_embeddings().weight.detach().clone()
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["out_proj"], modules_to_save=["lm_head"]))
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["out_proj"]))
    model.set_adapter("other")
    save_causal_lm(model, _Tok(), str(tmp_path / "out"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    assert loaded.config.tie_word_embeddings
    assert torch.equal(loaded.get_output_embeddings().weight, embedding)


def test_zero3_partitioned_lora_model_saves_the_merge_from_the_gathered_state(distributed, monkeypatch):
    # Under ZeRO-3 the parameters hold no data outside a gather: the adapters must be read from the state dict.
    # The engine swaps torch.nn.functional.linear for the whole process; monkeypatch puts torch's back afterwards.
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    model = two_adapter_model("llama", seed=2)
    expected = peft_merged(model)
    engine = make_ds_engine(model, stage=3)
    assert engine.module.base_model.model.model.layers[0].self_attn.q_proj.lora_A["second"].weight.numel() == 0
    assert_state_dicts_close(plain_model_state_dict(engine.module), expected)


@pytest.mark.filterwarnings("ignore:`lora_bias=True` was passed")
@pytest.mark.parametrize("variant,message", [({"use_dora": True}, "DoRA"), ({"lora_bias": True}, "lora_bias"),
                                             # (saved without its embeddings: from_pretrained made random ones)
                                             ({"trainable_token_indices": [5, 7]}, "trainable_token_indices")])
def test_saving_an_unsupported_lora_variant_raises_instead_of_saving_wrong_weights(variant, message, tmp_path,
                                                                                   distributed):
    model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"], **variant))
    with pytest.raises(NotImplementedError, match=message):
        save_causal_lm(model, _Tok(), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_ema_of_a_lora_actor_moves_toward_the_merged_weights(family):
    actor = two_adapter_model(family, seed=3)
    merged = peft_merged(actor)
    training = {n: p.detach().clone() for n, p in actor.named_parameters()}
    ema = tiny_model(family, seed=4)  # a plain model at other weights
    before = {n: p.detach().clone() for n, p in ema.named_parameters()}
    moving_average(actor, ema, beta=0.25)
    for name, p in ema.named_parameters():
        expected = 0.25 * before[name] + 0.75 * merged[name]
        assert torch.allclose(p, expected, rtol=0, atol=1e-6), name
    for name, p in actor.named_parameters():  # the actor is only read
        assert torch.equal(p, training[name]), name
