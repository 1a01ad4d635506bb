"""Inference tensor parallelism: 2 CPU ranks through the deepspeed launcher (tests/scripts/hybrid_tp.py), and the
configuration errors in one process."""
from pathlib import Path

import pytest
import torch

from dschat.hybrid_engine.tensor_parallel import Slice
from tests.launch import launch_once, launched

SCRIPT = Path(__file__).parent / "scripts" / "hybrid_tp.py"


FAMILIES = ("llama", "llama-mqa", "opt", "llama-lora")
# fused q/k/v projections (dschat's plans for them): Falcon multi-query, per-head q/k/v with ALiBi in the mask, grouped
# per key/value head (new_decoder_architecture); GPTBigCode multi-query and not; Bloom (ALiBi as an argument); GPT-2
# (Conv1D layers, c_attn of all the queries, then all the keys, then all the values); Phi-3 (packed qkv_proj and
# gate_up_proj, its attention reading its config's head count)
FUSED_QKV = ("falcon", "falcon_alibi", "falcon_new", "gpt_bigcode", "gpt_bigcode_mha", "bloom", "gpt2", "phi3")


@pytest.fixture(scope="module")
def tp_launch():
    """Each (stage, families) run in turn, in one launch; each test checks its own runs' lines."""
    return launch_once(SCRIPT, "--runs", f"0:{','.join(FAMILIES)},olmo2,{','.join(FUSED_QKV)}",
                       f"3:{','.join(FAMILIES)},falcon")


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [0, 3])
def test_tp2_greedy_equals_unsplit_model_on_two_ranks(stage, tp_launch):
    proc = launched(tp_launch)
    for rank in (0, 1):
        for family in FAMILIES:
            assert f"rank {rank} {family} stage={stage}: OK" in proc.stdout
        assert f"rank {rank} ALL OK" in proc.stdout


@pytest.mark.multirank
def test_tp2_of_fused_qkv_families_equals_unsplit_model_on_two_ranks(tp_launch):
    """Falcon, GPTBigCode, Bloom, GPT-2 and Phi-3 had no plan (inference_tp_size 2 refused them): greedy answers,
    log-probabilities and the refresh after a step now equal the unsplit model's for each layout of their fused q/k/v
    (ZeRO-3 too: Falcon)."""
    proc = launched(tp_launch)
    for rank in (0, 1):
        for family in FUSED_QKV:
            assert f"rank {rank} {family} stage=0: OK" in proc.stdout
        assert f"rank {rank} falcon stage=3: OK" in proc.stdout


@pytest.mark.multirank
def test_release_destroys_the_tensor_parallel_group_and_a_new_engine_works():
    """A notebook that builds engine after engine added one process group each time (never destroyed)."""
    proc = launched(launch_once(SCRIPT, "--release"))
    for rank in (0, 1):
        assert f"rank {rank} release: OK" in proc.stdout and f"rank {rank} ALL OK" in proc.stdout


@pytest.fixture(scope="module")
def surgery_launch():
    return launch_once(SCRIPT, "--surgery", timeout=300)


@pytest.mark.multirank
def test_surgery_on_one_rank_alone_stops_every_rank_of_the_group(surgery_launch):
    """ZeRO-0 with inference_tp_size 2: a parameter replaced on rank 0 alone raised at rank 0's eval(), and rank 1
    waited in its generate's all-reduce for ever (or paired with rank 0's next generate). Both raise now, at generate,
    in the argument check's all-reduce; the timeout turns a hang into a failure. Where rank 0's arguments are refused
    in the same call, its error names the parameter too (rank 1's says that rank 0's does), the argument error its
    cause: it raised the argument error alone."""
    proc = launched(surgery_launch)
    for rank in (0, 1):
        for line in ("surgery with arguments refused on rank 0: named", "surgery on rank 0: refused",
                     "surgery undone: in step", "ALL OK"):
            assert f"rank {rank} {line}" in proc.stdout, (rank, line, proc.stdout[-3000:])


@pytest.mark.multirank
def test_surgery_on_one_rank_then_train_without_generate_stops_every_rank_of_the_group(surgery_launch):
    """The group met at generate alone: a parameter replaced on rank 0, then train() with no generate, was not
    refused on either rank (DeepSpeed's optimizer went on training the old one on rank 0). The train() that begins a
    train phase is a meeting of the group: both ranks refuse there, rank 0 naming the parameter. The same meeting
    catches a generate on rank 0 alone, which paired with rank 1's next one and then waited while rank 1 trained."""
    proc = launched(surgery_launch)
    for rank in (0, 1):
        for line in ("surgery before train(): refused by the group", "lone generate: out of step at train()",
                     "ALL OK"):
            assert f"rank {rank} {line}" in proc.stdout, (rank, line, proc.stdout[-3000:])


