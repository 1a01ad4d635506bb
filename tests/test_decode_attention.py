"""The Triton decode-attention kernel (``hybrid_engine.decode_attention``), run on the CPU by Triton's interpreter.

The interpreter has to be selected before triton decorates the kernels, so each check runs in its own process
(``tests/scripts/decode_attention_check.py``): the kernel against SDPA (grouped-query, multi-query, padded head dims,
left-padded masks, split and unsplit cache), masked slots never read, the contiguous span's fast path taken, the cases
routed to SDPA, and the hybrid engine with the kernel giving HF generate's greedy tokens for Llama (GQA), OPT and
GPT-2.
"""
import sys
from pathlib import Path

import pytest
import torch

from dschat.hybrid_engine.attention import decode_attention, resolve_mode

from helpers import hopper_target, run_interpreted_check  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))


@pytest.mark.parametrize("check", ["kernel", "skip", "fast", "spans", "applies", "modes", "write", "llama", "opt", "gpt2"])
def test_decode_attention_check(check):
    run_interpreted_check("decode_attention_check.py", check)


def test_autotuning_times_a_three_quarters_filled_cache_once_per_shape():
    """The first call of a shape (the graph's warm-up, on the prompt-only cache) tunes on a typical fill instead."""
    pytest.importorskip("triton", reason="the README's test command installs triton")
    from dschat.hybrid_engine import triton_decode

    seen = []
    key = ("test-shape", 512)
    triton_decode._TUNED.discard(key)
    for _ in range(2):
        triton_decode._tune_at_typical_fill(lambda mask, spans: seen.append(mask), key, 512, torch.device("cpu"),
                                            spans_given=False)
    assert len(seen) == 1, "tuned once per shape"
    assert seen[0].shape == (1, 512) and seen[0].dtype == torch.uint8
    assert seen[0][0, :384].all() and not seen[0][0, 384:].any(), "the first 3/4 of the slots visible"


def test_launch_tunes_a_new_shape_on_the_typical_fill_then_runs_the_real_mask(monkeypatch):
    """The wiring inside ``launch``: for a new shape the autotuned kernel is called first with the synthetic 3/4 mask
    (same key arguments and tensor dtypes as the real call, so the autotuner's cache serves the real call), then
    with the caller's mask; the same shape again runs the real call only."""
    pytest.importorskip("triton", reason="the README's test command installs triton")
    from dschat.hybrid_engine import triton_decode

    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((args, kwargs))

    monkeypatch.setattr(triton_decode, "_autotuned", lambda device: True)
    monkeypatch.setattr(triton_decode, "_partial_kernel_autotuned", Recorder())
    monkeypatch.setattr(triton_decode, "_TUNED", set())
    monkeypatch.setattr(triton_decode, "split_count", lambda *args: 1)  # no combine kernel (it would really run)
    spans_of = []  # the span kernel would really run too: each mask's spans, recorded
    monkeypatch.setattr(triton_decode, "row_spans", lambda mask, mask_bytes, kv_len: spans_of.append(mask_bytes) or
                        torch.zeros(mask_bytes.shape[0], 3, dtype=torch.int32))
    batch, kv_heads, length = 6, 4, 128
    q = torch.randn(batch, 8, 1, 16)
    k, v = torch.randn(batch, kv_heads, length, 16), torch.randn(batch, kv_heads, length, 16)
    mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool)
    mask[..., 10:40] = True
    triton_decode.launch(q, k, v, mask, 0.25)
    assert len(calls) == 2
    (tune_args, tune_kwargs), (real_args, real_kwargs) = calls
    assert tune_args[3].shape == (1, length) and tune_args[3].dtype == torch.uint8
    assert tune_args[3][0, :96].all() and not tune_args[3][0, 96:].any()
    assert torch.equal(real_args[3], mask[:, 0, 0, :].view(torch.uint8))
    key_positions = [i for i, x in enumerate(real_args) if not torch.is_tensor(x)][-5:]  # buckets, heads, length, scale
    assert [tune_args[i] for i in key_positions] == [real_args[i] for i in key_positions]
    assert [x.dtype for x in tune_args if torch.is_tensor(x)] == [x.dtype for x in real_args if torch.is_tensor(x)]
    assert tune_kwargs == real_kwargs and real_kwargs["HAS_MASK"]
    triton_decode.launch(q, k, v, mask, 0.25)
    assert len(calls) == 3, "a tuned shape is not tuned again"
    monkeypatch.setattr(triton_decode, "CONTIGUOUS_FAST_PATH", not triton_decode.CONTIGUOUS_FAST_PATH)
    triton_decode.launch(q, k, v, mask, 0.25)
    assert len(calls) == 5, "the other path is another kernel for the autotuner: tuned on the typical fill too"
    assert calls[3][1]["FAST_CONTIGUOUS"] == calls[4][1]["FAST_CONTIGUOUS"] != calls[2][1]["FAST_CONTIGUOUS"]
    assert all(c[1]["SPANS_GIVEN"] for c in calls) and spans_of[0] is tune_args[3]  # the typical fill's own spans
    monkeypatch.setattr(triton_decode, "SPANS_PER_FORWARD", False)
    triton_decode.launch(q, k, v, mask, 0.25)
    assert len(calls) == 7 and not calls[6][1]["SPANS_GIVEN"], "scanning per program is another kernel: tuned too"


