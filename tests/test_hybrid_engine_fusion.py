"""Projections that read the same input, fused into one GEMM while generating (dschat/hybrid_engine/fusion.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from hybrid_common import PAD, hf_generate, left_padded_batch, make_ds_engine, tiny_model, train_step  # noqa: E402

from dschat.hybrid_engine import HybridEngine, HybridEngineConfig  # noqa: E402
from dschat.hybrid_engine.fusion import ProjectionFusion, resolve_mode  # noqa: E402

MAX_NEW = 12
# Per decoder layer, in the order the model calls them with one input (GPT-2's c_attn is fused already, a Conv1D).
EXPECTED_GROUPS = {"llama": [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]],
                   "qwen2": [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]],
                   "opt": [["q_proj", "k_proj", "v_proj"]], "gpt2": []}


def _engine(model, **kwargs):
    return HybridEngine(make_ds_engine(model, 0), HybridEngineConfig(enabled=True, max_out_tokens=32),
                        pad_token_id=PAD, **kwargs)


def _group_names(model, fusion):
    names = {module: name.rsplit(".", 1)[-1] for name, module in model.named_modules()}
    return [[names[m] for m in g.members] for g in fusion.groups]


@pytest.mark.parametrize("family", sorted(EXPECTED_GROUPS))
def test_fused_generation_equals_hf_generate_before_and_after_a_step(family):
    model = tiny_model(family)
    engine = _engine(model, fuse_projections="on")
    ids, mask = left_padded_batch([7, 3, 5, 1])
    engine.eval()
    got = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    assert torch.equal(got, hf_generate(model, ids, mask, MAX_NEW))
    layers = model.config.num_hidden_layers
    assert _group_names(model, engine.fusion) == EXPECTED_GROUPS[family] * layers
    # outside a generation every linear is its own again (training forwards never run fused)
    assert not any("forward" in m.__dict__ for m in model.modules())

    train_step(engine, got)
    engine.eval()
    expected_after = hf_generate(model, ids, mask, MAX_NEW)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), expected_after)
    if family != "gpt2":
        assert not torch.equal(expected_after, got), "the test cannot see a stale fused weight"


def test_weights_changed_outside_step_are_seen_by_the_next_generation():
    model = tiny_model("llama")
    engine = _engine(model, fuse_projections="on")
    ids, mask = left_padded_batch([6, 4])
    engine.eval()
    first = engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW)
    model.load_state_dict(tiny_model("llama", seed=1).state_dict())  # no step(), no mark_weights_stale()
    expected = hf_generate(model, ids, mask, MAX_NEW)
    assert not torch.equal(expected, first)
    assert torch.equal(engine.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW), expected)


def test_fused_outputs_equal_each_projection_whatever_the_order_and_input_of_the_calls():
    model = tiny_model("qwen2")  # q/k/v of different sizes (grouped-query attention), with biases
    fusion = ProjectionFusion(model)
    ids, mask = left_padded_batch([4, 6])
    with torch.no_grad(), fusion.active():
        model(input_ids=ids, attention_mask=mask)  # the first forward finds the groups
        group = fusion.groups[0]
        q, k, v = group.members
        x, other = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
        fused_k = k(x)  # first member called: computes the group
        assert torch.allclose(fused_k, torch.nn.functional.linear(x, k.weight, k.bias), atol=1e-6)
        assert torch.allclose(v(other), torch.nn.functional.linear(other, v.weight, v.bias), atol=1e-6)
        assert torch.allclose(q(input=x), torch.nn.functional.linear(x, q.weight, q.bias), atol=1e-6)
    assert q.out_features != k.out_features and group.bias is not None


def test_a_linear_whose_forward_someone_else_replaced_is_left_alone():
    model = tiny_model("opt")
    attention = model.model.decoder.layers[0].self_attn
    own = attention.k_proj.forward
    attention.k_proj.forward = own  # e.g. an offloading hook's wrapper
    fusion = ProjectionFusion(model)
    ids, mask = left_padded_batch([5])
    with torch.no_grad(), fusion.active():
        model(input_ids=ids, attention_mask=mask)
    members = [m for g in fusion.groups for m in g.members]
    assert attention.k_proj not in members and attention.v_proj in members
    assert attention.k_proj.forward is own  # still there after the generation


def test_only_groups_up_to_max_bytes_are_fused():
    model = tiny_model("llama")
    qkv_bytes = sum(model.model.layers[0].self_attn.get_submodule(n).weight.nbytes
                    for n in ("q_proj", "k_proj", "v_proj"))
    fusion = ProjectionFusion(model, max_bytes=qkv_bytes)  # gate/up (2 x 64x128) are larger: left alone
    ids, mask = left_padded_batch([5])
    with torch.no_grad(), fusion.active():
        model(input_ids=ids, attention_mask=mask)
    assert _group_names(model, fusion) == [["q_proj", "k_proj", "v_proj"]] * model.config.num_hidden_layers


def test_fusion_mode():
    assert resolve_mode("auto", "cpu") is False and resolve_mode("auto", "cuda:0") is True
    assert resolve_mode("on", "cpu") is True and resolve_mode("off", "cuda") is False
    with pytest.raises(ValueError, match="fuse_projections"):
        resolve_mode("yes", "cpu")
    assert _engine(tiny_model("llama")).fusion is None  # auto on the CPU
    assert _engine(tiny_model("llama"), fuse_projections="on", compile_decode_step="default").fusion is not None


def test_auto_fuses_with_a_compiled_decode_step_where_it_fuses_at_all(monkeypatch):
    """On CUDA "auto" fuses with or without compile (measured faster together, docs/benchmarks.md); the CPU here
    stands in for CUDA by resolving auto as CUDA would."""
    from dschat.hybrid_engine import engine as engine_module

    monkeypatch.setattr(engine_module, "resolve_fuse_projections", lambda mode, device: resolve_mode(mode, "cuda"))
    assert _engine(tiny_model("llama"), compile_decode_step="default").fusion is not None
    assert _engine(tiny_model("llama"), fuse_projections="off", compile_decode_step="default").fusion is None


def test_a_compiled_forward_finds_the_groups_then_runs_fused_without_recompiling():
    """compile_decode_step with fuse_projections="on": the first forward (the groups found, forwards replaced) is
    traced as it runs; from the next call on one graph with the fused GEMMs serves every generation. Checked in a
    fresh interpreter: in a test process where other files ran first, dynamo once split the forward into two graphs
    (state left by earlier tests; not reproduced in isolation)."""
    repo = Path(__file__).resolve().parents[1]
    check = "import test_hybrid_engine_fusion as t; t.compiled_forward_check()"
    proc = subprocess.run([sys.executable, "-c", check], cwd=repo, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": f"{repo / 'tests'}:{repo}"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def compiled_forward_check():
    from torch._dynamo.testing import EagerAndRecordGraphs

    model = tiny_model("qwen2").eval()
    ids, mask = left_padded_batch([5, 3])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    fusion = ProjectionFusion(model)
    backend = EagerAndRecordGraphs()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    graphs = []
    try:
        for _ in range(3):  # generations
            with torch.no_grad(), fusion.active():
                for _ in range(2):  # decode steps
                    torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask).logits, expected)
            graphs.append(len(backend.graphs))
    finally:
        torch._dynamo.reset()
    assert len(fusion.groups) == 2 * model.config.num_hidden_layers  # q/k/v and gate/up per layer
    assert graphs[1] == graphs[2], "the forwards installed again at the next generation forced a recompilation"
    linear_rows = [node.args[1].meta["example_value"].shape[0] for node in backend.graphs[-1].graph.nodes
                   if node.target is torch._C._nn.linear]
    assert linear_rows.count(64 + 2 * 32) == model.config.num_hidden_layers, "q/k/v as one GEMM per layer"
    assert len(linear_rows) == 4 * model.config.num_hidden_layers + 1, "one graph for the whole forward"
