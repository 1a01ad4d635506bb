"""Models: reward end index, pairwise loss, LoRA through PEFT, drift-free merge, save/load round trips."""
import logging
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, GPT2Config, LlamaConfig, OPTConfig

from dschat.models.checkpoint import atomic_folder, save_causal_lm, save_reward_model
from dschat.models.lora import apply_lora, lora_target_modules, optimizer_param_groups
from dschat.models.reward_model import (RewardModel, create_critic_model, last_token_index, load_reward_model,
                                        pairwise_loss, positions_from_mask)
from launch import WRITE_SEEN_AND_END

CONFIGS = {
    "llama": lambda: LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "opt": lambda: OPTConfig(vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                             word_embed_proj_dim=32, max_position_embeddings=64),
    "gpt2": lambda: GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64),
}


class _Tok:
    """Just what save_pretrained needs from a tokenizer."""

    def save_pretrained(self, folder):
        open(os.path.join(folder, "tokenizer_marker.txt"), "w").close()


def test_last_token_index_handles_left_and_right_padding():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    assert last_token_index(right).tolist() == [2, 4]
    assert last_token_index(left).tolist() == [4, 4]


def test_positions_ignore_left_padding():
    assert positions_from_mask(torch.tensor([[0, 0, 1, 1]])).tolist() == [[0, 0, 0, 1]]


def test_pairwise_loss_matches_formula():
    c, r = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0])
    expected = -(torch.log(torch.sigmoid(torch.tensor(2.0))) + torch.log(torch.sigmoid(torch.tensor(-1.0)))) / 2
    assert torch.allclose(pairwise_loss(c, r), expected)


def _gemma3_multimodal_config():
    from transformers import Gemma3Config

    text = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, sliding_window=4, max_position_embeddings=64)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=95,
                        boi_token_index=94, eoi_token_index=93)


def test_a_multimodal_backbone_scores_from_its_text_config(tmp_path):
    """Gemma-3 4B and up are Gemma3ForConditionalGeneration checkpoints: their config holds the decoder's sizes in
    text_config, and the reward model (step 2, the critic) failed: 'cannot find the hidden size in Gemma3Config'."""
    torch.manual_seed(0)
    sft = AutoModelForCausalLM.from_config(_gemma3_multimodal_config()).eval()
    save_causal_lm(sft, _Tok(), str(tmp_path / "sft"))
    critic = create_critic_model(str(tmp_path / "sft"), None).eval()
    ids = torch.randint(3, 93, (2, 6))
    left, mask = ids.clone(), torch.ones_like(ids)
    left[1, :2], mask[1, :2] = 0, 0
    with torch.no_grad():
        hidden = sft.model(input_ids=left, attention_mask=mask, position_ids=positions_from_mask(mask))[0]
        expected = critic.v_head(hidden)[:, -1, 0]
        assert torch.allclose(critic.end_scores(left, mask), expected)
        assert torch.allclose(critic.end_scores(ids[1:, 2:], mask[1:, 2:]), expected[1:], atol=1e-6)


def _reformer_config(**settings):  # its hidden states are two streams concatenated: 2 x hidden_size wide
    from transformers import ReformerConfig

    settings = {"local_attn_chunk_length": 16, "lsh_attn_chunk_length": 16, **settings}
    return ReformerConfig(vocab_size=96, hidden_size=32, num_attention_heads=2, attention_head_size=16,
                          attn_layers=["local", "lsh"], feed_forward_size=64, axial_pos_shape=[8, 8],
                          axial_pos_embds_dim=[16, 16], max_position_embeddings=64, is_decoder=True, pad_token_id=None,
                          eos_token_id=None, **settings)


def test_a_reward_model_reads_its_backbones_hidden_states_at_their_measured_width(tmp_path):
    """Reformer's hidden states are two streams concatenated, 2 x its config's hidden_size, which no config field
    says: the value head built from hidden_size failed at the first score ("mat1 and mat2 shapes cannot be
    multiplied (28x128 and 64x1)"). Its width is measured by a forward when the head is built, which leaves each of the
    backbone's modules in the mode it was."""
    from dschat.models.reward_model import measured_hidden_width

    torch.manual_seed(0)
    sft = AutoModelForCausalLM.from_config(_reformer_config()).eval()
    save_causal_lm(sft, _Tok(), str(tmp_path / "sft"))
    critic = create_critic_model(str(tmp_path / "sft"), None)
    assert critic.v_head.in_features == 2 * sft.config.hidden_size
    backbone = critic.rwtransformer.train()
    backbone.embeddings.eval()  # (a module's own mode is kept, not the top module's given to all)
    assert measured_hidden_width(backbone) == 2 * sft.config.hidden_size
    assert backbone.training and backbone.encoder.training and not backbone.embeddings.training
    critic.eval()
    ids = torch.randint(3, 96, (2, 6))
    with torch.no_grad():
        hidden = critic.rwtransformer(input_ids=ids)[0]
        assert torch.allclose(critic.end_scores(ids, torch.ones_like(ids)), critic.v_head(hidden)[:, -1, 0])


def test_measuring_the_width_leaves_an_rwkv_backbones_weights_as_loaded(tmp_path):
    """RWKV (``rescale_every``) divides some weights in place at a forward in eval mode (transformers' scaling for
    inference, undone at its next training forward): the width probe left a loaded reward model's weights divided, so
    whatever read them before a training forward took them so (DeepSpeed's fp32 master weights at ZeRO 1-2 kept them
    divided for good, the first optimizer step writing them back)."""
    torch.manual_seed(0)
    sft = AutoModelForCausalLM.from_config(_rwkv_config(rescale_every=1)).eval()  # (block 1's weights: / 2)
    save_causal_lm(sft, _Tok(), str(tmp_path / "sft"))
    critic = create_critic_model(str(tmp_path / "sft"), None)
    loaded = critic.rwtransformer.state_dict()
    for name, saved in sft.rwkv.state_dict().items():
        assert torch.equal(loaded[name], saved), name
    critic.eval()  # (and it scores as transformers' RWKV does in eval mode, which rescales them itself)
    ids = torch.randint(3, 96, (1, 5))
    with torch.no_grad():
        hidden = sft.rwkv(input_ids=ids)[0]
        assert torch.allclose(critic.end_scores(ids, torch.ones_like(ids)), critic.v_head(hidden)[:, -1, 0])


@pytest.mark.parametrize("family, hash_seed", [("rwkv", None), ("reformer", None), ("reformer", 1)])
def test_measuring_the_width_touches_nothing_of_the_backbone_nor_the_rng(family, hash_seed):
    """The width was measured by a forward of the loaded weights: it divided an RWKV's weights in place (eval mode's
    rescaling; an 8-bit one's scales, ``SCB``, which transformers' way back does not restore), drew from the global
    RNG (Reformer's LSH rotations; with ``hash_seed``, a reseed) and cost 3-8 s per 7B parameters on the CPU. It runs
    on an empty copy on the meta device: weights, scales, config and the RNG are as they were."""
    from dschat.models.reward_model import measured_hidden_width

    torch.manual_seed(0)
    if family == "rwkv":
        backbone = AutoModel.from_config(_rwkv_config(rescale_every=1)).eval()
        for block in backbone.blocks:  # (the scales bitsandbytes keeps on an Int8Params weight)
            for linear in (block.attention.output, block.feed_forward.value):
                linear.weight.SCB = torch.ones(linear.weight.shape[0])
    else:
        # (chunks of one token: two tokens are hashed, which draws rotations from the RNG, or reseeds it by hash_seed)
        backbone = AutoModel.from_config(_reformer_config(local_attn_chunk_length=1, lsh_attn_chunk_length=1,
                                                          hash_seed=hash_seed)).eval()
    config = backbone.config.to_dict()  # (Reformer's forward sets num_buckets in it)
    state = {name: t.detach().clone() for name, t in backbone.state_dict().items()}
    scales = {name: p.SCB.clone() for name, p in backbone.named_parameters() if hasattr(p, "SCB")}
    rng = torch.get_rng_state()
    assert measured_hidden_width(backbone) == {"rwkv": 32, "reformer": 64}[family]
    assert torch.equal(torch.get_rng_state(), rng)
    assert backbone.config.to_dict() == config
    assert all(torch.equal(t, state[name]) for name, t in backbone.state_dict().items())
    assert all(torch.equal(p.SCB, scales[name]) for name, p in backbone.named_parameters() if hasattr(p, "SCB"))
    assert not any(getattr(module, "layers_are_rescaled", False) for module in backbone.modules())


def test_the_width_is_measured_without_the_backbones_weights():
    """Weights it cannot run (ZeRO-3-partitioned; here on the meta device) no longer leave the head at the config's
    hidden size, too narrow for a Reformer."""
    from dschat.models.reward_model import measured_hidden_width

    with torch.device("meta"):
        backbone = AutoModel.from_config(_reformer_config())
    assert measured_hidden_width(backbone) == 2 * backbone.config.hidden_size


@pytest.mark.parametrize("family", ["llama", "opt", "reformer"])
def test_loading_a_trained_reward_model_takes_its_heads_width_without_measuring_the_backbone(family, tmp_path,
                                                                                             monkeypatch):
    """The width probe (an empty copy's forward on the meta device, 0.6-0.8 s per 7B config on the CPU) ran at every
    load, though a trained head's saved weight gives the width. Skipped where that width is the config's; a Reformer's
    head, twice its config's hidden_size, is still measured (it checks a head saved for another backbone). A bare
    backbone's head is measured as before."""
    from dschat.models import reward_model

    torch.manual_seed(0)
    config = _reformer_config() if family == "reformer" else CONFIGS[family]()
    critic = RewardModel(AutoModel.from_config(config)).eval()
    torch.nn.init.normal_(critic.v_head.weight)
    save_reward_model(critic, _Tok(), str(tmp_path / "rm"))
    probes, measure = [], reward_model.measured_hidden_width

    def probe(backbone):
        probes.append(type(backbone).__name__)
        return measure(backbone)

    monkeypatch.setattr(reward_model, "measured_hidden_width", probe)
    loaded = load_reward_model(str(tmp_path / "rm")).eval()
    assert loaded.v_head.in_features == critic.v_head.in_features
    assert probes == (["ReformerModel"] if family == "reformer" else [])
    ids = torch.randint(3, 96, (2, 6))
    with torch.no_grad():
        mask = torch.ones_like(ids)
        assert torch.allclose(loaded.end_scores(ids, mask), critic.end_scores(ids, mask))
    probes.clear()
    assert RewardModel(AutoModel.from_config(config)).v_head.in_features == critic.v_head.in_features
    assert len(probes) == 1  # (no trained head: measured)


def test_an_rwkv_model_is_saved_with_its_weights_as_trained_after_a_forward_in_eval_mode(tmp_path):
    """A step evaluates last, then saves: transformers' RWKV (``rescale_every``) divides some weights in place at a
    forward in eval mode (by 2^(block // rescale_every); undone at its next training forward), and step 1's output of
    a 3-block RWKV was saved with blocks 1 and 2's output weights halved and quartered (sft.main, rescale_every=1), as
    were a critic's. Saved as trained; the model still evaluates as transformers' RWKV does."""
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(_rwkv_config(rescale_every=1)).train()
    critic = RewardModel(AutoModel.from_config(_rwkv_config(rescale_every=1))).train()
    trained = {"lm": {k: v.clone() for k, v in lm.state_dict().items()},
               "critic": {k: v.clone() for k, v in critic.rwtransformer.state_dict().items()}}
    ids = torch.randint(3, 96, (1, 5))
    with torch.no_grad():
        logits = lm.eval()(input_ids=ids).logits  # (the final evaluation: divides)
        scores = critic.eval().end_scores(ids, torch.ones_like(ids))
    save_causal_lm(lm, _Tok(), str(tmp_path / "lm"))
    save_reward_model(critic, _Tok(), str(tmp_path / "critic"))
    saved = {"lm": AutoModelForCausalLM.from_pretrained(tmp_path / "lm").state_dict(),
             "critic": load_reward_model(str(tmp_path / "critic")).rwtransformer.state_dict()}
    for model in ("lm", "critic"):
        for name, weight in trained[model].items():
            assert torch.equal(saved[model][name], weight), (model, name)
    with torch.no_grad():
        assert torch.equal(lm(input_ids=ids).logits, logits)
        assert torch.equal(critic.end_scores(ids, torch.ones_like(ids)), scores)


def test_saving_an_rwkv_model_whose_rescaled_weights_are_quantized_is_refused_before_anything_is_written(tmp_path):
    """bitsandbytes' int8 weights carry their scales as ``SCB``: RWKV's eval-mode rescaling divides those, and
    transformers' scale-back (training mode) multiplies the int8 values themselves, which overflow: the save wrote
    damaged weights. (bitsandbytes is not installed here: the weights carry an ``SCB`` as its Int8Params do, the
    attribute transformers and dschat both read.)"""
    from dschat.errors import UsageError

    lm = AutoModelForCausalLM.from_config(_rwkv_config(rescale_every=1)).eval()
    for block in lm.rwkv.blocks:
        for weight in (block.attention.output.weight, block.feed_forward.value.weight):
            weight.SCB = torch.ones(weight.shape[0])
    with torch.no_grad():
        lm(input_ids=torch.randint(3, 96, (1, 5)))  # (divides block 1's scales)
    with pytest.raises(UsageError, match=r"RwkvModel: blocks\.0\.attention\.output\.weight is quantized "
                                         r"\(bitsandbytes\).*rescale_every=1.*config\.rescale_every = 0"):
        save_causal_lm(lm, _Tok(), str(tmp_path / "lm"))
    assert not (tmp_path / "lm").exists()


def _rwkv_step_logits(lm, prompts, tokens):
    """The logits of one decode step of ``tokens`` ((B, 1)) after ``prompts`` ((B, P)), from their cached state."""
    state = lm(input_ids=prompts, use_cache=True).state
    return lm(input_ids=tokens, state=state, use_cache=True).logits


def test_rwkvs_batched_one_token_decode_keeps_rows_apart_with_the_fix(transformers_rwkv_steps):
    """transformers' RWKV (5.25: ``RwkvSelfAttention.extract_key_value`` and ``RwkvFeedForward.forward``) mixes a
    one-token step's (B, 1, H) hidden states with the state's (B, H) previous tokens unsqueezed nowhere: the step of
    B rows comes out B tokens long, each position mixed with another row's previous token, and HF generate's answers
    from a batch were not each row's. ``compat.rwkv_decode_keeps_rows_apart`` finds the mix on the model's first
    block and puts dschat's fix in: a batched step's logits are each row's alone (and the full sequence's), a forward
    of several tokens is bit for bit transformers' own, and batched greedy answers are each row's alone."""
    from dschat import compat

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(_rwkv_config()).eval()
    lm.generation_config.eos_token_id = lm.generation_config.pad_token_id = None
    prompts, tokens = torch.randint(3, 96, (3, 5)), torch.randint(3, 96, (3, 1))
    sequences = torch.cat([prompts, tokens], 1)
    with torch.no_grad():
        whole = lm(input_ids=sequences).logits
        alone = torch.cat([_rwkv_step_logits(lm, prompts[r:r + 1], tokens[r:r + 1]) for r in range(3)])
        assert torch.allclose(alone[:, -1], whole[:, -1], atol=1e-5)  # (one row: transformers' step is right)
        mixed = _rwkv_step_logits(lm, prompts, tokens)
    assert mixed.shape == (3, 3, 96)  # transformers' own: rows mixed (when this fails, transformers fixed it)
    assert compat.rwkv_decode_keeps_rows_apart(lm)
    with torch.no_grad():
        together = _rwkv_step_logits(lm, prompts, tokens)
        assert together.shape == (3, 1, 96) and torch.allclose(together, alone, atol=1e-5)
        assert torch.equal(lm(input_ids=sequences).logits, whole)
        call = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        answers = lm.generate(prompts, attention_mask=torch.ones_like(prompts), **call)
        for row in range(3):
            assert torch.equal(answers[row:row + 1], lm.generate(prompts[row:row + 1], **call))


def test_rwkvs_decode_probe_reads_none_of_the_models_weights(transformers_rwkv_steps):
    """The probe ran a decode step on the model's first block: under ZeRO-3 on several ranks that block's weights are
    partitions, which a rank probing alone (its first HF generate, an evaluation of its own) fetched alone, one
    collective apart from the other ranks. It runs on a tiny block of its own now, its weights set, not drawn: a model
    whose weights are nowhere (the meta device) is probed alike, the fix goes in, and the random state is untouched."""
    from dschat import compat

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(_rwkv_config())
    random_state = torch.get_rng_state()
    assert compat.rwkv_decode_keeps_rows_apart(lm)
    assert torch.equal(torch.get_rng_state(), random_state)
    assert all(getattr(cls, name) is fix for (cls, name), fix in compat._rwkv_one_token_step_fixes().items())


