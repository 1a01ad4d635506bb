"""Checks of the Triton decode-attention kernel on the CPU through Triton's interpreter.

Run as ``TRITON_INTERPRET=1 python decode_attention_check.py CHECK`` (the interpreter must be chosen before triton
decorates the kernels, hence a separate process); exits non-zero when a check fails.
"""
import dataclasses
import itertools
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from hybrid_common import (PAD, early_token, hf_generate, left_padded_batch, make_ds_engine,  # noqa: E402
                           sdpa_reference as reference, tiny_model)

from dschat.hybrid_engine import HybridEngine, HybridEngineConfig, attention, triton_decode  # noqa: E402


def padded_mask(batch, length, seed):
    """Left padding of different widths and an unfilled tail, as a static cache during decode has."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool)
    for b in range(batch):
        start = int(torch.randint(0, length // 2, (1,), generator=g))
        end = length - int(torch.randint(0, length // 3, (1,), generator=g))
        mask[b, 0, 0, start:end] = True
    return mask


# the CPU default and two of the GPU autotuner's candidates (tile sizes change the block loop and the span split), with
# and without the contiguous span's fast path
TUNINGS = (triton_decode.Tuning(contiguous_fast_path=True), triton_decode.Tuning(block=32, num_stages=1,
                                                                                contiguous_fast_path=True),
           triton_decode.Tuning(block=128, num_warps=8, contiguous_fast_path=False))


def check_kernel_matches_sdpa():
    torch.manual_seed(0)
    cases = [  # batch, query heads, key/value heads, cache length, head dim, dtype, tolerance
        (3, 4, 2, 100, 16, torch.float32, 1e-5),   # GQA, length not a multiple of the block
        # Qwen2.5-7B's head layout (7 query heads per key/value head, head dim 128) on 2 of its 4 key/value heads: the
        # kernel sees the same GROUP, GROUP_PAD and HEAD_DIM, with half the programs for the interpreter to run
        (2, 14, 2, 192, 128, torch.float32, 1e-5),
        (3, 3, 3, 64, 80, torch.float32, 1e-5),    # plain multi-head, head dim padded to 128
        (2, 8, 1, 130, 64, torch.float16, 2e-3),   # one key/value head
    ]
    default_min_programs = triton_decode.MIN_PROGRAMS
    for min_programs in (default_min_programs, 1):  # split along the cache, and one program per head
        triton_decode.MIN_PROGRAMS = min_programs
        for batch, heads, kv_heads, length, dim, dtype, tol in cases:
            # The query as attention modules pass it: a transposed (B, 1, H, D) view.
            q = torch.randn(batch, 1, heads, dim, dtype=dtype).transpose(1, 2)
            k, v = (torch.randn(batch, kv_heads, length, dim, dtype=dtype) for _ in range(2))
            holes = padded_mask(batch, length, seed=2) & (torch.rand(batch, 1, 1, length) < 0.7)
            holes[:, 0, 0, length // 2] = True  # at least one visible slot per row
            for mask in (padded_mask(batch, length, seed=length), None, padded_mask(1, length, seed=1), holes):
                expected = reference(q, k, v, mask, dim ** -0.5)
                for tuning in TUNINGS:
                    got = triton_decode.launch(q, k, v, mask, dim ** -0.5, tuning)
                    assert got.shape == (batch, 1, heads, dim) and got.dtype == dtype and got.is_contiguous()
                    error = (got.double() - expected).abs().max().item()
                    assert error < tol, (batch, heads, kv_heads, length, dim, dtype, mask is None, min_programs,
                                         tuning, error)
    triton_decode.MIN_PROGRAMS = default_min_programs
    assert triton_decode.split_count(programs=8, num_blocks=4, device=torch.device("cpu")) == 4, \
        "few programs: the cache must be split"
    assert triton_decode.split_count(programs=4096, num_blocks=4, device=torch.device("cpu")) == 1
    assert triton_decode.split_count(programs=64, num_blocks=16, device=torch.device("cpu")) == 2, \
        "at most one wave of programs"
    print("kernel matches SDPA")


def interpreted_apart(block):
    """TUNINGS at one tile size, one of each that the interpreter runs differently: it drops the launch options
    num_warps and num_stages (not arguments of the kernel), so at equal block, splits and paths two tunings are one
    and the same launch."""
    apart = {}
    for tuning in TUNINGS:
        tuning = dataclasses.replace(tuning, block=block)
        apart.setdefault(dataclasses.replace(tuning, num_warps=4, num_stages=1), tuning)
    return list(apart.values())


def check_masked_blocks_are_not_read():
    """Every masked slot's key is inf and its value NaN here: if the kernel loaded one (or counted it), the output would
    not be finite. Fully masked blocks are skipped; the masked slots of partly visible blocks (left padding, whose
    keys and values may really be NaN: its rows are fully masked in the prefill) must not be loaded either, whether
    the row's visible span has holes or not, in one part or several, with a padded head dim and grouped heads, and
    when a row's scan for its span takes several steps."""
    torch.manual_seed(1)
    batch, heads, kv_heads, dim = 3, 4, 2, 80  # head dim padded to 128: the pad columns must not be loaded either
    block = triton_decode.Tuning().block
    length = 4 * block
    q = torch.randn(batch, heads, 1, dim)
    k, v = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool)
    mask[0, 0, 0, block + 3:2 * block + 10] = True  # row 0 sees parts of blocks 1 and 2
    mask[1, 0, 0, 5:block] = True  # row 1 sees part of block 0; row 2 sees nothing (zeros, as SDPA's NaN is not kept)
    holes = mask.clone()
    holes[0, 0, 0, block + 7] = False  # row 0's span with a hole
    default_scan = triton_decode.MASK_SCAN
    for scan, mask in itertools.product((default_scan, 16), (mask, holes)):
        triton_decode.MASK_SCAN = scan  # 16: each row's span is found over several steps of the scan
        expected = reference(q, k, v, mask, 0.25).nan_to_num(0.0)
        rows, slots = (~mask[:, 0, 0, :]).nonzero(as_tuple=True)
        poisoned_k, poisoned_v = k.clone(), v.clone()
        poisoned_k[rows, :, slots] = float("inf")
        poisoned_v[rows, :, slots] = float("nan")
        for tuning, splits in itertools.product(interpreted_apart(block), (1, None)):
            tuning = dataclasses.replace(tuning, splits=splits)
            got = triton_decode.launch(q, poisoned_k, poisoned_v, mask, 0.25, tuning)
            assert torch.isfinite(got).all(), (scan, tuning, "a masked slot was read")
            assert (got.double() - expected).abs().max() < 1e-5, (scan, tuning)
    triton_decode.MASK_SCAN = default_scan
    print("masked slots never read")