@pytest.mark.multirank
def test_recurrent_gemma_rows_grouped_by_prompt_length_generate_across_the_group_as_alone():
    """RecurrentGemma (recurrent layers that read no mask: rows of each prompt length generate together without their
    padding) under inference_tp_size 2, the group's prompts gathered from both ranks: greedy answers equal each row's
    alone and the one-rank engine's, token for token, and the log-probabilities too."""
    proc = launched(launch_once(SCRIPT, "--recurrent-gemma", timeout=300))
    for rank in (0, 1):
        for line in ("recurrent_gemma: OK", "ALL OK"):
            assert f"rank {rank} {line}" in proc.stdout, (rank, line, proc.stdout[-3000:])


def test_tp_size_must_divide_the_world(distributed):
    from dschat.hybrid_engine.tensor_parallel import TensorParallelGroup

    with pytest.raises(ValueError, match="inference_tp_size=3 must divide the number of ranks"):
        TensorParallelGroup.create(3)


class _Rank:
    """The fields of TensorParallelGroup that planning reads (no process group needed)."""

    def __init__(self, size, rank):
        self.size, self.rank, self.is_leader, self.group = size, rank, rank == 0, None


def _plan(family, size=2, rank=1, **config):
    import sys

    sys.path.insert(0, str(Path(__file__).parent / "scripts"))
    from hybrid_common import tiny_config
    from transformers import AutoModelForCausalLM

    from dschat.hybrid_engine.tensor_parallel import ShardPlan
    from dschat.models.layers import decoder_layer_list

    cfg = tiny_config(family)
    for key, value in config.items():
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_config(cfg)
    return model, ShardPlan(model, decoder_layer_list(model)[0], _Rank(size, rank))


def test_llama_plan_comes_from_transformers_and_slices_heads():
    model, plan = _plan("llama")  # 4 query heads, 2 key/value heads, head_dim 16
    assert plan.styles["model.layers.0.self_attn.q_proj"] == "colwise"
    assert plan.styles["model.layers.1.mlp.down_proj"] == "rowwise"
    q = plan.slices["model.layers.0.self_attn.q_proj.weight"]
    k = plan.slices["model.layers.0.self_attn.k_proj.weight"]
    o = plan.slices["model.layers.0.self_attn.o_proj.weight"]
    assert (q.dim, q.start, q.stop) == (0, 32, 64)  # rank 1: query heads 2-3
    assert (k.dim, k.start, k.stop) == (0, 16, 32)  # rank 1: key/value head 1
    assert (o.dim, o.start, o.stop) == (1, 32, 64)
    assert not any("embed" in name or "norm" in name or "lm_head" in name for name in plan.slices)
    plan.apply(model.to("meta"))
    attention = model.model.layers[0].self_attn
    assert attention.num_key_value_groups == 2 and attention.q_proj.weight.shape == (32, 64)


def test_fewer_kv_heads_than_ranks_keeps_the_kv_head_of_the_ranks_query_heads():
    _, plan = _plan("llama", size=4, rank=3, num_key_value_heads=2)  # 4 query heads on 4 ranks: 1 each
    k = plan.slices["model.layers.0.self_attn.k_proj.weight"]
    assert (k.start, k.stop) == (16, 32)  # query head 3 reads key/value head 1
    assert plan.local_heads == 1 and plan.local_kv_heads == 1


def test_opt_without_a_plan_is_split_by_projection_names_and_bias_added_once():
    _, plan = _plan("opt")
    assert plan.styles["model.decoder.layers.0.self_attn.out_proj"] == "rowwise"
    assert plan.styles["model.decoder.layers.0.fc1"] == "colwise"
    assert plan.slices["model.decoder.layers.0.fc2.bias"].zero  # rank 1 adds no bias; rank 0 adds it once
    _, leader = _plan("opt", rank=0)
    assert not leader.slices["model.decoder.layers.0.fc2.bias"].zero