def _tiny_xlstm(hidden_size):
    from transformers import xLSTMConfig

    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(xLSTMConfig(vocab_size=96, hidden_size=hidden_size, num_hidden_layers=2,
                                                      num_heads=4, bos_token_id=None, eos_token_id=None,
                                                      pad_token_id=None)).eval()
    lm.generation_config.eos_token_id = lm.generation_config.pad_token_id = None
    return lm


def test_xlstms_cache_fits_its_layers_with_the_fix(transformers_xlstm_cache):
    """transformers' xLSTMCache (5.25) sizes its states by the config's head widths rounded up to a multiple of 64
    (``qk_head_dim``: 64 * 0.5 rounded to 64, over 4 heads: 16), while the layers compute them unrounded (8): every
    forward with a cache of a 64-wide xLSTM raised "matC_old has wrong shape", one row or three, so HF generate
    answered nothing. ``compat.xlstm_cache_fits_its_layers`` finds the misfit and puts dschat's fix in: a cached
    forward and a decode step give the uncached logits, and batched greedy answers are each row's alone. A 128-wide
    xLSTM (64 and 128 wide query/key and value projections) fits as transformers has it, and nothing is replaced."""
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    from dschat import compat

    transformers_init = xLSTMCache.__init__
    lm = _tiny_xlstm(64)
    prompts, tokens = torch.randint(3, 96, (3, 5)), torch.randint(3, 96, (3, 1))
    with torch.no_grad():
        for rows in (1, 3):  # transformers' own (when this fails, transformers fixed it)
            with pytest.raises(ValueError, match="matC_old has wrong shape"):
                lm(input_ids=prompts[:rows], use_cache=True)
        whole = lm(input_ids=torch.cat([prompts, tokens], 1), use_cache=False).logits
    assert compat.xlstm_cache_fits_its_layers(lm) and xLSTMCache.__init__ is not transformers_init
    with torch.no_grad():
        prefill = lm(input_ids=prompts, use_cache=True)
        step = lm(input_ids=tokens, cache=prefill.cache, use_cache=True).logits
        assert torch.allclose(prefill.logits, whole[:, :5], atol=1e-4) and torch.allclose(step[:, -1], whole[:, -1],
                                                                                            atol=1e-4)
        call = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        answers = lm.generate(prompts, attention_mask=torch.ones_like(prompts), **call)
        for row in range(3):
            assert torch.equal(answers[row:row + 1], lm.generate(prompts[row:row + 1], **call))
    compat._XLSTM_CACHE_MEND.restore()  # (the fixture puts back what was there)
    assert xLSTMCache.__init__ is transformers_init
    assert compat.xlstm_cache_fits_its_layers(_tiny_xlstm(128)) and xLSTMCache.__init__ is transformers_init


def test_a_library_mend_whose_fix_fails_its_probe_puts_the_librarys_own_methods_back():
    """``compat.LibraryMend`` (RWKV's and xLSTM's mends): where the probe still fails with the fix in, the library's own
    methods go back and the answer is False; ``holds`` tries again at a later call (per model: xLSTM's), while
    ``holds_once`` (RWKV's) remembers the first answer and neither probes nor puts anything in again."""
    from dschat import compat

    class Library:
        def answer(self):
            return 1

    own = Library.answer
    answers = []

    def works():  # (a fix answering 2 does not mend it: 3 would)
        answers.append(Library().answer())
        return answers[-1] == 3

    mend = compat.LibraryMend(lambda: {(Library, "answer"): lambda self: 2})
    assert not mend.holds(works) and answers == [1, 2]  # probed as it is, then with the fix in
    assert Library.answer is own and mend.replaced == {}
    assert not mend.holds(works) and answers == [1, 2, 1, 2] and Library.answer is own
    assert not mend.holds_once(lambda: works) and not mend.holds_once(lambda: pytest.fail("probed twice"))
    assert answers == [1, 2, 1, 2, 1, 2] and Library.answer is own


def test_a_library_mend_whose_fix_raises_in_its_probe_puts_the_librarys_own_methods_back():
    """A probe that raises with the fix in (dschat's method not fitting another transformers' calls) is a failed
    probe too: the library's own methods go back. They stayed replaced, and RWKV's ``holds_once``, asked again, made
    its rows-alone reference with dschat's fix in place of transformers' own: the fix checked against itself."""
    from dschat import compat

    class Library:
        def answer(self):
            return 1

    def broken(self):
        raise TypeError("dschat's method, called as this library does not call it")

    own = Library.answer
    mend = compat.LibraryMend(lambda: {(Library, "answer"): broken})
    references = []

    def make_works():  # (as ``_rwkv_rows_apart_probe``: the reference made by the methods in place, then the probe)
        references.append(Library().answer())
        return lambda: Library().answer() == 3

    with pytest.raises(TypeError, match="as this library does not call it"):
        mend.holds_once(make_works)
    assert Library.answer is own and mend.replaced == {} and mend.answer is None
    with pytest.raises(TypeError):  # (asked again: the fix tried again, its reference the library's own)
        mend.holds_once(make_works)
    assert references == [1, 1] and Library.answer is own


def test_a_value_head_narrower_than_the_hidden_states_is_a_usage_error_naming_the_way_out(monkeypatch):
    """Where the width cannot be measured (a forward that fails on the meta device: here the probe is made to fail),
    the head takes the config's hidden size; a Reformer's scores failed then on a matmul's shapes, naming nothing."""
    from dschat.errors import UsageError
    from dschat.models import reward_model

    monkeypatch.setattr(reward_model, "measured_hidden_width", lambda backbone: None)
    critic = RewardModel(AutoModel.from_config(_reformer_config())).eval()
    ids = torch.randint(3, 96, (2, 6))
    with pytest.raises(UsageError, match=r"ReformerModel's hidden states are 64 wide, but the value head reads 32.*"
                                         r"meta device.*--critic_model_name_or_path"):
        critic.end_scores(ids, torch.ones_like(ids))


def test_a_trained_head_copied_next_to_a_wider_backbone_is_a_usage_error_naming_the_file_and_both_widths(tmp_path,
                                                                                                     monkeypatch):
    """A reward model's value_head.safetensors copied into another model's folder failed at load with PyTorch's
    load_state_dict "size mismatch for weight", naming neither the folder nor what to do."""
    import shutil

    from dschat.errors import UsageError
    from dschat.models import reward_model
    from dschat.models.reward_model import VALUE_HEAD_FILE

    torch.manual_seed(0)
    save_reward_model(RewardModel(AutoModel.from_config(CONFIGS["llama"]())), _Tok(), str(tmp_path / "narrow"))
    wider = CONFIGS["llama"]()
    wider.hidden_size = 48
    save_reward_model(RewardModel(AutoModel.from_config(wider)), _Tok(), str(tmp_path / "wide"))
    shutil.copy(tmp_path / "narrow" / VALUE_HEAD_FILE, tmp_path / "wide" / VALUE_HEAD_FILE)
    with pytest.raises(UsageError, match=rf"wide: its trained value head \(.*wide/{VALUE_HEAD_FILE}\) reads hidden "
                                         r"states 32 wide, but its backbone's hidden states are 48 wide.*step 2"):
        load_reward_model(str(tmp_path / "wide"))
    # (where the width could not be measured, the config's: said as such)
    monkeypatch.setattr(reward_model, "measured_hidden_width", lambda backbone: None)
    with pytest.raises(UsageError, match=r"reads hidden states 32 wide, but its backbone's config gives 48 as the "
                                         r"width of its hidden states"):
        load_reward_model(str(tmp_path / "wide"))


def test_a_head_as_wide_as_the_config_but_not_the_hidden_states_says_its_width_came_from_the_trained_head(tmp_path):
    """Where a trained head is as wide as the config's hidden size its width is taken unmeasured (9d5dd08); a
    Reformer's hidden states are twice that, and the error said the width came from a failed probe, which never ran."""
    from safetensors.torch import save_file

    from dschat.errors import UsageError
    from dschat.models.reward_model import VALUE_HEAD_FILE

    torch.manual_seed(0)
    save_reward_model(RewardModel(AutoModel.from_config(_reformer_config())), _Tok(), str(tmp_path / "rm"))
    save_file({"weight": torch.randn(1, 32)}, str(tmp_path / "rm" / VALUE_HEAD_FILE))  # (config-wide: 32, not 64)
    critic = load_reward_model(str(tmp_path / "rm")).eval()
    ids = torch.randint(3, 96, (2, 6))
    with pytest.raises(UsageError, match=r"hidden states are 64 wide, but the value head reads 32: the width of the "
                                         r"trained value head loaded into it, which equals its config's hidden size, "
                                         r"so the width was not measured"):
        critic.end_scores(ids, torch.ones_like(ids))


def test_reward_model_forward_refuses_a_batch_that_is_not_pairs():
    """A batch of 3 split into 1 chosen and 2 rejected, and the loss broadcast the one over both: a wrong loss, no
    error (from a notebook; the steps' collator always pairs)."""
    model = RewardModel(AutoModel.from_config(CONFIGS["llama"]())).eval()
    ids = torch.randint(3, 96, (3, 5))
    with pytest.raises(ValueError, match="a batch of even size \\(this one has 3 rows\\)"):
        model(ids, torch.ones_like(ids))
    with pytest.raises(ValueError, match="a batch of even size \\(this one has 1 row\\)"):  # (one answer: not "1 rows")
        model(ids[:1], torch.ones_like(ids[:1]))
    out = model(ids[:2], torch.ones_like(ids[:2]))
    assert out["chosen_mean_scores"].shape == out["rejected_mean_scores"].shape == (1,)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_reward_score_is_independent_of_padding_side(family):
    torch.manual_seed(0)
    model = RewardModel(AutoModel.from_config(CONFIGS[family]())).eval()
    ids = torch.randint(3, 96, (1, 6))
    right = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    left = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask_r = torch.tensor([[1] * 6 + [0] * 3])
    mask_l = torch.tensor([[0] * 3 + [1] * 6])
    with torch.no_grad():
        s_plain = model.end_scores(ids, torch.ones_like(ids))
        s_right = model.end_scores(right, mask_r)
        s_left = model.end_scores(left, mask_l)
    assert torch.allclose(s_plain, s_right, atol=1e-5)
    assert torch.allclose(s_plain, s_left, atol=1e-5)


def _rwkv_config(**settings):  # recurrent layers that read no attention mask
    from transformers import RwkvConfig

    return RwkvConfig(**{"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "attention_hidden_size": 32,
                         "intermediate_size": 64, "context_length": 64, "bos_token_id": None, "eos_token_id": None,
                         **settings})


@pytest.mark.parametrize("family", ["rwkv", "llama"])
def test_left_padding_that_moves_the_scores_is_warned_of_once(family, capsys):
    """RWKV's recurrence reads no attention mask (transformers' modelling), so a left-padded row scores otherwise than
    the row alone; dschat left-pads a reward model's rows in step 3 with --padded_forwards (its held-out evaluation too),
    and said nothing. Said once per family (LEFT_PADDING_MOVES_SCORES), where left-padded rows come; nothing for a
    family whose scores left padding does not move."""
    torch.manual_seed(0)
    config = _rwkv_config() if family == "rwkv" else CONFIGS[family]()
    critic = RewardModel(AutoModel.from_config(config)).eval()
    torch.nn.init.normal_(critic.v_head.weight)
    ids = torch.randint(3, 96, (2, 6))
    left, mask = ids.clone(), torch.ones_like(ids)
    left[1, :2], mask[1, :2] = 0, 0
    right = torch.cat([ids[1:, 2:], torch.zeros(1, 2, dtype=torch.long)], 1)
    with torch.no_grad():
        alone = critic.end_scores(ids[1:, 2:], torch.ones_like(ids[1:, 2:]))
        assert torch.allclose(critic.end_scores(right, mask.flip(1)[1:]), alone, atol=1e-5)  # (right padding)
        assert capsys.readouterr().out == ""
        padded = critic.end_scores(left, mask)[1:]
        said = capsys.readouterr().out
        critic.end_scores(left, mask)
    assert capsys.readouterr().out == ""  # (once)
    if family == "llama":
        assert said == "" and torch.allclose(padded, alone, atol=1e-5)
        return
    assert not torch.allclose(padded, alone, atol=1e-3)  # (what the warning says)
    assert "warning: the reward model or critic on RwkvModel scores left-padded rows otherwise" in said
    assert "its recurrent layers read no attention mask" in said and "--padded_forwards" in said


def test_pairwise_loss_subtracts_each_pairs_margin():
    """TRL's RewardTrainer (Llama 2's margin loss): -log sigmoid(chosen - rejected - margin), averaged over pairs."""
    c, r, margin = torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0.0, 1.0, 1.0]), torch.tensor([1.0, -0.5, 3.0])
    # differences 2 - 0 - 1 = 1, 0 - 1 + 0.5 = -0.5, 1 - 1 - 3 = -3
    expected = -(math.log(1 / (1 + math.exp(-1.0))) + math.log(1 / (1 + math.exp(0.5)))
                 + math.log(1 / (1 + math.exp(3.0)))) / 3
    assert pairwise_loss(c, r, margin).item() == pytest.approx(expected, rel=1e-6)
    assert pairwise_loss(c, r, torch.zeros(3)).item() == pytest.approx(pairwise_loss(c, r).item())
    with pytest.raises(ValueError, match=r"\(2,\) margins for \(3,\) pairs"):
        pairwise_loss(c, r, torch.ones(2))  # (broadcast against the pairs, it would have shifted every pair)


def test_reward_forward_splits_chosen_and_rejected():
    torch.manual_seed(0)
    model = RewardModel(AutoModel.from_config(CONFIGS["llama"]())).eval()
    ids = torch.randint(3, 96, (4, 5))
    out = model(ids, torch.ones_like(ids))
    scores = model.end_scores(ids, torch.ones_like(ids))
    assert torch.allclose(out["chosen_mean_scores"], scores[:2])
    assert torch.allclose(out["rejected_mean_scores"], scores[2:])
    assert torch.allclose(out["loss"], pairwise_loss(scores[:2], scores[2:]))
    margin = torch.tensor([0.5, -2.0])  # (the collator's, one per pair)
    with_margin = model(ids, torch.ones_like(ids), margin=margin)["loss"]
    difference = scores[:2] - scores[2:] - margin
    assert with_margin.item() == pytest.approx(-torch.log(torch.sigmoid(difference)).mean().item(), rel=1e-5)
    assert not torch.allclose(with_margin, out["loss"])


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_lora_targets_linear_layers_but_not_heads(family):
    model = AutoModelForCausalLM.from_config(CONFIGS[family]())
    targets = lora_target_modules(model)
    assert targets and not any("lm_head" in t for t in targets)
    wrapped = apply_lora(model, lora_dim=4, only_optimize_lora=True)
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_lora_on_a_mamba_model_leaves_out_the_projections_peft_refuses():
    """PEFT refuses LoRA on a Mamba-based model's out_proj (its fused kernels read the weight past any adapter); every
    Linear module being a default target, apply_lora failed there with PEFT's ValueError, for the actor and for a
    reward model on the backbone alike."""
    from transformers import MambaConfig

    from dschat.errors import UsageError

    config = MambaConfig(vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=2)
    torch.manual_seed(0)
    actor = apply_lora(AutoModelForCausalLM.from_config(config), lora_dim=4)
    adapted = {n.rsplit(".", 1)[0] for n, _ in actor.named_parameters() if "lora_A" in n}
    assert adapted and not any("out_proj" in n for n in adapted) and any("in_proj" in n for n in adapted)
    critic = RewardModel(AutoModel.from_config(config)).apply_lora(4, "", None, only_optimize_lora=True)
    assert any("lora_A" in n for n, _ in critic.named_parameters())
    with pytest.raises(UsageError, match=r"--lora_module_name 'out_proj' matches no Linear module of MambaForCausalLM "
                                         r"that PEFT can adapt \(it refuses backbone.layers.0.mixer.out_proj"):
        lora_target_modules(AutoModelForCausalLM.from_config(config), "out_proj")


def test_a_lora_module_name_matching_nothing_says_how_the_models_linear_modules_are_named():
    """DeepSpeed-Chat's --lora_module_name decoder.layers. (OPT's path) on a Llama model was refused with "matches no
    Linear module of LlamaForCausalLM" alone: the user had to load the model to find a name that would match."""
    from dschat.errors import UsageError

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(UsageError, match=re.escape("'decoder.layers.' matches no Linear module of LlamaForCausalLM "
                                                   "(its Linear modules are named like model.layers.0.self_attn.q_proj;"
                                                   " '' adapts every one)")):
        lora_target_modules(AutoModelForCausalLM.from_config(config), "decoder.layers.")