def check_fast_path_is_taken():
    """A span without holes is read without the per-tile mask loads: count the kernel's loads of mask bytes (the only
    uint8 loads) through Triton's interpreter."""
    from triton.runtime import interpreter

    mask_loads = [0]
    masked_load = interpreter.InterpreterBuilder.create_masked_load

    def counting(self, ptrs, *args, **kwargs):
        mask_loads[0] += ptrs.get_element_ty() == tl.uint8
        return masked_load(self, ptrs, *args, **kwargs)

    interpreter.InterpreterBuilder.create_masked_load = counting
    torch.manual_seed(2)
    programs, length = 2 * 2, 256  # rows x key/value heads
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, length, 16)
    contiguous = torch.zeros(2, 1, 1, length, dtype=torch.bool)
    contiguous[..., 40:200] = True
    holes = contiguous.clone()
    holes[..., 100] = False
    rows = 2
    loads = {}
    for fast, spans, (name, mask) in itertools.product((True, False), (True, False),
                                                      (("contiguous", contiguous), ("holes", holes))):
        mask_loads[0] = 0
        # a new mask object each time: spans found for one call are kept on its mask (row_spans)
        tuning = triton_decode.Tuning(splits=1, contiguous_fast_path=fast, spans_per_forward=spans)
        triton_decode.launch(q, k, k, mask.clone(), 0.25, tuning)
        loads[fast, spans, name] = mask_loads[0]
    interpreter.InterpreterBuilder.create_masked_load = masked_load
    # the span scanned once per row (row_spans), else once per program; nothing more on the fast path
    assert loads[True, True, "contiguous"] == rows, (loads, "one scan per row")
    assert loads[True, False, "contiguous"] == programs, (loads, "one scan per program")
    tile_loads = {key: n - (rows if key[1] else programs) for key, n in loads.items()}
    assert len({n for key, n in tile_loads.items() if key != (True, True, "contiguous")
                and key != (True, False, "contiguous")}) == 1 and tile_loads[False, True, "holes"] > 0, tile_loads
    print("fast path taken", loads)