def test_models_that_cannot_be_split_say_why():
    from transformers import AutoModelForCausalLM, CTRLConfig

    from dschat.hybrid_engine.tensor_parallel import ShardPlan

    # CTRL: no plan of transformers' or dschat's, and projections named Wq, Wk, Wv, dense
    ctrl = AutoModelForCausalLM.from_config(CTRLConfig(vocab_size=96, n_embd=64, n_layer=1, n_head=4, dff=128))
    with pytest.raises(NotImplementedError, match="no tensor-parallel plan for CTRLLMHeadModel"):
        ShardPlan(ctrl, "transformer.h", _Rank(2, 1))
    with pytest.raises(ValueError, match="3 attention heads cannot be split"):
        _plan("llama", num_attention_heads=3, num_key_value_heads=3, head_dim=16)


@pytest.mark.parametrize("family, kv_heads, rows", [
    # 4 heads of 16: multi-query [q0..q3, k, v]: rank 0 keeps q0 q1 and the key/value, rank 1 q2 q3 and the key/value
    ("falcon", 1, [[(0, 32), (64, 96)], [(32, 96)]]),
    ("gpt_bigcode", 1, [[(0, 32), (64, 96)], [(32, 96)]]),
    # per-head [q k v] x 4: two whole heads each
    ("falcon_alibi", 4, [[(0, 96)], [(96, 192)]]),
    ("gpt_bigcode_mha", 4, [[(0, 96)], [(96, 192)]]),
    ("bloom", 4, [[(0, 96)], [(96, 192)]]),
    # grouped [q q k v] x 2: one group each
    ("falcon_new", 2, [[(0, 64)], [(64, 128)]]),
])
def test_fused_qkv_keeps_the_rows_of_the_ranks_heads(family, kv_heads, rows):
    for rank, expected in enumerate(rows):
        model, plan = _plan(family, rank=rank)
        name = next(n for n, style in plan.styles.items() if style == "colwise_qkv")
        rows_slice = plan.slices[f"{name}.weight"]
        got = getattr(rows_slice, "ranges", None) or ((rows_slice.start, rows_slice.stop),)
        assert [tuple(r) for r in got] == expected, (family, rank, got)
        assert plan.layout.num_kv_heads == kv_heads and plan.local_heads == 2
        assert plan.local_kv_heads == max(1, kv_heads // 2)
        full = model.get_submodule(name).weight
        kept = rows_slice(torch.arange(full.shape[0])[:, None].expand(-1, 3))
        assert kept[:, 0].tolist() == [i for start, stop in expected for i in range(start, stop)]
        plan.apply(model.to("meta"))
        attention = model.get_submodule(name.rpartition(".")[0])
        assert attention.get_submodule(name.rpartition(".")[2]).weight.shape[0] == sum(b - a for a, b in expected)
        assert attention.num_heads == 2
        assert getattr(attention, "num_key_value_groups", 1) == 2 // plan.local_kv_heads  # (Bloom has none)


def test_falcon_grouped_with_fewer_kv_heads_than_ranks_keeps_the_group_of_the_ranks_queries():
    # new_decoder_architecture, 4 heads in 2 groups [q0 q1 k0 v0 | q2 q3 k1 v1] of 16 rows, on 4 ranks of one head
    name = "transformer.h.0.self_attention.query_key_value.weight"
    _, rank2 = _plan("falcon_new", size=4, rank=2)
    assert rank2.slices[name].ranges == ((64, 80), (96, 128))  # q2, then group 1's key and value
    _, rank3 = _plan("falcon_new", size=4, rank=3)
    assert (rank3.slices[name].start, rank3.slices[name].stop) == (80, 128)  # q3 k1 v1: one range
    assert (rank3.local_heads, rank3.local_kv_heads) == (1, 1)


def test_only_linear_subclasses_known_to_compute_the_same_product_are_split():
    """FalconLinear (x @ W.T, then + b) is split; another nn.Linear subclass (its own forward: grouped, quantized, ...)
    is still refused."""
    from torch import nn

    class GroupedLinear(nn.Linear):
        pass

    _, plan = _plan("falcon")
    assert plan.styles["transformer.h.0.mlp.dense_4h_to_h"] == "rowwise"
    model, _ = _plan("llama")
    layer = model.model.layers[0].self_attn
    layer.q_proj = GroupedLinear(layer.q_proj.in_features, layer.q_proj.out_features, bias=False)
    from dschat.hybrid_engine.tensor_parallel import ShardPlan

    with pytest.raises(NotImplementedError, match="q_proj is a GroupedLinear, not an nn.Linear"):
        ShardPlan(model, "model.layers", _Rank(2, 0))


def test_gpt_bigcode_attention_is_told_its_local_widths():
    """GPTBigCode's multi-query attention splits c_attn's output by embed_dim and kv_dim, not by heads."""
    model, plan = _plan("gpt_bigcode", rank=0)
    plan.apply(model.to("meta"))
    attention = model.transformer.h[0].attn
    assert (attention.embed_dim, attention.kv_dim, attention.kv_heads) == (32, 16, 1)


def test_gpt2_conv1d_layers_are_split_along_their_stored_output_and_input_dims():
    """GPT-2's Conv1D weights are stored (in, out): column-wise along dim 1, row-wise along dim 0; c_attn holds all the
    queries, then all the keys, then all the values, and each rank keeps its heads' columns of each."""
    model, plan = _plan("gpt2", rank=1)  # 4 heads of 16, n_embd 64, MLP 256
    attn, mlp = "transformer.h.0.attn", "transformer.h.0.mlp"
    qkv = plan.slices[f"{attn}.c_attn.weight"]
    assert (qkv.dim, qkv.ranges) == (1, ((32, 64), (96, 128), (160, 192)))  # q2 q3, k2 k3, v2 v3
    assert (plan.slices[f"{attn}.c_attn.bias"].dim, plan.slices[f"{attn}.c_attn.bias"].ranges) == (0, qkv.ranges)
    assert plan.slices[f"{attn}.c_proj.weight"] == Slice(0, 32, 64) and plan.slices[f"{attn}.c_proj.bias"].zero
    assert plan.slices[f"{mlp}.c_fc.weight"] == Slice(1, 128, 256) and plan.slices[f"{mlp}.c_fc.bias"] == \
        Slice(0, 128, 256)
    assert plan.slices[f"{mlp}.c_proj.weight"] == Slice(0, 128, 256)
    _, leader = _plan("gpt2", rank=0)
    assert not leader.slices[f"{mlp}.c_proj.bias"].zero  # the bias is added once, by the group's first rank
    plan.apply(model.to("meta"))
    attention = model.transformer.h[0].attn
    assert (attention.num_heads, attention.embed_dim, attention.split_size, attention.head_dim) == (2, 32, 32, 16)
    assert attention.c_attn.weight.shape == (64, 96) and attention.c_attn.nf == 96
    assert attention.c_proj.weight.shape == (32, 64) and attention.c_proj.nx == 32
    assert model.transformer.h[0].mlp.c_fc.nf == 128


def test_phi3_packed_projections_are_split_per_block_and_its_attention_reads_its_own_head_count():
    """Phi-3's qkv_proj holds all the queries, then all the keys, then all the values (4 heads, 2 key/value heads of
    16), gate_up_proj all the gate rows, then all the up rows; its attention reads the query width from
    ``config.num_attention_heads``: it gets a view of the config with the rank's counts, the model's config unchanged
    and everything else read live from it (the attention implementation dschat switches per generation)."""
    model, plan = _plan("phi3", rank=1)
    layer = "model.layers.0"
    assert plan.slices[f"{layer}.self_attn.qkv_proj.weight"].ranges == ((32, 64), (80, 96), (112, 128))
    assert plan.slices[f"{layer}.mlp.gate_up_proj.weight"].ranges == ((64, 128), (192, 256))
    assert plan.slices[f"{layer}.self_attn.o_proj.weight"] == Slice(1, 32, 64)
    assert plan.slices[f"{layer}.mlp.down_proj.weight"] == Slice(1, 64, 128)
    shared = model.config
    plan.apply(model.to("meta"))
    attention = model.model.layers[0].self_attn
    assert attention.config is not shared and (shared.num_attention_heads, shared.num_key_value_heads) == (4, 2)
    assert (attention.config.num_attention_heads, attention.config.num_key_value_heads) == (2, 1)
    assert attention.num_key_value_heads == 1 and attention.num_key_value_groups == 2
    assert attention.config.hidden_size == 64
    before = shared._attn_implementation
    shared._attn_implementation_internal = "eager" if before != "eager" else "sdpa"
    assert attention.config._attn_implementation == shared._attn_implementation != before


def _loaded_shard(family, rank, size=2):
    """A random-weight model of ``family`` and this rank's shard of it, its slices copied from the model's weights."""
    torch.manual_seed(1)  # the same model on every rank
    model, plan = _plan(family, size=size, rank=rank)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)  # biases too (zero at init): a bias added twice, or missed, shows
    model.eval()
    shard, _ = _plan(family, size=size, rank=rank)
    plan.apply(shard)
    full = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in shard.named_parameters():
            param.copy_(plan.slices[name](full[name]) if name in plan.slices else full[name])
    return model, shard.eval()