def test_lora_leaves_out_an_lm_head_of_any_name():
    """BioGPT's head is `output_projection` (tied to the embeddings): not one of the head names, it was adapted by
    default, and the merge (the hybrid engine's inference copy, saving) then refused it as a tied weight, asking to
    leave it out of a --lora_module_name never given."""
    from transformers import BioGptConfig

    from dschat.errors import UsageError
    from dschat.models.lora import check_lora_mergeable

    config = BioGptConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config)
    targets = lora_target_modules(model)
    assert targets and "output_projection" not in targets and any("self_attn" in t for t in targets)
    check_lora_mergeable(apply_lora(model, lora_dim=4))
    with pytest.raises(UsageError, match=r"matches no Linear module of BioGptForCausalLM \(output heads are never "
                                         r"adapted: .*output_projection\)"):
        lora_target_modules(AutoModelForCausalLM.from_config(config), "output_projection")


def _phimoe_config():
    from transformers import PhimoeConfig

    return PhimoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=64)


def _llama4_text_config():
    from transformers import Llama4TextConfig

    return Llama4TextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_local_experts=4, max_position_embeddings=64)


@pytest.mark.parametrize("config", [_phimoe_config, _llama4_text_config], ids=["phimoe", "llama4_text"])
def test_lora_leaves_out_a_linear_subclass_whose_forward_is_no_linear_map(config):
    """A MoE router that subclasses nn.Linear returns (logits, weights, experts): adapted by default (every Linear
    module), the model failed at its first forward inside PEFT ('tuple' object has no attribute 'dtype'). Linear
    subclasses whose forward is the linear map (Falcon's) stay targets."""
    from transformers import FalconConfig

    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_config(config()), lora_dim=4).eval()
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if "lora_A" in n}
    assert adapted and not any("router" in n for n in adapted), adapted
    ids = torch.randint(3, 96, (2, 5))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()
    falcon = AutoModelForCausalLM.from_config(FalconConfig(vocab_size=96, hidden_size=32, num_attention_heads=4,
                                                           num_hidden_layers=1))
    assert {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"} == \
        {n.rsplit(".", 1)[-1] for n in lora_target_modules(falcon)}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_checkpointing_and_lora_turn_on_without_deprecation_warnings(family):
    """--gradient_checkpointing with LoRA on an actor and on a reward model: checkpointing is on in every layer, and
    transformers' deprecated names (``gradient_checkpointing_enable``, ``is_gradient_checkpointing``, read by PEFT)
    print no FutureWarning into every run's log."""
    import warnings

    from dschat.compat import enable_activation_checkpointing

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        actor = apply_lora(AutoModelForCausalLM.from_config(CONFIGS[family]()), lora_dim=4)
        enable_activation_checkpointing(actor, use_reentrant=False)
        critic = RewardModel(apply_lora(AutoModel.from_config(CONFIGS[family]()), lora_dim=4))
        critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for model in (actor, critic):
        layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
        assert layers and all(m.gradient_checkpointing for m in layers)


def test_a_critic_checkpoints_without_reentrancy_when_deepspeed_chat_turns_it_on():
    """DeepSpeed-Chat's ``critic.gradient_checkpointing_enable()`` (its engine forwards the call to RewardModel) with no
    kwargs: torch's non-reentrant checkpoint, dschat's own and the actor's, not transformers' reentrant default."""
    critic = RewardModel(AutoModel.from_config(CONFIGS["gpt2"]()))
    critic.gradient_checkpointing_enable()
    functions = [m._gradient_checkpointing_func for m in critic.modules() if getattr(m, "gradient_checkpointing", 0)]
    assert functions and all(f.keywords.get("use_reentrant") is False for f in functions)
    critic.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})  # (asked for: kept)
    assert all(m._gradient_checkpointing_func.keywords["use_reentrant"] for m in critic.modules()
               if getattr(m, "gradient_checkpointing", 0))


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_lora_freezes_only_the_adapted_weights_and_scales_by_one_over_rank_as_deepspeed_chat(family):
    model = apply_lora(AutoModelForCausalLM.from_config(CONFIGS[family]()), lora_dim=4)
    params = dict(model.named_parameters())
    adapted = [n for n in params if n.endswith("base_layer.weight")]
    assert adapted and not any(params[n].requires_grad for n in adapted), "the adapted layers' weights are frozen"
    others = [n for n in params if not n.endswith("base_layer.weight")]
    assert all(params[n].requires_grad for n in others), "biases, embeddings, norms and adapters train"
    assert any("base_layer.bias" in n for n in others) or family == "llama"
    def scalings(wrapped):  # PEFT's per-adapter scaling dict (GPT-2's attention has a float of that name)
        return {m.scaling["default"] for m in wrapped.modules() if isinstance(getattr(m, "scaling", None), dict)}

    assert scalings(model) == {1 / 4}, "DeepSpeed-Chat adds (1 / lora_dim) * B @ A"
    custom = apply_lora(AutoModelForCausalLM.from_config(CONFIGS[family]()), lora_dim=4, lora_alpha=8)
    assert scalings(custom) == {2.0}


def test_lora_module_name_filters_and_rejects_unknown():
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    assert all("self_attn" in t for t in lora_target_modules(model, "self_attn"))
    with pytest.raises(ValueError, match="matches no Linear"):
        lora_target_modules(model, "decoder.layers.")
    with pytest.raises(ValueError, match=r"'lm_head' matches no Linear .*\(output heads are never adapted"):
        lora_target_modules(model, "lm_head")  # (a Linear, which is why the bare "matches no Linear" misled)


def test_a_lora_module_name_of_none_on_a_model_with_only_output_heads_is_refused_not_crashed():
    """A notebook's lora_module_name=None reads as empty (every Linear): a model whose only Linear is its output head
    matches none, and says so (a UsageError, no head hint), where None.split raised an AttributeError."""
    import torch.nn as nn

    class HeadOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"None matches no Linear module of HeadOnly$"):
        lora_target_modules(HeadOnly(), None)


def test_optimizer_groups_skip_decay_on_biases_and_norms_and_set_lora_lr():
    model = apply_lora(AutoModelForCausalLM.from_config(CONFIGS["opt"]()), lora_dim=4)
    groups = optimizer_param_groups(model, weight_decay=0.1, lora_learning_rate=1e-2)
    for g in groups:
        if g["weight_decay"]:
            assert all(p.ndim >= 2 for p in g["params"])
    assert any(g.get("lr") == 1e-2 for g in groups)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_saved_lora_model_loads_with_merged_weights(family, tmp_path, distributed):
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_config(CONFIGS[family]()), lora_dim=4).eval()
    for name, p in model.named_parameters():  # make the adapters non-trivial
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    ids = torch.randint(3, 96, (2, 7))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    save_causal_lm(model, _Tok(), str(tmp_path / "out"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    assert torch.allclose(expected, got, atol=1e-4)
    assert os.path.exists(tmp_path / "out" / "model.safetensors")


def test_reward_model_round_trip_keeps_scores(tmp_path, distributed):
    torch.manual_seed(0)
    model = RewardModel(AutoModel.from_config(CONFIGS["opt"]())).eval()
    torch.nn.init.normal_(model.v_head.weight)
    ids = torch.randint(3, 96, (3, 6))
    with torch.no_grad():
        expected = model.end_scores(ids, torch.ones_like(ids))
    save_reward_model(model, _Tok(), str(tmp_path / "rm"))
    loaded = load_reward_model(str(tmp_path / "rm")).eval()
    with torch.no_grad():
        assert torch.allclose(loaded.end_scores(ids, torch.ones_like(ids)), expected, atol=1e-5)


@pytest.mark.parametrize("damaged", ["model.safetensors", "value_head.safetensors"])
def test_a_truncated_weights_file_is_an_error_naming_the_folder(damaged, tmp_path, distributed):
    """It was safetensors' traceback ("Error while deserializing header"), naming no folder."""
    from dschat.errors import UsageError
    from dschat.models.loading import load_causal_lm

    model = RewardModel(AutoModel.from_config(CONFIGS["opt"]()))
    save_reward_model(model, _Tok(), str(tmp_path / "rm"))
    weights = tmp_path / "rm" / damaged
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    message = rf"{tmp_path / 'rm'}: its weights cannot be read \(SafetensorError: .*\); a weights file there is damaged"
    with pytest.raises(UsageError, match=message):
        load_reward_model(str(tmp_path / "rm"))
    if damaged != "model.safetensors":
        return
    model = AutoModelForCausalLM.from_config(CONFIGS["opt"]())
    model.save_pretrained(tmp_path / "lm")
    weights = tmp_path / "lm" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(UsageError, match=rf"{tmp_path / 'lm'}: its weights cannot be read"):
        load_causal_lm(str(tmp_path / "lm"), None)
    weights.unlink()  # DeepSpeed-Chat's format, torch's zip file, cut short
    weights = tmp_path / "lm" / "pytorch_model.bin"
    torch.save(model.state_dict(), weights)
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    with pytest.raises(UsageError, match=rf"{tmp_path / 'lm'}: its weights cannot be read \((OSError|RuntimeError)"):
        load_causal_lm(str(tmp_path / "lm"), None)
    weights.unlink()  # no weights at all: not "damaged" (it was transformers' "no file named ..." traceback)
    with pytest.raises(UsageError, match=rf"{tmp_path / 'lm'}: config.json but no weights"):
        load_causal_lm(str(tmp_path / "lm"), None)


@pytest.mark.parametrize("family", [*sorted(CONFIGS), "gpt_neox"])
def test_a_causal_lm_folder_loads_as_a_reward_model_without_a_load_report_for_its_lm_head(family, tmp_path,
                                                                                        transformers_log):
    """A step-1 folder has an LM head the backbone does not: left over by design, so transformers' "LOAD REPORT ...
    UNEXPECTED" is not logged for it; other keys would still be (the ignore pattern is taken off afterwards)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    from transformers import GPTNeoXConfig

    config = CONFIGS[family]() if family in CONFIGS else GPTNeoXConfig(  # its head is `embed_out`
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64)
    config.tie_word_embeddings = False  # the head saved as its own weight
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    backbone = MODEL_MAPPING[type(config)]
    before = backbone.__dict__.get("_keys_to_ignore_on_load_unexpected", "unset")
    RewardModel.from_pretrained(str(tmp_path))
    assert not [m for m in transformers_log if "UNEXPECTED" in m], transformers_log
    assert backbone.__dict__.get("_keys_to_ignore_on_load_unexpected", "unset") == before
    AutoModel.from_pretrained(str(tmp_path))
    assert [m for m in transformers_log if "UNEXPECTED" in m], \
        "transformers still reports the head outside the reward model"


def test_plain_model_folder_loads_as_critic_with_new_head(tmp_path, caplog):
    """Step 2 and a critic start from a plain folder with a new head; from_pretrained says so unless that is expected
    (a notebook's RewardModel.from_pretrained of a step-1 folder scored with a random head without a word), and
    load_reward_model, the call to get step 2's model, refuses it."""
    from dschat.errors import UsageError
    from dschat.models.reward_model import create_critic_model

    AutoModelForCausalLM.from_config(CONFIGS["llama"]()).save_pretrained(tmp_path / "plain")
    with caplog.at_level(logging.WARNING, logger="dschat.models.reward_model"):
        critic = create_critic_model(str(tmp_path / "plain"), tokenizer=None)
        assert critic.v_head.weight.shape == (1, 32) and not critic.value_head_loaded and not caplog.records
        RewardModel.from_pretrained(str(tmp_path / "plain"))
    assert "has no trained value head" in caplog.text and "the head is new and random" in caplog.text
    with pytest.raises(UsageError, match="plain: no trained value head .* not a reward model or critic that step 2"):
        load_reward_model(str(tmp_path / "plain"))


def _deepspeed_chat_step2_folder(folder, family="opt"):
    """A reward model as DeepSpeed-Chat's step 2 saves it: the backbone's config, and the whole RewardModel in one
    pytorch_model.bin, the backbone under its (misspelt) "rwtranrsformer." and the head as "v_head.weight"."""
    torch.manual_seed(0)
    model = RewardModel(AutoModel.from_config(CONFIGS[family]())).eval()
    torch.nn.init.normal_(model.v_head.weight)
    os.makedirs(folder)
    model.config.to_json_file(os.path.join(folder, "config.json"))
    torch.save({k.replace("rwtransformer.", "rwtranrsformer.", 1): v for k, v in model.state_dict().items()},
               os.path.join(folder, "pytorch_model.bin"))
    return model


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_deepspeed_chats_reward_model_folder_loads_with_its_backbone_and_head(zero_stage, tmp_path, distributed):
    """It loaded as a critic with every backbone weight random and a new head, said only as "no trained value head"
    (and as a reward model: "not step 2's output")."""
    import deepspeed

    from dschat.errors import UsageError
    from dschat.models.loading import load_causal_lm
    from dschat.models.reward_model import is_reward_model_folder
    from dschat.tools.common import load_scoring_reward_model
    from dschat.utils.ds_config import get_train_ds_config

    folder = str(tmp_path / "ds_chat_rm")
    original = _deepspeed_chat_step2_folder(folder)
    assert is_reward_model_folder(folder)
    ds_config = get_train_ds_config(dtype="fp32", stage=zero_stage) if zero_stage else None
    loaded = load_reward_model(folder, ds_config=ds_config).eval()
    assert loaded.value_head_loaded
    ids = torch.randint(3, 96, (3, 6))
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(loaded.parameters()), enabled=zero_stage == 3):
        assert torch.allclose(loaded.end_scores(ids, torch.ones_like(ids)),
                              original.end_scores(ids, torch.ones_like(ids)), atol=1e-5)
    assert load_scoring_reward_model(folder, None, device="cpu").value_head_loaded
    with pytest.raises(UsageError, match="a reward model .*not a policy"):
        load_causal_lm(folder, None)


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])
def test_a_one_label_sequence_classification_folder_loads_as_the_reward_model_it_is(family, tmp_path,
                                                                                   transformers_log):
    """TRL's RewardTrainer saves reward models as transformers' *ForSequenceClassification with one label
    (a "score" head): refused as "not a reward model" before. The scores are transformers' own, at the last real
    token of right-padded rows."""
    from transformers import AutoModelForSequenceClassification

    from dschat.models.loading import load_causal_lm
    from dschat.models.reward_model import is_reward_model_folder

    torch.manual_seed(0)
    config = CONFIGS[family]()
    config.num_labels, config.pad_token_id = 1, 0
    original = AutoModelForSequenceClassification.from_config(config).eval()
    original.save_pretrained(tmp_path / "rm")
    assert is_reward_model_folder(str(tmp_path / "rm"))
    loaded = load_reward_model(str(tmp_path / "rm")).eval()
    assert loaded.value_head_loaded
    assert not [m for m in transformers_log if "UNEXPECTED" in m], "the score head is the reward model's own"
    ids = torch.randint(3, 96, (3, 7))
    mask = torch.ones_like(ids)
    ids[1, 5:], mask[1, 5:] = 0, 0  # right padding with the pad id, as transformers finds each row's end
    with torch.no_grad():
        expected = original(input_ids=ids, attention_mask=mask).logits[:, 0]
        assert torch.allclose(loaded.end_scores(ids, mask), expected, atol=1e-5)
    with pytest.raises(ValueError, match="a reward model .*not a policy"):
        load_causal_lm(str(tmp_path / "rm"), None)
    config.num_labels = 2  # a classifier of two labels is no reward model
    AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "two")
    assert not is_reward_model_folder(str(tmp_path / "two"))


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2"])
def test_a_sequence_classifier_whose_pad_is_its_eos_scores_where_transformers_and_trl_score(family, tmp_path):
    """TRL trains a reward model through transformers' *ForSequenceClassification, which scores a row at its last
    token that is not the config's pad id: with pad == EOS (a common setting), the token before the answer's EOS.
    dschat scored the EOS itself, a position the head was never trained on, so step 3's rewards (and rw_eval's,
    eval.py's) were another function of the text than the model's. Scored as transformers does, on the masked
    forward and on step 3's shifted rows; a frozen scorer saved and loaded again keeps it; a critic started from it
    trains at the last token as dschat's heads do."""
    from types import SimpleNamespace

    from transformers import AutoModelForSequenceClassification

    from dschat.rlhf.layout import LeftAligned
    from dschat.rlhf.trainer import DeepSpeedPPOTrainer
    from dschat.tiny import load_tiny_tokenizer

    eos = 2
    torch.manual_seed(0)
    config = CONFIGS[family]()
    config.num_labels, config.pad_token_id, config.eos_token_id = 1, eos, eos
    original = AutoModelForSequenceClassification.from_config(config).eval()
    original.save_pretrained(tmp_path / "rm")
    ids = torch.randint(3, 96, (3, 8))
    mask = torch.ones_like(ids)
    ids[0, 7] = eos  # an answer ended by its EOS
    ids[1, 5], ids[1, 6:], mask[1, 6:] = eos, eos, 0  # ... then right padding with the pad (== EOS) id
    ids[2, :2], mask[2, :2], ids[2, 7] = eos, 0, eos  # left padding, as step 3's prompts
    with torch.no_grad():
        expected = original(input_ids=ids, attention_mask=mask).logits[:, 0]
        # (the left-padded row as it is alone: GPT-2's own forward gives left padding positions, dschat's does not)
        expected[2] = original(input_ids=ids[2:, 2:]).logits[0, 0]
    scorer = load_reward_model(str(tmp_path / "rm")).eval()
    with torch.no_grad():
        assert torch.allclose(scorer.end_scores(ids, mask), expected, atol=1e-5)
        assert torch.allclose(scorer.forward_value(ids, mask)["chosen_end_scores"], expected, atol=1e-5)
        stand_in = SimpleNamespace(reward_model=SimpleNamespace(module=scorer), reward_fn=None,
                                   args=SimpleNamespace(reward_model_weight=1.0))
        layout = LeftAligned.of(mask)
        assert layout is not None
        shifted = DeepSpeedPPOTrainer._scores(stand_in, {}, ids, mask, None, None, layout)
        assert torch.allclose(shifted, expected, atol=1e-5)
    save_reward_model(scorer, load_tiny_tokenizer(), str(tmp_path / "saved"))
    with torch.no_grad():
        again = load_reward_model(str(tmp_path / "saved")).eval().end_scores(ids, mask)
    assert torch.allclose(again, expected, atol=1e-5)
    critic = create_critic_model(str(tmp_path / "rm"), None, rlhf_training=True)
    assert critic.score_skips_token_id is None