def check_spans_are_found_once_per_mask_object():
    """The other layers of a forward get the same mask object: its rows' spans come from the first call; an in-place
    change of the mask is scanned again."""
    torch.manual_seed(3)
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 64, 16)
    mask = torch.zeros(2, 1, 1, 64, dtype=torch.bool)
    mask[0, ..., 5:40] = True
    mask[1, ..., 0:40] = True
    first = triton_decode.launch(q, k, k, mask, 0.25)
    spans = mask._dschat_row_spans[1]
    assert spans.tolist() == [[5, 39, 1], [0, 39, 1]], spans
    assert torch.equal(triton_decode.launch(q, k, k, mask, 0.25), first)
    assert mask._dschat_row_spans[1] is spans  # reused, not scanned again
    mask[0, ..., 40] = True  # the next decode step's slot
    mask[1, ..., 20] = False  # and a hole
    got = triton_decode.launch(q, k, k, mask, 0.25)
    assert mask._dschat_row_spans[1].tolist() == [[5, 40, 1], [0, 39, 0]]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), k.repeat_interleave(2, 1),
                                                                 attn_mask=mask).transpose(1, 2)
    assert (got - expected).abs().max() < 1e-5
    print("spans once per mask object")


def check_kernel_applies_only_where_it_equals_sdpa():
    q, k = torch.zeros(2, 4, 1, 16), torch.zeros(2, 2, 8, 16)
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    assert attention.kernel_applies(q, k, k, mask)
    assert attention.kernel_applies(q, k, k, None)
    assert not attention.kernel_applies(torch.zeros(2, 4, 3, 16), k, k, None), "prefill goes to SDPA"
    assert not attention.kernel_applies(q, k, k, mask, dropout=0.1)
    assert not attention.kernel_applies(q, k, k, mask, softcap=30.0)
    assert not attention.kernel_applies(q, k, k, mask.float()), "additive float masks go to SDPA"
    assert not attention.kernel_applies(q, k, k, torch.ones(2, 4, 1, 8, dtype=torch.bool)), "per-head masks"
    assert not attention.kernel_applies(q, torch.zeros(2, 3, 8, 16), torch.zeros(2, 3, 8, 16), None)
    assert not attention.kernel_applies(q.bfloat16(), k.bfloat16(), k.bfloat16(), mask), \
        "the interpreter's bf16 dot products are wrong: no kernel for bf16 off the GPU"
    print("applies where it should")


def counted(name, calls):
    """Replace ``triton_decode.<name>`` by a wrapper that records each call in ``calls[name]``."""
    kernel = getattr(triton_decode, name)
    calls[name] = 0

    def counting(*args):
        calls[name] += 1
        return kernel(*args)

    setattr(triton_decode, name, counting)


NEW_TOKENS = 8  # an EOS at step 1-3 ends some rows early; each forward is ~0.5 s in the interpreter