@pytest.mark.parametrize("family", ["gpt2", "phi3"])
def test_the_ranks_shards_of_a_block_sum_to_the_whole_block(family, monkeypatch):
    """Each rank's attention and MLP (its heads, its columns; the row-wise all-reduce a no-op here) give partial
    outputs that add up to the unsplit block's, the row-wise bias counted once."""
    _no_all_reduce(monkeypatch)
    from dschat.models.layers import decoder_layer_list

    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 64)
    whole, parts = None, []
    for rank in range(2):
        model, shard = _loaded_shard(family, rank)
        layer = decoder_layer_list(model)[1][0]
        blocks = [(getattr(layer, "attn", None) or layer.self_attn), layer.mlp]
        if whole is None:
            whole = [_block_output(block, hidden, model) for block in blocks]
        shard_layer = decoder_layer_list(shard)[1][0]
        parts.append([_block_output(block, hidden, shard) for block in
                      ((getattr(shard_layer, "attn", None) or shard_layer.self_attn), shard_layer.mlp)])
    for index, expected in enumerate(whole):
        torch.testing.assert_close(parts[0][index] + parts[1][index], expected, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(parts[0][index], expected, atol=1e-3)  # (each rank's alone is only a part)


def _block_output(block, hidden, model):
    with torch.no_grad():
        if not _is_attention_block(block):
            return block(hidden)
        kwargs = {}
        if hasattr(model.model if hasattr(model, "model") else model.transformer, "rotary_emb"):
            rotary = (model.model if hasattr(model, "model") else model.transformer).rotary_emb
            kwargs["position_embeddings"] = rotary(hidden, torch.arange(hidden.shape[1])[None])
        return block(hidden, attention_mask=None, **kwargs)[0]


def _is_attention_block(block):
    return "attention" in type(block).__name__.lower()


def _no_all_reduce(monkeypatch):
    """The row-wise projections' output all-reduce, a no-op: these tests run one rank's shard without a process group
    (only what reaches the attention is checked)."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: None)


def test_falcon_alibi_mask_is_narrowed_to_the_ranks_heads(monkeypatch):
    """Falcon folds ALiBi into a (batch, heads, q, k) mask: each rank's attention gets its own heads' rows of it (the
    mask of all 4 heads failed against 2 local heads); a mask shared by the heads passes as it is."""
    _no_all_reduce(monkeypatch)
    model, plan = _plan("falcon_alibi", rank=1)
    plan.apply(model)  # (uninitialised shard weights: only the mask the attention function sees matters here)
    attention = model.transformer.h[0].self_attention
    seen = []
    attention.register_forward_pre_hook(lambda m, a, k: seen.append(k["attention_mask"]), with_kwargs=True)
    per_head = torch.arange(4.0).view(1, 4, 1, 1).expand(1, 4, 3, 3).contiguous()
    shared = torch.zeros(1, 1, 3, 3)
    for mask in (per_head, shared):
        attention(torch.zeros(1, 3, 64), attention_mask=mask, position_ids=torch.arange(3)[None])
    assert seen[0].shape == (1, 2, 3, 3) and seen[0][0, :, 0, 0].tolist() == [2.0, 3.0]
    assert seen[1] is shared


def test_bloom_alibi_is_narrowed_to_the_ranks_heads(monkeypatch):
    """Bloom passes ALiBi to its attention as (batch * heads, 1, k): each rank gets its own heads' rows, per row."""
    _no_all_reduce(monkeypatch)
    model, plan = _plan("bloom", rank=1)
    plan.apply(model)
    attention = model.transformer.h[0].self_attention
    seen = []
    attention.register_forward_pre_hook(lambda m, a, k: seen.append(k["alibi"]), with_kwargs=True)
    alibi = (10 * torch.arange(2.0)[:, None] + torch.arange(4.0)).view(8, 1, 1).expand(8, 1, 3)  # 10 * row + head
    attention(torch.zeros(2, 3, 64), torch.zeros(2, 3, 64), alibi=alibi, attention_mask=torch.zeros(2, 1, 3, 3))
    assert seen[0].shape == (4, 1, 3) and seen[0][:, 0, 0].tolist() == [2.0, 3.0, 12.0, 13.0]


def test_bloom_slicing_its_own_output_projections_is_refused_by_name():
    """slow_but_exact with pretraining_tp > 1 multiplies slices of dense.weight itself, past the all-reduce."""
    with pytest.raises(NotImplementedError, match="bloom with slow_but_exact=True and pretraining_tp=2 .* "
                                                  "inference_tp_size=1"):
        _plan("bloom", slow_but_exact=True, pretraining_tp=2)
    _plan("bloom", slow_but_exact=False, pretraining_tp=2)  # the layers' own forward: split as usual


def test_a_plan_that_splits_no_projection_is_refused_without_saying_the_config_has_none():
    """A config plan that gathers every projection's output (as transformers' Phi-3 plan does for its packed qkv_proj /
    gate_up_proj, before dschat had one of its own): --inference_tp_size 2 said 'its config has no base_model_tp_plan',
    which it has; the refusal says the plan splits no projection."""
    model, _ = _plan("opt")  # (OPT: no plan of transformers' or dschat's)
    model.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise_gather_output",
                                       "layers.*.self_attn.out_proj": "rowwise_split_input"}
    from dschat.hybrid_engine.tensor_parallel import ShardPlan
    from dschat.models.layers import decoder_layer_list

    with pytest.raises(NotImplementedError) as refused:
        ShardPlan(model, decoder_layer_list(model)[0], _Rank(2, 0))
    message = str(refused.value)
    assert "has no base_model_tp_plan" not in message
    assert "base_model_tp_plan splits none of its decoder layers' linear projections" in message
    assert "colwise_gather_output" in message and "inference_tp_size=1" in message