def _openrlhf_reward_folder(family, folder, prefix, normalization, record_prefix=True, weights="safetensors"):
    """A reward model in the layout OpenRLHF's save_model writes: transformers' one-label sequence classifier's weights
    (the backbone under its base_model_prefix, a Linear without bias) with the head named ``prefix``, config.json naming
    the class "RewardModel" with two labels (transformers' default), the prefix and the normalization. ``weights``:
    "bin" and "bin_legacy" save a pytorch_model.bin instead (torch's zip format, its old format)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForSequenceClassification

    config = CONFIGS[family]()
    config.num_labels, config.pad_token_id = 1, 0
    original = AutoModelForSequenceClassification.from_config(config).eval()
    original.save_pretrained(folder)
    state = load_file(folder / "model.safetensors")
    state[f"{prefix}.weight"] = state.pop("score.weight")
    if weights == "safetensors":
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    else:
        (folder / "model.safetensors").unlink()
        torch.save(state, folder / "pytorch_model.bin", _use_new_zipfile_serialization=weights == "bin")
    saved = json.loads((folder / "config.json").read_text())
    saved.update(architectures=["RewardModel"], id2label={"0": "LABEL_0", "1": "LABEL_1"},
                 label2id={"LABEL_0": 0, "LABEL_1": 1}, normalize_reward=normalization is not None)
    if record_prefix:
        saved["value_head_prefix"] = prefix
    if normalization:
        saved["mean"], saved["std"] = normalization
    (folder / "config.json").write_text(json.dumps(saved))
    return original


@pytest.mark.parametrize("family,prefix,normalization,record_prefix,weights", [
    ("llama", "score", (0.75, 2.5), True, "safetensors"), ("opt", "value_head", None, False, "bin"),
    ("gpt2", "score", None, True, "safetensors"), ("llama", "value_head", (-1.0, 0.5), True, "bin_legacy")])
def test_an_openrlhf_reward_model_scores_as_openrlhf_does(family, prefix, normalization, record_prefix, weights,
                                                          tmp_path, caplog, transformers_log):
    """OpenRLHF saves reward models as class "RewardModel" with its value head's name in config.json (older releases:
    "value_head", not recorded) and, trained with --normalize_reward, the eval scores' mean and std, by which it
    divides its scores: refused as "not a reward model" before. As a frozen scorer it scores so; trained (a critic,
    step 2) it starts from the raw scores."""
    from dschat.models.loading import load_causal_lm
    from dschat.models.reward_model import is_reward_model_folder

    torch.manual_seed(0)
    folder = tmp_path / "rm"
    original = _openrlhf_reward_folder(family, folder, prefix, normalization, record_prefix, weights)
    assert is_reward_model_folder(str(folder))
    with caplog.at_level(logging.INFO):
        scorer = load_reward_model(str(folder)).eval()
        critic = create_critic_model(str(folder), None).eval()
    assert scorer.value_head_loaded and critic.value_head_loaded
    assert not [m for m in transformers_log if "UNEXPECTED" in m], "the value head is the reward model's own"
    ids = torch.randint(3, 96, (3, 7))
    mask = torch.ones_like(ids)
    ids[1, 5:], mask[1, 5:] = 0, 0
    with torch.no_grad():
        raw = original(input_ids=ids, attention_mask=mask).logits[:, 0]
        mean, std = normalization or (0.0, 1.0)
        assert torch.allclose(scorer.end_scores(ids, mask), (raw - mean) / std, atol=1e-5)
        assert torch.allclose(critic.end_scores(ids, mask), raw, atol=1e-5)
    assert ("starts from the raw scores" in caplog.text) == (normalization is not None)
    with pytest.raises(ValueError, match="a reward model .*not a policy"):
        load_causal_lm(str(folder), None)


@pytest.mark.parametrize("layout", ["sequence_classification_sharded", "openrlhf", "dschat"])
def test_a_hub_reward_model_loads_by_its_name(layout, hub_cache, tmp_path):
    """A reward model on the hub (Skywork-Reward, a one-label *ForSequenceClassification; OpenRLHF's; dschat's) was "no
    trained value head" by its name: the head is read from the folder's files, and a hub name had no folder. Its
    snapshot folder is that folder now, with the weights from_pretrained reads (sharded: every shard)."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    name = f"acme/{layout}-rm"
    if layout == "openrlhf":
        original = _openrlhf_reward_folder("opt", tmp_path / "saved", "value_head", (0.5, 2.0))
        hub_cache(name, lambda folder: __import__("shutil").copytree(tmp_path / "saved", folder))
        mean, std = 0.5, 2.0
    elif layout == "dschat":
        original = RewardModel(AutoModel.from_config(CONFIGS["gpt2"]())).eval()
        torch.nn.init.normal_(original.v_head.weight)
        hub_cache(name, lambda folder: save_reward_model(original, _Tok(), str(folder)))
        mean, std = 0.0, 1.0
    else:
        config = CONFIGS["llama"]()
        config.num_labels, config.pad_token_id = 1, 0
        original = AutoModelForSequenceClassification.from_config(config).eval()
        snapshot = hub_cache(name, lambda folder: original.save_pretrained(folder, max_shard_size="20KB"))
        assert (snapshot / "model.safetensors.index.json").is_file(), "the weights should be sharded"
        mean, std = 0.0, 1.0
    loaded = load_reward_model(name).eval()
    assert loaded.value_head_loaded
    ids = torch.randint(3, 96, (2, 6))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        raw = (original.forward_value(ids, mask)["chosen_end_scores"] if layout == "dschat"
               else original(input_ids=ids, attention_mask=mask).logits[:, 0])
        assert torch.allclose(loaded.end_scores(ids, mask), (raw - mean) / std, atol=1e-5)


def test_a_hub_model_without_a_value_head_is_no_reward_model_by_its_name(hub_cache):
    plain = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    hub_cache("acme/plain-lm", plain.save_pretrained)
    with pytest.raises(ValueError, match="acme/plain-lm: no trained value head"):
        load_reward_model("acme/plain-lm")
    assert not create_critic_model("acme/plain-lm", None).value_head_loaded, "a critic starts from it with a new head"
    with pytest.raises(FileNotFoundError, match="acme/nothing: no such folder here, nor a model of that name in the "
                                                "Hugging Face hub cache"):
        load_reward_model("acme/nothing")


def test_a_hub_model_without_a_value_head_is_refused_as_a_scorer_before_it_loads(hub_cache, monkeypatch):
    """Step 3 and the eval tools checked a local folder's value head before any model loaded, a hub name's only once
    it had loaded (step 3: after the actor, the reference and the critic too)."""
    from dschat.errors import UsageError
    from dschat.rlhf.config import check_reward_model_trained
    from dschat.tools.common import load_scoring_reward_model

    plain = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    hub_cache("acme/plain-lm", plain.save_pretrained)
    monkeypatch.setattr("transformers.AutoModel.from_pretrained", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(UsageError, match="step3: the reward model acme/plain-lm has no trained value head"):
        check_reward_model_trained("acme/plain-lm")
    with pytest.raises(UsageError, match="acme/plain-lm: not a reward model"):
        load_scoring_reward_model("acme/plain-lm", None)


def test_a_hub_reward_models_files_are_fetched_once_per_process(hub_cache, monkeypatch):
    """Step 3's check of a hub reward model fetched its files twice (``has_trained_value_head``, then whether it is a
    critic), its load a third time: online, each a round of hub requests for every file. Once now; a snapshot removed
    since is fetched again (here: it is gone from the hub cache, an error), not taken from what this process saw."""
    import shutil

    from dschat.errors import MissingInputError
    from dschat.models.reward_model import has_trained_value_head
    from dschat.rlhf.config import check_reward_model_trained
    from helpers import hub_files_asked

    name = "acme/fetched-once-rm"
    snapshot = hub_cache(name, lambda folder: save_reward_model(RewardModel(AutoModel.from_config(CONFIGS["gpt2"]())),
                                                                _Tok(), str(folder)))
    asked = hub_files_asked(monkeypatch, name)
    check_reward_model_trained(name)
    assert has_trained_value_head(name)
    assert asked.count("config.json") == 1, asked
    shutil.rmtree(snapshot)
    with pytest.raises(MissingInputError, match=f"{name}: no such folder here, nor a model of that name"):
        has_trained_value_head(name)


def test_a_hub_reward_models_file_a_connection_error_left_unfetched_is_asked_again(hub_cache, reachable_hub,
                                                                                    monkeypatch):
    """Online, a value head that a connection error left unfetched (the hub client answers None, as for a file the
    model has not) was kept as missing: the folder fetched once per process, the reward model stayed "not a reward
    model" at each later check after the network came back (a notebook's retry). Such a fetch is not kept now; a
    file the hub said the model has not (its cache's .no_exist marker) is settled, the folder kept."""
    import shutil

    import transformers.utils.hub

    from dschat.models.reward_model import REWARD_META_FILE, VALUE_HEAD_FILE, has_trained_value_head

    name = "acme/flaky-network-rm"
    snapshot = hub_cache(name, lambda folder: save_reward_model(RewardModel(AutoModel.from_config(CONFIGS["gpt2"]())),
                                                                _Tok(), str(folder)))
    aside = snapshot.parent.parent / VALUE_HEAD_FILE
    shutil.move(snapshot / VALUE_HEAD_FILE, aside)  # (not downloaded yet)
    network_up, asked = [False], []

    def fetched(repo, filename, **kwargs):  # (the hub client: a file of the snapshot, downloaded where it is up)
        asked.append(filename)
        if filename == VALUE_HEAD_FILE and network_up[0] and aside.exists():
            shutil.move(aside, snapshot / filename)
        return str(snapshot / filename) if (snapshot / filename).exists() else None

    monkeypatch.setattr(transformers.utils.hub, "cached_file", fetched)
    assert not has_trained_value_head(name)
    network_up[0] = True
    assert has_trained_value_head(name)
    asked.clear()
    assert has_trained_value_head(name) and asked == []  # (all there: kept)
    name = "acme/rm-without-meta"  # (the hub said it has no reward_model.json: its .no_exist marker)
    snapshot = hub_cache(name, lambda folder: save_reward_model(RewardModel(AutoModel.from_config(CONFIGS["gpt2"]())),
                                                                _Tok(), str(folder)))
    (snapshot / REWARD_META_FILE).unlink()
    no_exist = snapshot.parent.parent / ".no_exist" / snapshot.name
    no_exist.mkdir(parents=True)
    (no_exist / REWARD_META_FILE).touch()
    assert has_trained_value_head(name) and has_trained_value_head(name)
    assert asked.count("config.json") == 1, asked


def test_step3_warns_once_of_a_critic_it_would_be_rewarded_by(tmp_path, capsys):
    """The reward model defaults to --critic_model_name_or_path, so PPO continued from an earlier step 3's critic (one
    marked in its reward_model.json, or critic/ in a step-3 folder) with no reward model given was rewarded by the
    critic's value estimates, unsaid. Warned of once (not refused); step 2's reward model is not."""
    import json

    from dschat.rlhf.config import check_earlier_step_outputs, step3_args
    from dschat.run_layout import ACTOR_DIR, RUN_ARGS_FILE

    torch.manual_seed(0)
    actor = str(tmp_path / "sft")
    save_causal_lm(AutoModelForCausalLM.from_config(CONFIGS["llama"]()), _Tok(), actor)
    value_model = RewardModel(AutoModel.from_config(CONFIGS["llama"]()))
    step2 = str(tmp_path / "step2_rm")
    save_reward_model(value_model, _Tok(), step2)
    (tmp_path / "step2_rm" / RUN_ARGS_FILE).write_text("{}")
    placed = str(tmp_path / "step3_ppo" / "critic")  # an earlier step 3's critic/, beside its actor
    save_reward_model(value_model, _Tok(), placed)
    save_causal_lm(AutoModelForCausalLM.from_config(CONFIGS["llama"]()), _Tok(), str(tmp_path / "step3_ppo" / ACTOR_DIR))
    value_model.trained_as_critic = True  # (as step 3's engine marks its critic)
    marked = str(tmp_path / "my_critic")  # a notebook's save_reward_model(engine.critic, ...)
    save_reward_model(value_model, _Tok(), marked)
    assert json.loads((tmp_path / "my_critic" / "reward_model.json").read_text())["role"] == "critic"

    def warnings(critic, reward=None):
        capsys.readouterr()
        args = step3_args({"actor_model_name_or_path": actor, "critic_model_name_or_path": critic,
                           "reward_model_name_or_path": reward})
        for _ in range(2):  # (step 3's main checks, then its engine)
            check_earlier_step_outputs(args)
        captured = capsys.readouterr()
        return [line for line in (captured.out + captured.err).splitlines() if "warning" in line]

    for critic in (marked, placed):
        assert warnings(critic) == [
            f"warning: step3: {critic}: step 3's critic (the value model PPO trains beside the actor), not a reward "
            "model: it scores with PPO's value estimates, not step 2's rewards (step 2's output folder, e.g. "
            "train.py's <output>/step2_rm, holds the reward model); give it with --reward_model_name_or_path, which "
            "defaults to --critic_model_name_or_path"]
    assert warnings(step2) == []
    assert warnings(placed, reward=step2) == []  # (its reward model given)
    # given as the reward model itself: warned of, without the advice to give it by that flag
    assert warnings(placed, reward=placed) == [
        f"warning: step3: {placed}: step 3's critic (the value model PPO trains beside the actor), not a reward "
        "model: it scores with PPO's value estimates, not step 2's rewards (step 2's output folder, e.g. "
        "train.py's <output>/step2_rm, holds the reward model)"]


def test_a_reward_model_trained_from_an_openrlhf_one_scores_raw_once_saved(tmp_path, distributed):
    """Its config.json kept OpenRLHF's mean and std, by which the scores of the head trained here (on raw scores) were
    divided again when it scored (step 3 after step 2)."""
    import json

    torch.manual_seed(0)
    _openrlhf_reward_folder("llama", tmp_path / "openrlhf", "score", (0.75, 2.5))
    trained = create_critic_model(str(tmp_path / "openrlhf"), None).eval()
    torch.nn.init.normal_(trained.v_head.weight)  # as step 2 would leave it
    save_reward_model(trained, _Tok(), str(tmp_path / "rm"))
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert not {"normalize_reward", "mean", "std", "value_head_prefix"} & set(config)
    scorer = load_reward_model(str(tmp_path / "rm")).eval()
    assert scorer.score_normalization is None
    ids = torch.randint(3, 96, (2, 6))
    with torch.no_grad():
        assert torch.allclose(scorer.end_scores(ids, torch.ones_like(ids)),
                              trained.end_scores(ids, torch.ones_like(ids)), atol=1e-5)


def test_a_normalizing_scorer_saved_as_loaded_scores_as_before(tmp_path, distributed):
    """An OpenRLHF reward model loaded to score divides its scores by its mean and std (score_normalization):
    save_reward_model dropped them with its config's keys, so the saved copy scored raw, silently other scores.
    A critic started from the saved copy still starts from the raw scores."""
    torch.manual_seed(0)
    _openrlhf_reward_folder("llama", tmp_path / "openrlhf", "score", (0.75, 2.5))
    scorer = load_reward_model(str(tmp_path / "openrlhf")).eval()
    save_reward_model(scorer, _Tok(), str(tmp_path / "rm"))
    again = load_reward_model(str(tmp_path / "rm")).eval()
    assert again.score_normalization == (0.75, 2.5)
    ids = torch.randint(3, 96, (2, 6))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        assert torch.allclose(again.end_scores(ids, mask), scorer.end_scores(ids, mask), atol=1e-5)
    assert create_critic_model(str(tmp_path / "rm"), None).score_normalization is None
    import json

    meta = tmp_path / "rm" / "reward_model.json"  # a damaged copy: an error naming it, not a traceback or inf scores
    recorded = json.loads(meta.read_text())
    key = "score_normalization"
    for damaged, said in (({"mean": 0.75, "std": 0}, "divides scores by its std, 0.0"),
                          ({"mean": "x", "std": 2.5}, "must be finite numbers"), ([0.75, 2.5], "expected")):
        meta.write_text(json.dumps({**recorded, key: damaged}))
        with pytest.raises(ValueError, match=f"reward_model.json's {key}.*{said}"):
            load_reward_model(str(tmp_path / "rm"))


def test_a_reward_model_saved_in_a_newer_format_version_is_refused_naming_its_file(tmp_path, distributed):
    """reward_model.json records its format's "version" (1), but loading never read it: a file of a newer dschat's
    format loaded as this one's, its keys read as they mean here or not at all. A newer version (or no number) is a
    UsageError naming the file, before the backbone loads; the version this dschat writes still loads."""
    import json

    from dschat.errors import UsageError

    save_reward_model(RewardModel(AutoModel.from_config(CONFIGS["opt"]())), _Tok(), str(tmp_path / "rm"))
    meta = tmp_path / "rm" / "reward_model.json"
    recorded = json.loads(meta.read_text())
    assert recorded["version"] == 1
    newer = r"version 2 of dschat's reward-model format, newer than this dschat reads \(version 1\)"
    for version, said in ((2, newer), ("2", 'its "version" is \'2\', not a version number')):
        meta.write_text(json.dumps({**recorded, "version": version}))
        with pytest.raises(UsageError, match=f"^{re.escape(str(meta))}: {said}"):
            load_reward_model(str(tmp_path / "rm"))
    meta.write_text(json.dumps(recorded))
    assert load_reward_model(str(tmp_path / "rm")).value_head_loaded


def test_an_openrlhf_reward_model_whose_head_is_missing_is_no_reward_model(tmp_path):
    import json

    folder = tmp_path / "rm"
    _openrlhf_reward_folder("llama", folder, "score", None)
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, "value_head_prefix": "reward_head"}))
    from dschat.models.reward_model import is_reward_model_folder

    assert not is_reward_model_folder(str(folder)), "config.json names a head the weights lack"
    with pytest.raises(ValueError, match="no trained value head"):
        load_reward_model(str(folder))
    (folder / "config.json").write_text(json.dumps({**saved, "normalize_reward": True, "mean": 0.5, "std": 0.0}))
    with pytest.raises(ValueError, match="divides scores by its std, 0.0, which must be > 0"):
        load_reward_model(str(folder))
    for mean, std in ((None, None), ("abc", 1.0), (float("nan"), 1.0), (0.0, float("inf"))):  # (float()'s traceback)
        (folder / "config.json").write_text(json.dumps({**saved, "normalize_reward": True, "mean": mean, "std": std}))
        with pytest.raises(ValueError, match=r"scores \(score - mean\) / std, whose mean and std must be finite"):
            load_reward_model(str(folder))