def _tiny(config_class, **kwargs):
    from transformers import AutoModelForCausalLM

    config = config_class(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, **kwargs)
    return AutoModelForCausalLM.from_config(config, attn_implementation=kwargs.pop("attn", "sdpa"))


def test_only_sdpa_models_of_the_attention_interface_are_switched_and_restored():
    from transformers import FalconConfig, LlamaConfig

    llama = _tiny(LlamaConfig, intermediate_size=64)
    with decode_attention(llama, "triton"):
        assert llama.config._attn_implementation == "dschat_decode"
    assert llama.config._attn_implementation == "sdpa"
    with decode_attention(llama, "sdpa"):
        assert llama.config._attn_implementation == "sdpa"

    llama.set_attn_implementation("eager")
    with decode_attention(llama, "triton"):
        assert llama.config._attn_implementation == "eager", "an eager-attention model keeps its implementation"

    # Falcon dispatches on the string "sdpa" itself: under another name it would run its eager branch with SDPA's
    # boolean mask (nothing masked), so it is left alone.
    falcon = _tiny(FalconConfig)
    assert falcon.config._attn_implementation == "sdpa"
    with decode_attention(falcon, "triton"):
        assert falcon.config._attn_implementation == "sdpa"


def test_multimodal_sub_configs_are_neither_switched_nor_overwritten():
    from transformers import LlavaConfig

    config = LlavaConfig()
    config.text_config._attn_implementation_internal = "sdpa"
    config.vision_config._attn_implementation_internal = "eager"

    class Multimodal:  # what the context manager reads: the model's config and its class's backend support
        is_backend_compatible = classmethod(lambda cls: True)

    model = Multimodal()
    model.config = config
    with decode_attention(model, "triton"):
        assert config.text_config._attn_implementation == "dschat_decode"
        assert config.vision_config._attn_implementation == "eager"
    assert config.text_config._attn_implementation == "sdpa"
    assert config.vision_config._attn_implementation == "eager"


def test_explicit_triton_without_triton_is_an_error(monkeypatch):
    from dschat.hybrid_engine import attention

    monkeypatch.setattr(attention, "triton_available", lambda: False)
    assert resolve_mode("auto", "cuda") == "sdpa"
    with pytest.raises(ValueError, match="needs the triton package"):
        resolve_mode("triton", "cuda")