def check_engine_greedy_equals_hf(family):
    """The eager loop and the graph step's logic (not captured on the CPU) with both kernels: HF generate's tokens."""
    from dschat.hybrid_engine.cache import TokenWriteLayer
    from dschat.hybrid_engine.graphs import GraphDecoder

    calls = {}
    counted("decode_attention", calls)
    counted("write_token_kv", calls)
    model = tiny_model(family, seed=3)
    engine = HybridEngine(make_ds_engine(model), HybridEngineConfig(enabled=True, max_out_tokens=64),
                          pad_token_id=PAD, decode_attention="triton")
    assert engine.decode_attention == "triton"
    ids, mask = left_padded_batch([7, 3, 5, 1])
    no_eos = hf_generate(model, ids, mask, NEW_TOKENS)
    eos = early_token(no_eos[0, ids.shape[1]:])
    expected = hf_generate(model, ids, mask, NEW_TOKENS, eos_token_id=eos)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    steps = expected.shape[1] - ids.shape[1] - 1  # forwards after the prefill
    for path in ("eager", "graph step"):
        if path == "graph step":
            engine.graph_decoder = GraphDecoder(engine.kv_cache, capture_graphs=False)
        calls.update(decode_attention=0, write_token_kv=0)
        engine.eval()
        # The graph step's generation also gives the log-probs compared with SDPA's below (its cache, rounded up to
        # the graph's length, is split along the cache: the combine kernel's output feeds them), rather than a third
        # generation with the kernels for them.
        got = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                              return_logprobs=path == "graph step")
        if path == "graph step":
            got, with_kernels = got
        assert torch.equal(got, expected), (family, path, got, expected)
        assert calls["decode_attention"] >= layers * steps and calls["write_token_kv"] >= layers * steps, \
            (family, path, calls)
        assert model.config._attn_implementation == "sdpa", "the switch must end with the generation"
    assert engine.graph_decoder.replays > 0
    assert all(type(layer) is TokenWriteLayer for layer in engine.kv_cache._cache.layers)
    # equal tokens could hide a small error: the decode step's log-probs must equal SDPA's
    engine.graph_decoder = None
    engine.decode_attention = "sdpa"
    _, with_sdpa = engine.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos,
                                   return_logprobs=True)
    assert (with_kernels - with_sdpa).abs().max() < 1e-5, (family, (with_kernels - with_sdpa).abs().max())
    print(f"{family}: engine with the kernels == HF generate, eager and graph step ({calls})")


def check_token_write_equals_index_copy():
    torch.manual_seed(5)
    keys, values = torch.randn(4, 3, 10, 80), torch.randn(4, 3, 10, 80)
    rows_k, rows_v = keys[:2], values[:2]  # a bucket's row view of the storage
    new_k = torch.randn(2, 1, 3, 80).transpose(1, 2)  # (B, H, 1, D) as attention modules pass it
    new_v = torch.randn(2, 1, 3, 80).transpose(1, 2)
    expected_k, expected_v = keys.clone(), values.clone()
    expected_k[:2].index_copy_(2, torch.tensor([7]), new_k)
    expected_v[:2].index_copy_(2, torch.tensor([7]), new_v)
    triton_decode.write_token_kv(rows_k, rows_v, new_k, new_v, torch.tensor(7))
    assert torch.equal(keys, expected_k) and torch.equal(values, expected_v)
    print("token write == index_copy_")


def check_resolve_mode():
    assert attention.resolve_mode("auto", "cpu") == "sdpa"
    assert attention.resolve_mode("triton", "cpu") == "triton"
    assert attention.resolve_mode("sdpa", "cuda") == "sdpa"
    try:
        attention.resolve_mode("flash", "cpu")
    except ValueError:
        pass
    else:
        raise AssertionError("an unknown mode must be refused")
    print("modes resolve")


CHECKS = {
    "kernel": check_kernel_matches_sdpa,
    "skip": check_masked_blocks_are_not_read,
    "fast": check_fast_path_is_taken,
    "spans": check_spans_are_found_once_per_mask_object,
    "applies": check_kernel_applies_only_where_it_equals_sdpa,
    "modes": check_resolve_mode,
    "write": check_token_write_equals_index_copy,
    "llama": lambda: check_engine_greedy_equals_hf("llama"),
    "opt": lambda: check_engine_greedy_equals_hf("opt"),
    "gpt2": lambda: check_engine_greedy_equals_hf("gpt2"),
}

if __name__ == "__main__":
    for name in sys.argv[1:] or CHECKS:
        CHECKS[name]()