def test_a_checkpoint_whose_weights_are_named_for_another_layout_is_an_error(tmp_path):
    """transformers loads it with every weight new (a "LOAD REPORT ... MISSING"), and it trained from random values."""
    from dschat.errors import UsageError
    from dschat.models.loading import load_causal_lm, load_tokenizer

    model = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    model.config.save_pretrained(tmp_path)
    torch.save({f"module.{k}": v for k, v in model.state_dict().items()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UsageError, match=r"of the \d+ weights of LlamaForCausalLM are not in its checkpoint .*"
                                         r"named e\.g\. module\..*would train from random values"):
        load_causal_lm(str(tmp_path), None)
    with pytest.raises(UsageError, match=r"of the \d+ weights of LlamaModel are not in its checkpoint"):
        load_reward_model(str(tmp_path))
    torch.save({k: v for k, v in model.state_dict().items() if "layers.1." not in k}, tmp_path / "pytorch_model.bin")
    assert load_causal_lm(str(tmp_path), load_tokenizer("tiny-llama")) is not None, \
        "a part missing stays transformers' warning"


def test_atomic_folder_leaves_old_contents_when_writing_fails(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "weights").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_folder(str(target)) as tmp:
            open(os.path.join(tmp, "weights"), "w").write("half")
            raise RuntimeError("crash while saving")
    assert (target / "weights").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def _sharded_save(folder, seed):
    """A model saved as several shards and their index, in ``folder``; its weights."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    model.save_pretrained(folder, max_shard_size="20KB")
    assert len([name for name in os.listdir(folder) if name.startswith("model-0")]) > 2
    return model.state_dict()


def _killed_save(target, kill_at, staged=lambda folder: None):
    """A sharded save into ``target`` (and what ``staged`` writes beside it) killed at the ``kill_at``-th rename of
    its switch: whether it was (a switch of fewer renames is not)."""
    renames = [0]

    def rename(real):
        def killable(*args, **kwargs):
            renames[0] += 1
            if renames[0] == kill_at:
                raise KeyboardInterrupt
            return real(*args, **kwargs)
        return killable

    with pytest.MonkeyPatch.context() as patch:
        try:
            with atomic_folder(str(target)) as tmp:
                _sharded_save(tmp, seed=2)
                staged(tmp)
                patch.setattr(os, "rename", rename(os.rename))
                patch.setattr(os, "replace", rename(os.replace))
        except KeyboardInterrupt:
            return True
    return False


def _same_weights(folder, state):
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    return all(torch.equal(loaded[name], tensor) for name, tensor in state.items())


def test_a_sharded_save_killed_while_it_replaces_a_folder_leaves_the_old_or_the_new_model_whole(tmp_path, monkeypatch):
    """Its shards went in one rename at a time: a kill between two left new and old shards mixed in the folder,
    which loaded as neither model. The folders are now swapped: a kill at any rename leaves the earlier model or the
    new one (or, between the swap's two renames, the new one beside it), and the next save or run there finishes the
    switch, keeping the folder's other files (a log, the step's checkpoints)."""
    from dschat.run_layout import save_leftovers
    from dschat.steps.common import check_output_dir

    old = _sharded_save(tmp_path / "reference_old", seed=1)
    new = _sharded_save(tmp_path / "reference_new", seed=2)
    kill_at = 1
    while True:
        target = tmp_path / f"run{kill_at}" / "model"
        _sharded_save(target, seed=1)
        (target / "training.log").write_text("log")
        (target / "checkpoints").mkdir()
        (target / "checkpoints" / "latest").write_text("step 3")
        if not _killed_save(target, kill_at):
            break
        if target.exists():
            assert _same_weights(target, old) or _same_weights(target, new), f"killed at rename {kill_at}: mixed"
        else:  # (between the swap's two renames)
            assert _same_weights(target.parent / ".model.save-new", new)
            assert "is the finished copy of a save interrupted" in "; ".join(save_leftovers(str(target)))
        check_output_dir(str(target.parent), torch.device("cpu"))  # (a step's start: step 3's actor is in its folder)
        assert _same_weights(target, old) or _same_weights(target, new), kill_at
        assert (target / "training.log").read_text() == "log" and (target / "checkpoints" / "latest").is_file()
        assert sorted(os.listdir(target.parent)) == ["model"], kill_at
        kill_at += 1
    assert kill_at > 3  # (the switch took several renames, each of which was killed once)
    assert _same_weights(target, new) and (target / "training.log").read_text() == "log"
    assert not (target / "model.safetensors").exists() and sorted(os.listdir(target.parent)) == ["model"]
    folder = os.stat(target).st_ino
    monkeypatch.chdir(target)  # (the process's relative paths lead into it: saved into file by file, as before)
    with atomic_folder(str(target)) as tmp:
        _sharded_save(tmp, seed=1)
    assert os.stat(target).st_ino == folder and _same_weights(target, old)


def test_a_model_folder_swapped_out_by_a_killed_save_is_said_by_every_loader_with_its_new_copy(tmp_path):
    """A save killed between the two renames that swap its finished copy in leaves no folder at the model's path, the
    new model whole beside it: loading it said "no such folder" (or, for a bare name, asked the hub), not where the
    model is nor how to finish the save. The loaders now say both, and load the new model once it is finished."""
    from dschat.errors import UsageError
    from dschat.models.checkpoint import finish_interrupted_save
    from dschat.models.loading import load_causal_lm, load_tokenizer

    new = _sharded_save(tmp_path / "reference_new", seed=2)
    kill_at = 1
    while True:  # (the kill between the swap's renames)
        target = tmp_path / f"run{kill_at}" / "model"
        _sharded_save(target, seed=1)
        assert _killed_save(target, kill_at), "no kill left the folder swapped out"
        if not target.exists():
            break
        kill_at += 1
    said = (re.escape(str(target)) + r": no folder there now: a save that replaced it was interrupted between its "
            r"renames, and its finished copy is " + re.escape(str(target.parent / ".model.save-new")))
    for load in (lambda: load_causal_lm(str(target), _Tok()), lambda: load_tokenizer(str(target)),
                 lambda: RewardModel.from_pretrained(str(target))):
        with pytest.raises(UsageError, match=said + ".*finish_interrupted_save"):
            load()
    finish_interrupted_save(str(target))
    assert _same_weights(target, new)


def test_the_interrupted_save_messages_call_to_finish_it_runs_as_said_for_a_pathlib_path(tmp_path):
    """The refusal of a folder a save was killed in names a Python call that finishes the save: given a
    ``pathlib.Path``, it said ``recover_interrupted_swap(PosixPath('...'))``, which fails as copied (PosixPath not
    imported), under a name that said only the swap though it also finishes the move file by file. It now says
    ``finish_interrupted_save('...')`` with the plain path, and that call, run as said, finishes the save."""
    from dschat.models import checkpoint
    from dschat.run_layout import interrupted_save_message

    (tmp_path / ".swapped.save-new").mkdir()  # (killed between the swap's renames: no folder, the new copy beside)
    (tmp_path / ".swapped.save-new" / "config.json").write_text("{}")
    (tmp_path / "moving" / ".moving.save-moving").mkdir(parents=True)  # (killed while it moved its files in)
    calls = {}
    for name in ("swapped", "moving"):
        message = interrupted_save_message(tmp_path / name)
        call = re.search(r"dschat\.models\.checkpoint\.finish_interrupted_save\((.*?)\)", message)
        assert call and "PosixPath" not in message, message
        assert call[1] == repr(str(tmp_path / name)), message
        calls[name] = call[0]
    exec(f"import dschat.models.checkpoint; {calls['swapped']}")
    assert (tmp_path / "swapped" / "config.json").is_file() and interrupted_save_message(tmp_path / "swapped") is None
    assert checkpoint.recover_interrupted_swap is checkpoint.finish_interrupted_save  # (the earlier name still works)


def _templates(folder, name):
    """A tokenizer's folder of named chat templates (a save's subfolder), holding ``name``."""
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / f"{name}.jinja").write_text(name)


def test_a_save_moved_in_file_by_file_and_killed_part_way_is_finished_never_loaded_mixed(tmp_path, monkeypatch):
    """Into a folder that cannot be swapped (the working directory, a mount point) a save moves its files one by one:
    a kill between two left new and old shards (or a new config over old weights) in the folder, with nothing to tell
    it from a whole model (the rest of the new files, in the staging folder, were removed by the next save as an
    unfinished copy), and a save with a subfolder (a tokenizer's chat templates) failed with a NameError. The finished
    copy is marked whole before its first file moves: a kill part-way is refused as a model and said as a leftover,
    and a step's start (or the next save) there finishes moving it in."""
    from dschat.errors import UsageError
    from dschat.models.loading import check_model_path
    from dschat.run_layout import save_leftovers
    from dschat.steps.common import check_output_dir

    old = _sharded_save(tmp_path / "reference_old", seed=1)
    new = _sharded_save(tmp_path / "reference_new", seed=2)
    kill_at, mixed = 1, 0
    while True:
        target = tmp_path / f"run{kill_at}" / "model"
        _sharded_save(target, seed=1)
        _templates(target, "old")
        (target / "training.log").write_text("log")
        monkeypatch.chdir(target)  # (the process's relative paths lead into it: saved into file by file)
        folder = os.stat(target).st_ino
        if not _killed_save(target, kill_at, lambda tmp: _templates(Path(tmp), "new")):
            break
        if (target / ".model.save-moving").is_dir():
            mixed += 1
            with pytest.raises(UsageError, match=r"--model_name_or_path .*model holds part of a save interrupted "
                                                 r"while it moved its files in one by one"):
                check_model_path(str(target), "--model_name_or_path")
            assert "holds part of a save interrupted" in "; ".join(save_leftovers(str(target)))
        else:
            assert _same_weights(target, old), kill_at
        moving = (target / ".model.save-moving").is_dir()
        check_output_dir(str(target.parent), torch.device("cpu"))  # (a step's start: step 3's actor is in its folder)
        whole = new if moving else old
        assert _same_weights(target, whole), kill_at
        assert os.listdir(target / "additional_chat_templates") == ["new.jinja" if moving else "old.jinja"], kill_at
        assert (target / "training.log").read_text() == "log" and os.stat(target).st_ino == folder
        assert not [name for name in os.listdir(target) if name.startswith(".model.save")], kill_at
        check_model_path(str(target), "--model_name_or_path")
        kill_at += 1
    assert mixed > 3  # (the files went in by several renames, each of which was killed once)
    assert _same_weights(target, new) and os.listdir(target / "additional_chat_templates") == ["new.jinja"]
    assert os.stat(target).st_ino == folder and (target / "training.log").read_text() == "log"
    assert not [name for name in os.listdir(target) if name.startswith(".model.")]


def test_a_move_killed_while_its_finished_copy_was_removed_keeps_the_model(tmp_path):
    """A save moved in file by file ends by removing its emptied copy, the record of the names it wrote last: a kill
    in that removal left the copy's folder without it, and the next save or step start there read no names written
    and removed every model file in the folder, the new save's weights, config and tokenizer. The earlier save's files
    went before that removal began: nothing is removed then."""
    from dschat.models.checkpoint import finish_interrupted_move
    from dschat.run_layout import save_moving_path

    target = tmp_path / "model"
    new = _sharded_save(target, seed=2)
    (target / "training.log").write_text("log")
    os.mkdir(save_moving_path(str(target)))  # (emptied: its record of the names was removed before the kill)
    finish_interrupted_move(str(target))
    assert not os.path.exists(save_moving_path(str(target)))
    assert _same_weights(target, new) and (target / "training.log").read_text() == "log"


def test_a_model_save_that_fills_the_disk_is_the_oserror_a_full_disk_gives_naming_the_folder(tmp_path, monkeypatch):
    """safetensors' error on a full disk ("SafetensorError: Error while serializing: I/O error: No space left on device
    (os error 28)") ended a step's final save in a traceback, read as a bug's; it is now the OSError any other write
    gives (ENOSPC, EDQUOT), naming the model folder and the space left, which the scripts say in one line. The earlier
    model stays, and other errors stay their own."""
    import errno

    import transformers.modeling_utils
    from safetensors import SafetensorError

    out = tmp_path / "out"
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    save_causal_lm(model, _Tok(), str(out))
    before = (out / "model.safetensors").read_bytes()
    for message, code in (("No space left on device (os error 28)", errno.ENOSPC),
                          ("Disk quota exceeded (os error 122)", errno.EDQUOT)):
        def full(*args, **kwargs):
            raise SafetensorError(f"Error while serializing: I/O error: {message}")

        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
        with pytest.raises(OSError) as failed:
            save_causal_lm(model, _Tok(), str(out))
        assert (failed.value.errno, failed.value.filename) == (code, str(out))
        free = r" \(\d+\.\d MiB free\)" if code == errno.ENOSPC else ""  # (a quota's limit is not the disk's space)
        assert re.fullmatch(rf"{os.strerror(code)}{free}", failed.value.strerror), failed.value.strerror
        assert (out / "model.safetensors").read_bytes() == before and sorted(os.listdir(tmp_path)) == ["out"]

    def other(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: Input/output error (os error 5)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", other)
    with pytest.raises(SafetensorError, match="os error 5"):
        save_causal_lm(model, _Tok(), str(out))


def test_atomic_writes_get_the_permissions_of_a_plain_mkdir_and_open(tmp_path):
    import stat

    from safetensors.torch import save_file

    from dschat.data.cache import ensure_built
    from dschat.data.splits import _save_npy_atomically

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    old = os.umask(0o022)
    try:
        with atomic_folder(str(tmp_path / "model")) as tmp:
            open(os.path.join(tmp, "weights"), "w").write("new")
            save_file({"w": torch.zeros(2)}, os.path.join(tmp, "model.safetensors"))  # safetensors writes 0o600
            os.symlink(private, os.path.join(tmp, "linked"))  # what a link points to keeps its mode
        ensure_built(str(tmp_path / "cache"),
                     lambda folder: save_file({"w": torch.zeros(2)}, os.path.join(folder, "x.safetensors")))
        _save_npy_atomically(str(tmp_path / "split.npy"), np.arange(3))
    finally:
        os.umask(old)
    mode = {name: stat.S_IMODE(os.stat(tmp_path / name).st_mode) for name in ("model", "cache", "split.npy")}
    mode.update({name: stat.S_IMODE(os.stat(tmp_path / name).st_mode)
                 for name in ("model/model.safetensors", "cache/x.safetensors")})
    assert mode == {"model": 0o755, "cache": 0o755, "split.npy": 0o644,  # tempfile's are 0o700 / 0o600
                    "model/model.safetensors": 0o644, "cache/x.safetensors": 0o644}
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700


def test_embeddings_are_never_shrunk_to_the_tokenizer(tmp_path):
    from dschat.models.loading import grow_embeddings_for

    class Tok:
        def __init__(self, n):
            self.n = n

        def __len__(self):
            return self.n

    model = AutoModelForCausalLM.from_config(CONFIGS["llama"]())  # 96 rows
    grow_embeddings_for(model, Tok(90))
    assert model.get_input_embeddings().weight.shape[0] == 96
    weight = model.get_input_embeddings().weight
    weight.ds_shape = torch.Size([96, 32])  # a ZeRO-3 shard: the local tensor says nothing about the size
    weight.data = torch.empty(0)
    grow_embeddings_for(model, Tok(90))
    assert model.get_input_embeddings().weight.numel() == 0  # not resized


class _NoTokenizer:
    def save_pretrained(self, folder):
        pass


def _zero3_engine(preset, dtype="fp32"):
    from dschat.models.loading import load_causal_lm, load_tokenizer
    from dschat.models.training_engine import initialize_engine
    from dschat.utils.ds_config import get_train_ds_config

    ds_config = get_train_ds_config(dtype=dtype, stage=3)
    model = load_causal_lm(preset, load_tokenizer(preset), ds_config)
    return initialize_engine(model, ds_config, 1e-3, 0.1, None, "constant", 0, 10)


def test_compute_fp32_loss_scores_through_a_zero3_partitioned_value_head(distributed):
    """With --compute_fp32_loss the head was applied to its weight read directly, past the ZeRO-3 hooks that gather it:
    step 3's critic (called as forward_value, not through its engine's forward) failed with "size mismatch ...
    vec (0)" at its first experience."""
    import deepspeed

    from dschat.models.loading import load_tokenizer
    from dschat.models.reward_model import create_critic_model
    from dschat.models.training_engine import initialize_engine
    from dschat.utils.ds_config import get_train_ds_config

    ds_config = get_train_ds_config(dtype="fp32", stage=3)
    ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # the head partitioned, as a big one is
    critic = create_critic_model("tiny-llama", load_tokenizer("tiny-llama"), ds_config, compute_fp32_loss=True)
    engine = initialize_engine(critic, ds_config, 1e-3, 0.0, None, "constant", 0, 10)
    assert engine.module.v_head.weight.numel() == 0  # (partitioned: this rank holds no element until gathered)
    ids = torch.randint(3, 96, (2, 6))
    values = engine.module.forward_value(ids, torch.ones_like(ids))["values"]
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        engine.module.compute_fp32_loss = False
        expected = engine.module.forward_value(ids, torch.ones_like(ids))["values"]
    assert values.dtype == torch.float32 and torch.allclose(values, expected, atol=1e-5)


def _critic_and_micro_batches(ds_config):
    """The same new critic (its value head drawn from one seed) and the same two micro-batches of two rows."""
    from dschat.models.loading import load_tokenizer
    from dschat.models.reward_model import create_critic_model

    torch.manual_seed(0)
    critic = create_critic_model("tiny-gpt2", load_tokenizer("tiny-gpt2"), ds_config)
    return critic, torch.randint(3, 96, (2, 2, 6), generator=torch.Generator().manual_seed(1))


def _squared_values(forward_value, ids):
    return forward_value(ids, torch.ones_like(ids), return_value_only=True).float().pow(2).mean()


def test_a_zero3_critic_accumulates_the_gradients_of_its_micro_batches(distributed):
    """DeepSpeed 0.19's ZeRO-3 counts an optimizer step's micro-batches in the engine's forward: a critic scored with
    ``engine.forward_value`` (step 3's and DeepSpeed-Chat's call) past it counted none, and each backward replaced the
    earlier micro-batches' gradient (step 3's critic trained on the last micro-batch of each optimizer step alone).
    The value head's gradient at the step is the mean of the two micro-batches' losses' (DeepSpeed divides each by
    the accumulation steps)."""
    from deepspeed.utils import safe_get_full_grad

    from dschat.models.training_engine import initialize_engine
    from dschat.utils.ds_config import get_train_ds_config

    plain, micro_batches = _critic_and_micro_batches(None)
    (sum(_squared_values(plain.forward_value, ids) for ids in micro_batches) / 2).backward()
    ds_config = get_train_ds_config(dtype="fp32", stage=3, micro_batch_size=2, gradient_accumulation_steps=2)
    critic, micro_batches = _critic_and_micro_batches(ds_config)
    engine = initialize_engine(critic, ds_config, 1e-3, 0.0, None, "constant", 0, 10)
    for ids in micro_batches:
        engine.backward(_squared_values(engine.forward_value, ids))
        if not engine.is_gradient_accumulation_boundary():
            engine.step()
    torch.testing.assert_close(safe_get_full_grad(engine.module.v_head.weight), plain.v_head.weight.grad)


@pytest.mark.parametrize("stage", [0, 1])
def test_the_first_bf16_optimizer_step_is_adams_first_at_every_zero_stage(stage, distributed):
    """bf16 at ZeRO-0: DeepSpeed's FP16_UnfusedOptimizer steps the optimizer once with zero gradients as it is built,
    and Adam counted that step: the first real one took step 2's bias correction, each weight moving 0.735 of the
    learning rate (betas 0.9, 0.95) where ZeRO-1's moved all of it (Adam's first step: lr x the gradient's sign)."""
    from dschat.models.loading import load_causal_lm, load_tokenizer
    from dschat.models.training_engine import initialize_engine
    from dschat.utils.ds_config import get_train_ds_config

    ds_config = get_train_ds_config(dtype="bf16", stage=stage)
    torch.manual_seed(0)
    engine = initialize_engine(load_causal_lm("tiny-gpt2", load_tokenizer("tiny-gpt2"), ds_config), ds_config, 1e-3,
                               0.0, None, "constant", 0, 10)
    masters = [p for group in engine.optimizer.optimizer.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in masters]
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    moved = torch.cat([(p.detach() - b).abs().flatten() for p, b in zip(masters, before)])
    assert moved.median().item() == pytest.approx(1e-3, rel=0.01)
    steps = {float(state["step"]) for state in engine.optimizer.optimizer.state.values()}
    assert steps == {1.0}


def test_bf16_at_zero_0_starts_from_the_models_weights_with_weight_decay(distributed):
    """The zero-gradient step FP16_UnfusedOptimizer takes as it is built (to allocate Adam's state) decayed the fp32
    master weights once (lr x weight_decay, AdamW's decoupled decay of a zero gradient): the first real step then
    started from weights (1 - lr x weight_decay) times the model's, where ZeRO-1 to 3 start from the model's."""
    from dschat.models.loading import load_causal_lm, load_tokenizer
    from dschat.models.training_engine import initialize_engine
    from dschat.utils.ds_config import get_train_ds_config

    ds_config = get_train_ds_config(dtype="bf16", stage=0)
    torch.manual_seed(0)
    engine = initialize_engine(load_causal_lm("tiny-gpt2", load_tokenizer("tiny-gpt2"), ds_config), ds_config, 0.1,
                               0.5, None, "constant", 0, 10)
    pairs = [(master, param) for masters, params in zip(engine.optimizer.fp32_groups, engine.optimizer.fp16_groups)
             for master, param in zip(masters, params)]
    assert pairs
    for master, param in pairs:
        torch.testing.assert_close(master.detach(), param.detach().float(), rtol=0, atol=0)


@pytest.mark.parametrize("preset", ["tiny-opt", "tiny-gpt2"])
def test_a_tied_model_saved_under_zero3_loads_with_its_head_tied(preset, tmp_path, distributed):
    # The head shares the embedding: its second name held this rank's empty ZeRO-3 shard, saved as a 0-element tensor.
    engine = _zero3_engine(preset)
    save_causal_lm(engine.module, _NoTokenizer(), str(tmp_path / "out"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    import deepspeed

    embedding = engine.module.get_input_embeddings().weight
    with deepspeed.zero.GatheredParameters([embedding]):
        assert torch.equal(loaded.get_input_embeddings().weight, embedding.detach().cpu())
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight


class _RowsTokenizer:
    """What loading needs from a tokenizer: its size (the model's rows) and special ids."""
    pad_token_id, eos_token_id = 0, 2

    def __len__(self):
        return 96


def _saved_rwkv(folder, **settings):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_rwkv_config(**settings)).save_pretrained(folder)
    return str(folder)


def _zero3_config_partitioning_all():
    from dschat.utils.ds_config import get_train_ds_config

    ds_config = get_train_ds_config(dtype="fp32", stage=3)
    ds_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # (tiny weights partitioned too)
    return ds_config


def _assert_zero3_weights_are(model, expected):
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        for name, weight in model.named_parameters():
            assert torch.equal(weight.detach(), expected[name]), name


def test_rwkv_loads_under_zero3_as_a_policy_and_as_a_critic(tmp_path, distributed):
    """transformers' load under ZeRO-3 gathered only the weights the checkpoint lacked, then ran every module's
    ``_init_weights``: RWKV's reads a loaded (partitioned, empty) embedding's shape[1] before its guarded init skips
    it, "IndexError: tuple index out of range", and RWKV loaded under ZeRO-3 neither as a policy nor as a critic.
    Loaded, the weights are the checkpoint's; a weight the checkpoint lacks (the LM head of a backbone's folder) is
    initialized as without ZeRO-3 (the same values from the same seed)."""
    from dschat.models.loading import load_causal_lm

    folder = _saved_rwkv(tmp_path / "rwkv")
    ds_config = _zero3_config_partitioning_all()
    plain = dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    _assert_zero3_weights_are(load_causal_lm(folder, _RowsTokenizer(), ds_config), plain)
    critic = create_critic_model(folder, _RowsTokenizer(), ds_config)
    _assert_zero3_weights_are(critic.rwtransformer, {name.removeprefix("rwkv."): weight
                                                     for name, weight in plain.items() if name.startswith("rwkv.")})
    AutoModel.from_pretrained(folder).save_pretrained(tmp_path / "backbone")
    torch.manual_seed(1)
    head_missing = load_causal_lm(str(tmp_path / "backbone"), _RowsTokenizer(), ds_config)
    torch.manual_seed(1)
    _assert_zero3_weights_are(head_missing, dict(AutoModelForCausalLM.from_pretrained(tmp_path / "backbone")
                                                 .named_parameters()))


def _saved_without(folder, model, key):
    """``model`` saved to ``folder`` with the weight ``key`` (if any) left out of its checkpoint."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(folder)
    if key is None:
        return str(folder)
    state = load_file(folder / "model.safetensors")
    del state[key]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def test_a_weight_an_ancestor_initializes_gets_its_init_under_zero3(tmp_path, distributed):
    """ZeRO-3 loads ran a module's init only where its own or its children's tensors had not all loaded: ImageGPT's
    top-level ``_init_weights`` redraws every ``c_proj`` weight at the GPT-2 residual scale, so a checkpoint lacking
    one got only its Conv1D init (another std) under ZeRO-3. Its values are now a plain load's from the same seed.
    (ImageGPT is no AutoModelForCausalLM: loaded by its class through create_hf_model, as dschat's loads do.)"""
    from transformers import ImageGPTConfig, ImageGPTForCausalImageModeling

    from dschat.models.loading import create_hf_model

    torch.manual_seed(0)
    model = ImageGPTForCausalImageModeling(ImageGPTConfig(vocab_size=97, n_positions=16, n_embd=16, n_layer=2,
                                                          n_head=2))
    folder = _saved_without(tmp_path / "imagegpt", model, "transformer.h.1.attn.c_proj.weight")
    torch.manual_seed(1)
    loaded = create_hf_model(ImageGPTForCausalImageModeling, folder, _RowsTokenizer(),
                             _zero3_config_partitioning_all())
    torch.manual_seed(1)
    _assert_zero3_weights_are(loaded, dict(ImageGPTForCausalImageModeling.from_pretrained(folder)
                                           .named_parameters()))


@pytest.mark.parametrize("missing, gathered", [
    (None, set()),
    ("lm_head.weight", {"lm_head.weight"}),
    ("model.layers.1.mlp.down_proj.weight",  # (its ancestors' own and children's weights: no other layer's)
     {"model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
      "model.layers.1.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
      "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}),
])
def test_a_zero3_load_gathers_only_what_the_missing_weights_init_may_touch(missing, gathered, tmp_path, monkeypatch,
                                                                           distributed):
    """Initializing what a checkpoint lacks under ZeRO-3 gathers parameters module by module: none for a full
    checkpoint, the head alone for a missing untied head, never the layers a missing weight is not in."""
    import dschat.models.zero3 as zero3
    from dschat.models.loading import load_causal_lm

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=False))
    folder = _saved_without(tmp_path / "llama", model, missing)
    seen, real = [], zero3.gathered

    def recording(params, **settings):
        seen.extend(params)
        return real(params, **settings)

    monkeypatch.setattr(zero3, "gathered", recording)
    loaded = load_causal_lm(folder, _RowsTokenizer(), _zero3_config_partitioning_all())
    names = {id(weight): name for name, weight in loaded.named_parameters()}
    assert {names[id(p)] for p in seen if zero3.is_zero3_param(p)} == gathered


def test_rwkv_under_zero3_keeps_its_weights_through_eval_and_training_forwards(tmp_path, distributed):
    """RWKV (``rescale_every``) divides its blocks' output weights in place at an eval forward and multiplies them
    back at the next training forward; under ZeRO-3 the division landed on a fetched copy its release dropped, the
    multiplication did not: after one eval and one training forward block k's weights were 2^k times the trained
    ones, and every later forward computed otherwise. Under ZeRO-3 nothing is rescaled: the weights stay as loaded,
    a training forward is transformers' own, an eval forward the same up to LayerNorm's epsilon."""
    from dschat.models.loading import load_causal_lm
    from dschat.models.training_engine import initialize_engine

    folder = _saved_rwkv(tmp_path / "rwkv", num_hidden_layers=4, rescale_every=1)  # (block k: / 2^k)
    ds_config = _zero3_config_partitioning_all()
    engine = initialize_engine(load_causal_lm(folder, _RowsTokenizer(), ds_config), ds_config, 1e-3, 0.0, None,
                               "constant", 0, 10)
    plain = AutoModelForCausalLM.from_pretrained(folder)
    loaded = {name: weight.detach().clone() for name, weight in plain.named_parameters()}
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    for mode in ("eval", "train", "eval", "train"):
        getattr(engine, mode)()
        getattr(plain, mode)()
        with torch.no_grad():
            logits, expected = engine(input_ids=ids).logits, plain(input_ids=ids).logits
        torch.testing.assert_close(logits, expected, rtol=0, atol=0 if mode == "train" else 1e-2)
    _assert_zero3_weights_are(engine.module, loaded)


def test_a_zero3_engine_saves_with_parameters_still_prefetched(tmp_path, distributed):
    """On a GPU, ZeRO-3's prefetch for a forward that never comes (after the last evaluation) left parameters in
    flight, and the save's gather failed: "Cannot partition a param in flight" (step 2 of a Qwen-shaped train.py run on
    an H200). Here one is put in flight as DeepSpeed's prefetch does it: an all-gather whose handle waits in the
    module's registry."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    engine = _zero3_engine("tiny-llama")
    param = next(p for p in engine.module.parameters() if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
    engine.module.ds_inflight_param_registry[param] = param.all_gather_coalesced([param])
    assert param.ds_status == ZeroParamStatus.INFLIGHT
    save_causal_lm(engine, _NoTokenizer(), str(tmp_path / "out"))
    assert param.ds_status == ZeroParamStatus.NOT_AVAILABLE and not engine.module.ds_inflight_param_registry
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(p.numel() > 0 for p in loaded.parameters())


def test_an_engine_given_to_the_save_helpers_saves_its_model(tmp_path, distributed):
    """DeepSpeed-Chat's save_hf_format is given the engine (``rlhf_engine.actor``): its parameter names start with
    "module.", and the save failed on the engine's dict config."""
    import deepspeed

    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig

    engine = _zero3_engine("tiny-llama")
    embedding = engine.module.get_input_embeddings().weight
    with deepspeed.zero.GatheredParameters([embedding]):
        expected = embedding.detach().cpu().clone()
    for name, wrapped in [("ds", engine), ("hybrid", HybridEngine(engine, HybridEngineConfig(enabled=True)))]:
        save_causal_lm(wrapped, _NoTokenizer(), str(tmp_path / name))
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / name).get_input_embeddings().weight,
                           expected)


def test_the_save_helpers_refuse_a_wrong_argument_on_every_rank_before_the_gather(tmp_path, distributed):
    """A critic given to save_causal_lm (or the actor to save_reward_model), DeepSpeed-Chat's save_hf_format(model,
    tokenizer, args) habit, or no tokenizer: rank 0 alone failed, after the gather ("'RewardModel' object has no
    attribute 'get_output_embeddings'", "expected str, bytes or os.PathLike object, not Namespace"), and the other
    ranks waited at the save's barrier (or failed with "Connection closed by peer" once rank 0 ended); now every rank
    refuses before it, naming the argument, and nothing is written (on 2 ranks, each rank's UsageError: by hand)."""
    from argparse import Namespace

    from dschat.errors import UsageError

    policy = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    critic = RewardModel(AutoModel.from_config(CONFIGS["llama"]()))
    out = str(tmp_path / "out")
    with pytest.raises(UsageError, match="save_causal_lm: the model is a RewardModel, a reward model or critic: save "
                                         "it with save_reward_model"):
        save_causal_lm(critic, _Tok(), out)
    with pytest.raises(UsageError, match="save_reward_model: the model is a LlamaForCausalLM, not a reward model"):
        save_reward_model(policy, _Tok(), out)
    with pytest.raises(UsageError, match=r"output_dir is a Namespace, not a folder's path .*os.path.join\(args"):
        save_causal_lm(policy, _Tok(), Namespace(output_dir=out))
    with pytest.raises(UsageError, match="the tokenizer is a str, not a tokenizer"):
        save_reward_model(critic, out, _Tok())  # (tokenizer and folder swapped)
    with pytest.raises(UsageError, match="the tokenizer is a NoneType"):
        save_causal_lm(policy, None, out)
    assert not os.path.exists(out)


def test_weight_decay_reaches_the_matrices_under_zero3(distributed):
    # ZeRO-3's local tensors are flat shards (1-D): the full shape is ds_shape
    engine = _zero3_engine("tiny-llama")
    assert sorted(g["weight_decay"] for g in engine.optimizer.param_groups) == [0.0, 0.1]
    groups = optimizer_param_groups(engine.module, 0.1)
    shapes = {len(p.ds_shape) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert shapes == {2}


def test_saving_into_a_folder_keeps_its_other_files_and_drops_the_old_save_and_leftovers(tmp_path, distributed):
    # DeepSpeed-Chat's scripts log into --output_dir; an earlier save's shards must not stay beside the new weights,
    # nor its tokenizer's files (a chat template left there would change every prompt's format)
    out = tmp_path / "output"
    out.mkdir()
    (out / "training.log").write_text("step 1 loss 2.0\n")
    for own in ("my_embeddings.safetensors", "optimizer_notes.bin", "lid.model"):  # a user's: no save writes these
        (out / own).write_text("the user's")
    (tmp_path / ".output.tmp-killed").mkdir()  # an interrupted save's copy
    (out / "model-00001-of-00002.safetensors").write_text("old shard")
    (out / "model.safetensors.index.json").write_text("{}")
    for earlier in ("chat_template.jinja", "special_tokens_map.json", "tokenizer.model", "reward_model.json"):
        (out / earlier).write_text("from the earlier save")
    (out / "additional_chat_templates").mkdir()  # transformers' named templates: the reloaded tokenizer took them
    (out / "additional_chat_templates" / "tool_use.jinja").write_text("from the earlier save")
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    save_causal_lm(model, _NoTokenizer(), str(out))
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "lid.model", "model.safetensors", "my_embeddings."
                     "safetensors", "optimizer_notes.bin", "training.log"], names
    assert (out / "training.log").read_text() == "step 1 loss 2.0\n"
    assert [p.name for p in tmp_path.iterdir()] == ["output"]  # no temporary folder left
    AutoModelForCausalLM.from_pretrained(out)


def test_a_save_into_an_output_folder_on_another_filesystem_moves_in(tmp_path, monkeypatch, distributed):
    """An output folder that is a mount point (a container's volume, a network share) is another filesystem than the
    folder beside it, which a rename cannot cross (EXDEV, simulated here as the kernel answers it): the save was
    written beside it and failed at its end to move in, leaving the model in a temporary folder that the next save
    removed."""
    import errno

    volume = tmp_path / "volume"
    volume.mkdir()
    (volume / "training.log").write_text("the run's log\n")
    rename = os.replace

    def on_volume(path):
        return os.path.abspath(path) == str(volume) or os.path.abspath(path).startswith(str(volume) + os.sep)

    def replace(source, destination):
        if on_volume(source) != on_volume(destination):
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(source))
        return rename(source, destination)

    monkeypatch.setattr(os, "replace", replace)
    model = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    save_causal_lm(model, _NoTokenizer(), str(volume))
    assert sorted(p.name for p in volume.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                       "training.log"]
    assert [p.name for p in tmp_path.iterdir()] == ["volume"]  # no temporary folder left beside it
    AutoModelForCausalLM.from_pretrained(volume)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_bf16_checkpoint_trains_in_the_dtype_asked_for(dtype, tmp_path, distributed):
    # transformers loads a checkpoint in its stored dtype and DeepSpeed casts only to fp16/bf16: fp32 must be asked
    from dschat.models.loading import load_causal_lm, load_tokenizer
    from dschat.models.training_engine import initialize_engine
    from dschat.utils.ds_config import get_train_ds_config

    AutoModelForCausalLM.from_config(CONFIGS["llama"]()).to(torch.bfloat16).save_pretrained(tmp_path / "m")
    load_tokenizer("tiny-llama").save_pretrained(tmp_path / "m")
    ds_config = get_train_ds_config(dtype=dtype, stage=0)
    model = load_causal_lm(str(tmp_path / "m"), load_tokenizer(str(tmp_path / "m")), ds_config)
    critic = RewardModel.from_pretrained(str(tmp_path / "m"), ds_config=ds_config)
    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    assert {p.dtype for p in model.parameters()} == {want}
    assert {p.dtype for p in critic.parameters()} == {want}
    if dtype == "fp32":
        engine = initialize_engine(model, ds_config, 1e-3, 0.0, None, "constant", 0, 10)
        assert {p.dtype for p in engine.module.parameters()} == {torch.float32}


def test_lora_on_a_head_tied_to_the_embeddings_is_refused_before_saving(distributed):
    from dschat.errors import UsageError

    from peft import LoraConfig, get_peft_model

    # OPT ties its head to the input embeddings; dschat's apply_lora never adapts heads, a notebook's PEFT model may
    model = get_peft_model(AutoModelForCausalLM.from_config(CONFIGS["opt"]()), LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(UsageError, match="lm_head.base_layer.weight, a weight tied to another"):
        save_causal_lm(model, _NoTokenizer(), "unused")


def test_sequences_longer_than_a_learned_position_table_are_an_error_and_a_warning_otherwise(capsys):
    from dschat.errors import UsageError
    from dschat.models.loading import check_sequence_fits

    gpt2 = AutoModelForCausalLM.from_config(CONFIGS["gpt2"]())
    limit = gpt2.config.n_positions
    check_sequence_fits(gpt2, limit, "--max_seq_len")
    with pytest.raises(UsageError, match=f"--max_seq_len = {limit + 1} tokens, but the model has a table of {limit}"):
        check_sequence_fits(gpt2, limit + 1, "--max_seq_len")
    mpt = AutoModelForCausalLM.from_config(tiny_mpt_config(0.0))  # its ALiBi bias: max_seq_len keys, built each forward
    check_sequence_fits(mpt, 64, "--max_seq_len")
    with pytest.raises(UsageError, match="--max_seq_len = 65 tokens, but the model has a table of 64 precomputed"):
        check_sequence_fits(mpt, 65, "--max_seq_len")
    llama = AutoModelForCausalLM.from_config(CONFIGS["llama"]())  # rotary positions: no table to index past
    check_sequence_fits(llama, llama.config.max_position_embeddings + 1, "--max_seq_len")
    assert "past the" in capsys.readouterr().out


@pytest.mark.parametrize("source_side", ["left", "right"])
def test_saved_models_keep_their_folders_padding_side_not_the_steps(source_side, tmp_path, distributed):
    """Steps pad right to train and left to generate: the step-1 model was saved padding right whatever its folder
    said (HF's batched generate then warned and answered otherwise), step 3's actor left."""
    from transformers import AutoTokenizer

    from dschat.models.loading import load_tokenizer
    from dschat.tiny import load_tiny_tokenizer

    source = tmp_path / "source"
    model = AutoModelForCausalLM.from_config(CONFIGS["gpt2"]())
    model.save_pretrained(source)
    tokenizer = load_tiny_tokenizer()
    tokenizer.padding_side = source_side
    tokenizer.save_pretrained(source)
    for step_side in ("left", "right"):
        loaded = load_tokenizer(str(source), padding_side=step_side)
        save_causal_lm(model, loaded, str(tmp_path / "policy"))
        save_reward_model(RewardModel(AutoModel.from_config(CONFIGS["gpt2"]())), loaded, str(tmp_path / "rm"))
        assert loaded.padding_side == step_side, "the step's own side is left as it was"
        for saved in ("policy", "rm"):
            assert AutoTokenizer.from_pretrained(tmp_path / saved).padding_side == source_side, (step_side, saved)


def test_a_reward_models_config_says_its_tokenizers_pad_and_eos_ids_as_a_policys_does(tmp_path):
    """A tokenizer without pad and EOS tokens (--add_eot_token adds one; pad = EOS): step 1's saved config says their
    ids; step 2's kept the base model's (EOS 0, pad 1: other tokens than its tokenizer's)."""
    import json

    from dschat.models.loading import load_causal_lm, load_tokenizer
    from dschat.models.reward_model import create_critic_model
    from dschat.tiny.presets import create_tiny_model

    folder = tmp_path / "base"
    create_tiny_model("tiny-gpt2", str(folder))
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    for key in ("eos_token", "bos_token", "pad_token"):
        settings.pop(key)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    tokenizer = load_tokenizer(str(folder), add_eot_token=True, eot_token="<|eot|>")
    ids = (tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert ids == (len(tokenizer) - 1,) * 2  # the new token
    policy = load_causal_lm(str(folder), tokenizer)
    reward_model = create_critic_model(str(folder), tokenizer)
    for config in (policy.config, reward_model.config):
        assert (config.pad_token_id, config.eos_token_id, config.vocab_size) == (*ids, 1016)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_fp16_without_zero_scales_the_loss_as_its_optimizer_unscales_the_gradients(distributed, accumulation):
    """fp16 at ZeRO-0 (dschat's default stage): DeepSpeed 0.19's engine.backward scales the loss for ZeRO optimizers
    only, and its FP16 optimizer divides the gradients by the scale (2**16) all the same (deepspeedai/DeepSpeed#8393):
    the gradients it stepped with were 2**16 times too small (Adam's update shrank towards its eps), and no overflow
    could be seen. The gradients it steps with are now fp32 training's."""
    from helpers import skip_without_fp16

    from dschat.models.loading import load_causal_lm, load_tokenizer
    from dschat.models.training_engine import initialize_engine
    from dschat.utils.ds_config import get_train_ds_config

    skip_without_fp16()
    tokenizer = load_tokenizer("tiny-gpt2")
    ids = torch.tensor([tokenizer("a short text to learn from, twice over")["input_ids"]] * 2)
    grads = {}
    for dtype in ("fp32", "fp16"):
        ds_config = get_train_ds_config(dtype=dtype, stage=0, gradient_accumulation_steps=accumulation)
        torch.manual_seed(0)
        engine = initialize_engine(load_causal_lm("tiny-gpt2", tokenizer, ds_config), ds_config, 1e-3, 0.0, None,
                                   "constant", 0, 10)
        for micro in range(accumulation):
            loss = engine(input_ids=ids, labels=ids).loss
            assert engine.backward(loss).item() == pytest.approx(loss.item() / accumulation, rel=1e-3)
            if micro < accumulation - 1:
                engine.step()  # (within the accumulation: no optimizer step)
        # the gradients the optimizer steps with: its fp16 ones over its loss scale (fp32: 1)
        scale = getattr(engine.optimizer, "loss_scale", None) or 1.0
        grads[dtype] = torch.cat([p.grad.float().flatten() / scale for p in engine.module.parameters()])
        engine.step()
        assert engine.was_step_applied()
    assert engine.optimizer.loss_scale == 2 ** 16  # (the premise: a scale that matters)
    torch.testing.assert_close(grads["fp16"], grads["fp32"], atol=1e-4, rtol=0.02)


def test_fp16_without_zero_stops_where_deepspeed_scales_the_loss_itself(distributed, monkeypatch):
    """A DeepSpeed that fixes #8393 scales the loss at ZeRO-0 too: dschat's scaling on top of it would square the
    scale (every step an overflow); its first backward says so instead."""
    from deepspeed import DeepSpeedEngine
    from helpers import skip_without_fp16

    from dschat.models.loading import load_causal_lm, load_tokenizer
    from dschat.models.training_engine import initialize_engine
    from dschat.utils.ds_config import get_train_ds_config

    skip_without_fp16()
    backward = DeepSpeedEngine.backward
    monkeypatch.setattr(DeepSpeedEngine, "backward", lambda self, loss, **kwargs: backward(
        self, loss * self.optimizer.loss_scale, **kwargs))  # (the fixed DeepSpeed's)
    tokenizer = load_tokenizer("tiny-gpt2")
    ds_config = get_train_ds_config(dtype="fp16", stage=0)
    engine = initialize_engine(load_causal_lm("tiny-gpt2", tokenizer, ds_config), ds_config, 1e-3, 0.0, None,
                               "constant", 0, 10)
    ids = torch.tensor([tokenizer("a short text")["input_ids"]])
    with pytest.raises(RuntimeError, match=r"fp16 at ZeRO-0: the loss's gradient is 4\.29\d*e\+09, not the loss "
                                           r"scale over the accumulation steps \(65536\)"):
        engine.backward(engine(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize("model_type", ["gpt_neo", "starcoder2"])
def test_dropout_zero_turns_off_every_dropout_module_of_families_with_their_own_field_names(model_type):
    """--dropout 0.0 / --actor_dropout 0.0 (train.py gives them for every model): GPT-Neo's embed_dropout and
    resid_dropout and Starcoder2's embedding_dropout and residual_dropout were left as the config had them."""
    from transformers import AutoConfig

    from dschat.models.loading import config_dropouts, configure_dropout

    small = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_heads=4, num_layers=2,
                 num_hidden_layers=2, intermediate_size=64, num_key_value_heads=2, max_position_embeddings=64,
                 window_size=16, attention_types=[[["global", "local"], 1]])
    config = AutoConfig.for_model(model_type, **small)
    for field in ("attention_dropout", "embed_dropout", "resid_dropout", "embedding_dropout", "residual_dropout"):
        if hasattr(config, field):
            setattr(config, field, 0.1)
    assert set(config_dropouts(config)) >= {f for f in ("embed_dropout", "resid_dropout", "embedding_dropout",
                                                         "residual_dropout") if hasattr(config, f)}
    model = AutoModelForCausalLM.from_config(configure_dropout(config, 0.0))
    active = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Dropout) and module.p > 0]
    assert active == []
    assert config_dropouts(config) == {}


def tiny_mpt_config(attn_pdrop):
    """A tiny MPT config whose attention dropout, nested as attn_config.attn_pdrop, is ``attn_pdrop``. This
    transformers types the field as an int and refuses a fraction, which earlier ones took: set past its check."""
    from transformers import MptConfig

    config = MptConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=64, max_seq_len=64)
    object.__setattr__(config.attn_config, "attn_pdrop", attn_pdrop)
    return config


def test_dropout_zero_turns_off_mpt_attention_dropout_nested_in_its_attn_config():
    """--dropout 0.0 / --actor_dropout 0.0 left MPT's attn_config.attn_pdrop (its attention, MLP and residual
    dropout) as the config had it, and step 3's note of a config dropout in training did not see it."""
    from dschat.models.loading import config_dropouts, configure_dropout

    config = tiny_mpt_config(0.1)
    assert config_dropouts(config) == {"attn_config.attn_pdrop": 0.1}
    model = AutoModelForCausalLM.from_config(configure_dropout(config, 0.0))
    assert config.attn_config.attn_pdrop == 0
    active = [name for name, module in model.named_modules() if isinstance(module, torch.nn.Dropout) and module.p > 0]
    assert active == []
    assert [module.attn_dropout_p for module in model.modules() if hasattr(module, "attn_dropout_p")] == [0, 0]
    assert config_dropouts(config) == {}


def test_a_fraction_of_dropout_leaves_mpt_int_typed_attention_dropout_with_a_warning(capsys):
    """This transformers' MptAttentionConfig takes an int attn_pdrop only: --dropout 0.1 sets MPT's other dropouts and
    says it leaves that one, instead of failing in the config's type check."""
    from dschat.models.loading import config_dropouts, configure_dropout

    config = configure_dropout(tiny_mpt_config(0), 0.1)
    assert config_dropouts(config) == {"resid_pdrop": 0.1, "emb_pdrop": 0.1}
    assert "warning: dropout 0.1 leaves MptAttentionConfig's attn_pdrop at 0" in capsys.readouterr().out


def test_a_hub_name_not_in_the_cache_fails_at_once_when_the_hub_cannot_be_reached(unreachable_hub, hub_cache):
    """train.py --actor-model facebook/opt-1.3bb (a typo) with no network and HF_HUB_OFFLINE unset waited 86 s
    through the hub client's retries (half a minute per file looked up) before its error."""
    from dschat.errors import MissingInputError
    from dschat.models.loading import check_model_path

    hub_cache("acme/cached-lm", GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained)
    check_model_path("acme/cached-lm", "--actor-model")  # (from the cache: the hub's offline mode turned on)
    for _ in range(2):
        with pytest.raises(MissingInputError, match=r"--actor-model acme/opt-1\.3bb: no such folder here, nor a model "
                                                    r"of that name in the Hugging Face hub cache, and the hub cannot "
                                                    r"be reached \(\[Errno -2\] Name or service not known\): "
                                                    r"check the name or path, or the network \(HF_HUB_OFFLINE=1"):
            check_model_path("acme/opt-1.3bb", "--actor-model")
    from huggingface_hub import constants

    assert unreachable_hub == [constants.ENDPOINT]  # one decision per process


def test_a_hub_name_not_in_the_cache_fails_at_once_offline(hub_cache):
    """HF_HUB_OFFLINE=1 (the tests' setting): the name and the flag said before anything loads."""
    from dschat.errors import MissingInputError
    from dschat.models.loading import check_model_path

    with pytest.raises(MissingInputError, match=r"--model_name_or_path acme/opt-1\.3bb: .*HF_HUB_OFFLINE is set"):
        check_model_path("acme/opt-1.3bb", "--model_name_or_path")


def test_a_hub_model_in_the_cache_turns_offline_mode_on_when_the_hub_cannot_be_reached(unreachable_hub, hub_cache,
                                                                                          capsys):
    """train.py --actor-model acme/tiny --step 1, the model in the hub cache, no network and HF_HUB_OFFLINE unset,
    waited 214 s through the hub client's retries of each file the cache lacks: after one failed probe the run reads
    the hub cache only, in every library and in the processes it starts."""
    import datasets
    from huggingface_hub import constants, is_offline_mode

    from dschat.models.loading import check_model_path

    hub_cache("acme/cached-lm", GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained)
    check_model_path("tiny-llama", "--actor-model")  # (a tiny preset and a local folder ask nothing of the hub)
    small = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    folder = hub_cache("acme/other", AutoModelForCausalLM.from_config(small).save_pretrained)
    check_model_path(str(folder), "--actor-model")
    assert unreachable_hub == [] and not is_offline_mode()
    for _ in range(2):
        check_model_path("acme/cached-lm", "--actor-model")
    assert unreachable_hub == [constants.ENDPOINT]
    assert is_offline_mode() and datasets.config.HF_HUB_OFFLINE and os.environ["HF_HUB_OFFLINE"] == "1"
    assert capsys.readouterr().out.count("the hub cannot be reached ([Errno -2] Name or service not known): this run "
                                         "reads the hub cache only, as with HF_HUB_OFFLINE=1") == 1


def test_a_hub_name_the_cache_lacks_says_the_hub_cannot_be_reached_once(unreachable_hub, hub_cache, capsys):
    """chat.py --path acme/typo with no network printed "the hub cannot be reached (...): this run reads the hub cache
    only", then its error said the same reason again. The error alone says it now, whole; offline mode is on all the
    same."""
    from huggingface_hub import is_offline_mode

    from dschat.errors import MissingInputError
    from dschat.models.loading import check_model_path

    reason = "the hub cannot be reached ([Errno -2] Name or service not known)"
    with pytest.raises(MissingInputError) as error:
        check_model_path("acme/not-cached", "--path")
    assert str(error.value) == (f"--path acme/not-cached: no such folder here, nor a model of that name in the Hugging "
                                f"Face hub cache, and {reason}: check the name or path, or the network (HF_HUB_OFFLINE=1 "
                                "reads the hub cache without asking the hub)")
    assert capsys.readouterr().out == "" and is_offline_mode() and len(unreachable_hub) == 1


@pytest.mark.parametrize("copy", ["none", "datasets_cache", "hub_cache_download"])
def test_a_hub_dataset_says_the_hub_cannot_be_reached_once(unreachable_hub, monkeypatch, capsys, copy):
    """load_hub_dataset with no network printed "the hub cannot be reached (...): this run reads the hub cache only",
    then, for a dataset no cache holds, its MissingInputError said "the hub cannot be reached (...)" again. That error
    alone says it now; a dataset read from a cache (datasets', or the hub cache's download) gets the notice once."""
    import datasets
    from huggingface_hub import is_offline_mode

    from dschat.data import base
    from dschat.errors import MissingInputError

    reason = "the hub cannot be reached ([Errno -2] Name or service not known)"

    def load_dataset(*args, **kwargs):
        if copy != "datasets_cache":
            raise ConnectionError("Couldn't reach 'Dahoas/rm-static' on the Hub (OfflineModeIsEnabled)")
        return "from datasets' cache"

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(base, "hub_cache_download", lambda *a: "/hub/snapshot" if copy == "hub_cache_download" else None)
    if copy == "none":
        for load in (base.load_hub_dataset, base.load_hub_dataset_else_download):
            with pytest.raises(MissingInputError, match=rf"^--data_path Dahoas/rm-static: not in the datasets cache, "
                                                        rf"and {re.escape(reason)}; download it"):
                load("Dahoas/rm-static", "--data_path", *([None] if load is not base.load_hub_dataset else []))
        out = capsys.readouterr().out
    else:
        read = base.load_hub_dataset_else_download("Dahoas/rm-static", "--data_path", lambda folder, copy: "downloaded")
        assert read == {"datasets_cache": "from datasets' cache", "hub_cache_download": "downloaded"}[copy]
        out = capsys.readouterr().out
        assert out.startswith(f"{reason}: this run reads the hub cache only, as with HF_HUB_OFFLINE=1\n")
    assert out.count("the hub cannot be reached") == (copy != "none") and is_offline_mode()
    assert len(unreachable_hub) == 1


def test_a_hub_dataset_turns_offline_mode_on_when_the_hub_cannot_be_reached(unreachable_hub):
    from huggingface_hub import is_offline_mode

    from dschat.data.raw_datasets import check_data_paths

    check_data_paths(["tiny"])
    assert unreachable_hub == [] and not is_offline_mode()
    check_data_paths(["Dahoas/rm-static"])
    assert is_offline_mode() and len(unreachable_hub) == 1


def test_a_reachable_hub_leaves_offline_mode_off(reachable_hub, hub_cache):
    from huggingface_hub import is_offline_mode

    from dschat.models.loading import check_model_path

    hub_cache("acme/cached-lm", GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained)
    check_model_path("acme/cached-lm", "--actor-model")
    assert not is_offline_mode()


NODE_MODELS_SCRIPT = """
from dschat.models.loading import load_causal_lm
from dschat.models.reward_model import create_critic_model
from dschat.tiny import load_tiny_tokenizer
from dschat.utils.dist import ensure_distributed
ensure_distributed()
seen = []
for load in (load_causal_lm, create_critic_model):
    for name in ("same", "other"):  # each 'node' reads its own copy in its working directory
        try:
            load(name, load_tiny_tokenizer(), {"train_micro_batch_size_per_gpu": 1})
            seen.append("loaded")
        except Exception as error:
            seen.append(f"{type(error).__name__}: {error}")
""" + WRITE_SEEN_AND_END


@pytest.mark.multirank
def test_nodes_whose_copies_of_a_model_differ_stop_with_an_error_naming_the_setting(tmp_path):
    """Two nodes (one rank each), each reading the model folder from its own disk: copies of other shapes (another
    number of layers) built models of other sizes, and the ranks failed deep in DeepSpeed's first collective (gloo:
    "Received data size doesn't match expected size", an abort; NCCL: a hang). Copies that differ in their weights
    alone load (rank 0's are trained)."""
    from launch import run_as_two_nodes

    from dschat.tiny import load_tiny_tokenizer
    from dschat.tiny.presets import tiny_llama_config

    nodes = [tmp_path / f"node{rank}" for rank in range(2)]
    for rank, node in enumerate(nodes):
        for name, layers in (("same", 2), ("other", 2 + rank)):
            config = tiny_llama_config()
            config.num_hidden_layers = layers
            torch.manual_seed(rank)
            AutoModelForCausalLM.from_config(config).save_pretrained(node / name)
            load_tiny_tokenizer().save_pretrained(node / name)
    run_as_two_nodes(tmp_path, NODE_MODELS_SCRIPT, nodes)
    for node in nodes:
        differ = ("UsageError: other: the ranks read different configs of the model: num_hidden_layers (rank 0: 2, "
                  "rank 1: 3) differs between them (each node's own copy of the model folder, or of a hub model in its "
                  "cache, that is not the same): give every node the same model")  # (rank 0 says rank 1's value too)
        assert (node / "seen").read_text().split("\n") == ["loaded", differ, "loaded", differ], node


def _jamba_config():
    from transformers import JambaConfig
    return JambaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                       expert_layer_period=4, num_experts=2, mamba_d_state=8, mamba_dt_rank=4,
                       use_mamba_kernels=False)


