"""Training over left-padded rows: SDPA with no fully masked query row (dschat/models/attention.py).

cuDNN's SDPA backward (the GPU default) returns NaN gradients for a fully masked query row; that cannot happen on the
CPU, so these tests pin down what the replacement must keep: the same outputs and gradients as transformers' SDPA, and
no gradient through the rows it repairs."""
import sys
from pathlib import Path

import pytest
import torch

from dschat.models.attention import NO_EMPTY_ROWS, no_empty_query_rows, sdpa_no_empty_rows

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from helpers import spy_on_empty_query_rows  # noqa: E402
from hybrid_common import tiny_config  # noqa: E402


@pytest.fixture
def empty_rows_seen(monkeypatch):
    return spy_on_empty_query_rows(monkeypatch)


def _left_padded_mask(batch, length, pads):
    """(B, 1, L, L) boolean causal mask with ``pads[b]`` left pads in row b: its first query rows see no key."""
    keys = torch.arange(length)[None, :] >= torch.tensor(pads)[:, None]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return (causal[None] & keys[:, None, :])[:, None]


def _attention(fn, q, k, v, mask, upstream):
    from types import SimpleNamespace

    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    module = SimpleNamespace(is_causal=True, num_key_value_groups=q.shape[1] // k.shape[1], training=True)
    out, _ = fn(module, q, k, v, mask, dropout=0.0, scaling=None)
    (out * upstream).sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


def test_same_outputs_and_gradients_as_sdpa_and_none_through_a_repaired_row(empty_rows_seen):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, 10, 8), torch.randn(3, 2, 10, 8), torch.randn(3, 2, 10, 8)  # GQA: 4 heads, 2 kv
    pads = [0, 3, 10]  # no pad; three; a row that is all padding
    mask = _left_padded_mask(3, 10, pads)
    upstream = torch.randn(3, 10, 4, 8)  # (B, q, H, D), the layout both functions return
    empty = ~mask.any(-1).squeeze(1)  # (B, q)
    assert empty.sum() == 13
    got, got_grads = _attention(sdpa_no_empty_rows, q, k, v, mask, upstream)
    assert empty_rows_seen == [False], "SDPA itself never sees a query row with no key"
    want, want_grads = _attention(sdpa_attention_forward, q, k, v, mask, upstream * ~empty[..., None, None])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert not got[empty].any(), "a row with nothing to attend to gives zeros, as SDPA's does"
    for g, w in zip(got_grads, want_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    # whatever reaches a repaired row's output, nothing flows back through it
    _, again = _attention(sdpa_no_empty_rows, q, k, v, mask, upstream + 100 * empty[..., None, None])
    for g, w in zip(again, got_grads):
        torch.testing.assert_close(g, w)


def _loss_and_grads(model, ids, mask, context):
    model.zero_grad()
    first_real = mask.bool() & ~torch.nn.functional.pad(mask, (1, 0))[:, :-1].bool()
    labels = ids.masked_fill(~mask.bool() | first_real, -100)  # a pad predicts nothing
    with context:
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("family", ["llama", "opt", "gpt2", "mistral_sliding"])
def test_a_left_padded_model_trains_the_same_with_it(family, empty_rows_seen):
    import contextlib

    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(family.removesuffix("_sliding"))
    if family.endswith("_sliding"):
        config.sliding_window = 4  # shorter than the rows: SDPA gets the window's mask
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()  # no dropout
    ids = torch.randint(3, 96, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    seen = []
    model.model.register_forward_pre_hook(lambda m, a: seen.append(m.config._attn_implementation)) \
        if family == "llama" else None
    loss, grads = _loss_and_grads(model, ids, mask, contextlib.nullcontext())
    assert empty_rows_seen and all(empty_rows_seen), "the batch has left pads whose query rows see no key"
    empty_rows_seen.clear()
    got_loss, got_grads = _loss_and_grads(model, ids, mask, no_empty_query_rows(model))
    assert empty_rows_seen and not any(empty_rows_seen), "forwards and backwards: no row without a key reaches SDPA"
    torch.testing.assert_close(got_loss, loss)
    for g, w in zip(got_grads, grads):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)
    assert model.config._attn_implementation == "sdpa", "restored after the block"
    if family == "llama":
        assert seen == ["sdpa", NO_EMPTY_ROWS]


def test_the_switch_reaches_the_model_under_peft_and_a_reward_head_and_leaves_eager_alone():
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModel, AutoModelForCausalLM

    from dschat.models.reward_model import RewardModel

    actor = get_peft_model(AutoModelForCausalLM.from_config(tiny_config("llama"), attn_implementation="sdpa"),
                           LoraConfig(r=2, target_modules=["q_proj"]))
    critic = RewardModel(AutoModel.from_config(tiny_config("opt"), attn_implementation="sdpa"))
    eager = AutoModelForCausalLM.from_config(tiny_config("gpt2"), attn_implementation="eager")
    with no_empty_query_rows(actor, critic):
        assert actor.get_base_model().config._attn_implementation == NO_EMPTY_ROWS
        assert critic.rwtransformer.config._attn_implementation == NO_EMPTY_ROWS
        assert torch.backends.cuda.cudnn_sdp_enabled(), "every model switched: cuDNN's kernels stay"
    with no_empty_query_rows(actor, eager):
        assert eager.config._attn_implementation == "eager"
        assert torch.backends.cuda.cudnn_sdp_enabled(), "an eager model runs no SDPA: nothing to restrict"
    assert actor.get_base_model().config._attn_implementation == "sdpa"
    assert critic.rwtransformer.config._attn_implementation == "sdpa"


def test_a_model_that_cannot_be_switched_trains_without_cudnn_attention():
    """Falcon calls SDPA itself (and Gemma-4's code branches on the name): not switched, so in the block SDPA may not
    pick cuDNN, whose backward gives the NaN; afterwards it may again."""
    from transformers import AutoModelForCausalLM, FalconConfig

    falcon = AutoModelForCausalLM.from_config(FalconConfig(vocab_size=96, hidden_size=64, num_attention_heads=4,
                                                           num_hidden_layers=2), attn_implementation="sdpa")
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with no_empty_query_rows(falcon):
        assert falcon.config._attn_implementation == "sdpa"
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_models_whose_code_branches_on_the_name_sdpa_are_never_switched():
    """Gemma-4's KV-shared layers cut the queries to ``logits_to_keep`` unless the implementation is named "sdpa"
    (under another name a causal SDPA call with no mask then lines up the wrong keys); such models keep "sdpa"."""
    from transformers import Gemma4ForCausalLM, LlamaForCausalLM

    from dschat.models.attention import _branches_on_sdpa

    # (Falcon's did too before transformers 5.25; it is still not switched: not is_backend_compatible, test above)
    assert _branches_on_sdpa(Gemma4ForCausalLM)
    assert not _branches_on_sdpa(LlamaForCausalLM)