def test_attention_with_per_head_norms_is_refused():
    # StableLM's qk_layernorm keeps one LayerNorm per head: splitting the heads would pair them with the wrong norms
    from transformers import AutoModelForCausalLM, StableLmConfig

    from dschat.hybrid_engine.tensor_parallel import ShardPlan
    from dschat.models.layers import decoder_layer_list

    cfg = StableLmConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, qk_layernorm=True)
    model = AutoModelForCausalLM.from_config(cfg)
    plan = ShardPlan(model, decoder_layer_list(model)[0], _Rank(2, 0))
    with pytest.raises(NotImplementedError, match="one module per attention head"):
        plan.apply(model.to("meta"))


def _olmo2(num_key_value_heads):
    from transformers import AutoModelForCausalLM, Olmo2Config

    cfg = Olmo2Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=num_key_value_heads, max_position_embeddings=256,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_replicated_attention_keeps_every_head_and_kv_head_on_every_rank(kv_heads):
    # Olmo2's plan replicates attention (q/k/v colwise_gather_output, o_proj rowwise_split_input, for its q/k norms):
    # each rank runs the whole attention, so its KV cache needs the config's key/value heads, not kv // tp
    from dschat.hybrid_engine.tensor_parallel import ShardPlan
    from dschat.models.layers import decoder_layer_list

    model = _olmo2(kv_heads)
    plan = ShardPlan(model, decoder_layer_list(model)[0], _Rank(2, 1))
    assert not plan.splits_attention
    assert not any("self_attn" in name for name in plan.styles) and plan.styles["model.layers.0.mlp.down_proj"]
    assert (plan.local_heads, plan.local_kv_heads) == (4, kv_heads)
    plan.apply(model.to("meta"))
    attention = model.model.layers[0].self_attn
    assert attention.num_key_value_groups == 4 // kv_heads and attention.k_proj.weight.shape == (16 * kv_heads, 64)


@pytest.mark.multirank
def test_tp2_with_replicated_attention_on_two_ranks(tp_launch):
    proc = launched(tp_launch)
    for rank in (0, 1):
        assert f"rank {rank} olmo2 stage=0: OK" in proc.stdout


def test_per_layer_head_dim_is_a_usage_error_for_the_plan_too():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip("this transformers has no Gemma-4")
    from dschat.errors import UsageError
    from dschat.hybrid_engine.tensor_parallel import HeadLayout

    kwargs = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "layer_types": ["sliding_attention", "full_attention"], "vocab_size_per_layer_input": 96,
              "hidden_size_per_layer_input": 8}
    config = transformers.Gemma4TextConfig(per_layer_config={"01": {"head_dim": 32}}, **kwargs)
    with pytest.raises(UsageError, match="one head dim per model"):
        HeadLayout.of(config)
    assert HeadLayout.of(transformers.Gemma4TextConfig(per_layer_config=None, **kwargs)) == HeadLayout(4, 2, 16)