def _mamba_config():
    from transformers import MambaConfig
    return MambaConfig(vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=2)


def _falcon_mamba_config():
    from transformers import FalconMambaConfig
    return FalconMambaConfig(vocab_size=96, hidden_size=32, state_size=8, num_hidden_layers=2)


def _longcat_flash_config():  # (the family sweep's tiny config)
    from transformers import LongcatFlashConfig
    return LongcatFlashConfig(vocab_size=96, hidden_size=64, num_layers=2, num_attention_heads=4, num_key_value_heads=4,
                              ffn_hidden_size=128, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8,
                              qk_rope_head_dim=8, head_dim=8, v_head_dim=16, moe_topk=2, n_routed_experts=4,
                              expert_ffn_hidden_size=32, max_position_embeddings=256, bos_token_id=None,
                              eos_token_id=None, pad_token_id=None)


@pytest.mark.parametrize("make_config", [_mamba_config, _falcon_mamba_config, _jamba_config, _longcat_flash_config])
def test_lora_merged_model_computes_what_the_peft_model_trains(make_config):
    """Mamba, Falcon-Mamba and Jamba read ``dt_proj.weight`` past the module (``dt_proj.weight @ x``), LongCat-Flash's
    router its ``classifier.weight`` (``F.linear(x, classifier.weight)``): a default LoRA adapter there never acted in
    the training forward, yet the merge (the hybrid engine's copy, saved checkpoints) folded it in, so generation and
    the saved model were another model than the trained one."""
    from dschat.models.lora import merge_lora_state_dict

    config = make_config()
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_config(config), lora_dim=4).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 3.0)  # adapters that move the output (PEFT starts B at zero)
    ids = torch.randint(3, 96, (2, 6))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_config(config).eval()
        plain.load_state_dict(merge_lora_state_dict(model.state_dict(), model))
        merged = plain(input_ids=ids).logits
    assert any("lora_A" in n for n, _ in model.named_parameters())
    assert torch.allclose(merged, trained, rtol=0, atol=1e-5), (merged - trained).abs().max()