def test_a_failing_kernel_falls_back_to_sdpa_once(monkeypatch, caplog):
    """If Triton cannot run the kernel (e.g. an unsupported GPU), generation continues on SDPA: same tokens as HF, one
    warning, and the kernel is not tried again."""
    import types

    from hybrid_common import PAD, hf_generate, left_padded_batch, make_ds_engine, tiny_model

    from dschat.hybrid_engine import HybridEngine, HybridEngineConfig, attention

    calls = []

    def failing_kernel(*args):
        calls.append(1)
        raise RuntimeError("no kernel for this GPU")

    fake = types.ModuleType("dschat.hybrid_engine.triton_decode")
    fake.decode_attention = failing_kernel
    monkeypatch.setitem(sys.modules, "dschat.hybrid_engine.triton_decode", fake)
    monkeypatch.setattr("dschat.hybrid_engine.triton_decode", fake, raising=False)
    monkeypatch.setattr(attention, "_kernel_failure", [])  # noqa: this test's failure must not outlive it
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # lets kernel_applies say yes on the CPU
    model = tiny_model("llama", seed=4)
    engine = HybridEngine(make_ds_engine(model), HybridEngineConfig(enabled=True, max_out_tokens=32),
                          pad_token_id=PAD, decode_attention="sdpa")
    engine.decode_attention = "triton"  # as resolved on a GPU
    ids, mask = left_padded_batch([4, 6])
    engine.eval()
    with caplog.at_level("WARNING"):
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=8)
        again = engine.generate(ids, attention_mask=mask, max_new_tokens=8)
    assert torch.equal(got, hf_generate(model, ids, mask, 8)) and torch.equal(again, got)
    assert len(calls) == 1, "after the first failure the kernel is not called again"
    assert sum("Triton decode kernel failed" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("has_mask,fast_contiguous,splits,spans_given", [
    (True, True, 1, True), (True, True, 1, False), (True, False, 2, True), (False, True, 1, False)])
def test_the_attention_kernel_compiles_for_hopper(has_mask, fast_contiguous, splits, spans_given, tmp_path,
                                                  monkeypatch):
    """What the interpreter is lenient about (Triton's typing of constexpr and tensor operands, both loops of the span
    paths): the partial and combine kernels compiled to sm_90 machine code, on the CPU, for each path."""
    target = hopper_target()
    if target is None:
        pytest.skip("this Triton cannot compile for CUDA here")
    import triton
    from triton.compiler import ASTSource

    from dschat.hybrid_engine import triton_decode

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled, not read from an earlier run's cache
    pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Mask": "*u8", "Spans": "*i32", "Out": "*fp32",
                "Lse": "*fp32", "Final": "*bf16"}
    constants = dict(GROUP=7, GROUP_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK=64, SPLITS=splits, HAS_MASK=has_mask,
                     SCAN=512, FAST_CONTIGUOUS=fast_contiguous, IEEE=False, SPANS_GIVEN=spans_given)
    names = triton_decode._partial_kernel.arg_names
    signature = {n: pointers.get(n, "constexpr" if n in constants else "fp32" if n == "scale_log2" else "i32")
                 for n in names}
    kernel = triton.compile(ASTSource(triton_decode._partial_kernel, signature,
                                      {(names.index(n),): v for n, v in constants.items()}),
                            target=target, options=dict(num_warps=4, num_stages=3))
    assert kernel.asm["cubin"], "no machine code"
    combine_names = triton_decode._combine_kernel.arg_names
    combine = dict(HEAD_DIM=128, D_PAD=128, SPLITS=2, SPLITS_PAD=2)
    kernel = triton.compile(ASTSource(triton_decode._combine_kernel,
                                      {n: "constexpr" if n in combine else "*bf16" if n == "Final" else "*fp32"
                                       for n in combine_names},
                                      {(combine_names.index(n),): v for n, v in combine.items()}),
                            target=target, options=dict(num_warps=4))
    assert kernel.asm["cubin"]
    span_names = triton_decode._span_kernel.arg_names
    kernel = triton.compile(ASTSource(triton_decode._span_kernel,
                                      {"Mask": "*u8", "Spans": "*i32", "stride_mb": "i32", "stride_mn": "i32",
                                       "kv_len": "i32", "SCAN": "constexpr"}, {(span_names.index("SCAN"),): 512}),
                            target=target, options=dict(num_warps=4))
    assert kernel.asm["cubin"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: run it on the device machine")
def test_gpu_kernels_in_bf16_autotuned_and_captured_in_a_graph():
    """What the CPU interpreter cannot check: bf16, the autotuned launch and CUDA-graph capture (a replay with new
    inputs equals an eager call), for the attention and the token write."""
    from hybrid_common import sdpa_reference

    from dschat.hybrid_engine import triton_decode

    torch.manual_seed(0)
    tuned = len(triton_decode._TUNED)
    for batch, heads, kv_heads, length, dim in ((64, 32, 32, 512, 64), (8, 28, 4, 512, 128), (3, 8, 1, 100, 80)):
        q = torch.randn(batch, 1, heads, dim, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
        k, v = (torch.randn(batch, kv_heads, length, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device="cuda")
        for b in range(batch):
            mask[b, ..., (7 * b) % (length // 2):length - (3 * b) % (length // 3)] = True
        got = triton_decode.decode_attention(q, k, v, mask, dim ** -0.5)
        error = (got.double() - sdpa_reference(q, k, v, mask, dim ** -0.5)).abs().max()
        assert error < 2e-2, (batch, heads, kv_heads, dim, error)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            triton_decode.decode_attention(q, k, v, mask, dim ** -0.5)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = triton_decode.decode_attention(q, k, v, mask, dim ** -0.5)
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.testing.assert_close(captured, triton_decode.decode_attention(q, k, v, mask, dim ** -0.5), atol=0, rtol=0)
    assert len(triton_decode._TUNED) == tuned + 3, "each shape autotuned on a typical fill, once"

    keys, values = (torch.zeros(4, 2, 16, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    new = torch.randn(4, 1, 2, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    triton_decode.write_token_kv(keys, values, new, new * 2, torch.tensor(5, device="cuda"))
    assert torch.equal(keys[:, :, 5], new[:, :, 0]) and torch.equal(values[:, :, 5], 2 * new[:, :, 0])
    assert torch.count_nonzero(keys[:, :, :5]) == 0 and torch.count_nonzero(keys[:, :, 6:]) == 0, "other slots kept"