def test_lora_module_name_matching_only_modules_read_past_their_forward_is_refused():
    """An adapter on Mamba's dt_proj would not train (the forward reads its weight directly): said, not applied."""
    from dschat.errors import UsageError

    with pytest.raises(UsageError, match=r"--lora_module_name 'dt_proj' matches only modules .*"
                                         r"\(backbone.layers.0.mixer.dt_proj .*would not train"):
        lora_target_modules(AutoModelForCausalLM.from_config(_mamba_config()), "dt_proj")


def test_the_notebook_loaders_fail_at_once_on_a_hub_name_they_cannot_fetch(unreachable_hub, hub_cache):
    """load_tokenizer("org/name") (the README's notebook starts with it), load_causal_lm and RewardModel.from_pretrained
    with no network and HF_HUB_OFFLINE unset went through the hub client's retries (46 s for a tokenizer, printed
    line by line), a mistyped tiny preset too, where the steps and tools, which check their flags first
    (check_model_path), failed at once. They fail at once too now, with the same words."""
    from huggingface_hub import constants

    from dschat.errors import MissingInputError
    from dschat.models.loading import load_causal_lm, load_tokenizer
    from dschat.models.reward_model import RewardModel

    said = (r"acme/opt-1\.3bb: no such folder here, nor a model of that name in the Hugging Face hub cache, and the hub "
            r"cannot be reached \(\[Errno -2\] Name or service not known\)")
    for load in (load_tokenizer, lambda name: load_causal_lm(name, None), RewardModel.from_pretrained):
        with pytest.raises(MissingInputError, match=said):
            load("acme/opt-1.3bb")
        with pytest.raises(MissingInputError, match=r"^tiny-lama: no such tiny preset \(they are tiny-llama, "):
            load("tiny-lama")
    assert unreachable_hub == [constants.ENDPOINT]  # (one probe, then offline mode)


def test_a_policy_folder_is_read_for_a_reward_model_once_and_one_that_becomes_one_is_refused(tmp_path, monkeypatch):
    """A policy was checked for being a reward model by the early check (the steps', step 3's, train.py's, the tools')
    and read again by the loader, which checks it too (step 3's actor three times, with its reference); a weights
    file may be opened to list its names. It is read once per state of its files: loading after the early check, and
    the tools' loading after theirs, read nothing again; a value head saved into the folder is seen, and refused at
    every check."""
    import shutil

    from dschat.errors import UsageError
    from dschat.models import reward_model
    from dschat.models.loading import check_not_a_reward_model, load_causal_lm, load_tokenizer, resolve_model_path
    from dschat.models.reward_model import VALUE_HEAD_FILE
    from dschat.tools.common import find_policy_path, load_policy

    folder = str(tmp_path / "lm")
    shutil.copytree(resolve_model_path("tiny-llama"), folder)
    read, is_reward_model_folder = [], reward_model.is_reward_model_folder
    monkeypatch.setattr(reward_model, "is_reward_model_folder", lambda path: read.append(path) or
                        is_reward_model_folder(path))
    check_not_a_reward_model(folder, "--model_name_or_path")  # (the early check)
    load_causal_lm(folder, load_tokenizer(folder))  # (the loader's)
    load_policy(find_policy_path(folder), device="cpu")  # (the tools': their early check, then the loader's)
    assert read == [folder]
    (tmp_path / "lm" / VALUE_HEAD_FILE).write_bytes(b"")  # (now a value-head model's folder)
    for _ in range(2):
        with pytest.raises(UsageError, match=r"^--model_name_or_path .*: a reward model or critic .*not a policy"):
            check_not_a_reward_model(folder, "--model_name_or_path")
        with pytest.raises(UsageError, match="not a policy"):
            load_causal_lm(folder, None)
        with pytest.raises(UsageError, match="not a policy"):
            find_policy_path(folder)
    assert read == [folder, folder]
