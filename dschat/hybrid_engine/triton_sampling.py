"""The decode step's token choice and log-sum-exp in one pass over the logits (Triton).

Why: the torch path of ``sampling.py`` makes several passes over the (B, V) logits each step: the exponential noise is
written in fp32, its log taken in place, subtracted from the logits and arg-maxed; the sampled tokens' log-probs then
materialise an fp32 ``log_softmax`` of the whole vocabulary to gather B numbers from it. Here every program reads a
slice of a row's logits once, draws its own noise (Philox, from a seed the caller's ``torch.Generator`` draws on the
device), and keeps a running race winner and a running log-sum-exp; a second, tiny kernel combines the slices.

The race is the same as ``sampling.exponential_race``: ``argmax(logits / T - log E)``, E ~ Exp(1). E is made from
31 random bits as ``-log1p(-v)``, v = (k + 1/2) / 2**31, so E keeps 2**-31 steps near 0, where a token of tiny
probability p wins (E < p x the winner's share); ``-log u`` of a float32 uniform u would floor E at 6e-8 and never
draw such tokens. The noise depends only on (seed, row, column), not on how the vocabulary is split over programs,
so the launch shape never changes a draw. Greedy selection is the first maximal column, as ``torch.argmax`` (NaN
logits aside: they never win here). Every launch shape depends only on tensor shapes, so both kernels are captured
in CUDA graphs; the seed is drawn by a torch op from the generator, which a graph registers, so each replay draws new
noise. ``TRITON_INTERPRET=1`` runs them on the CPU for tests.
"""
import functools

import torch
import triton
import triton.language as tl

# Launch settings from ``python bench/sampling.py --sweep`` (H200, fifteenth session; most settings land within 10%
# of each other). With a log-sum-exp at B = 64: 24.0 us for OPT's 50k vocabulary and 51.5 us for Qwen2.5's 152k,
# against 66.4 and 208.2 us for torch's path (docs/benchmarks.md).
LANES = 256  # columns per lane vector; a program reads 4 x LANES columns per Philox call (randint4x)
PROGRAMS_PER_SM = 8  # the vocabulary is split so that B x splits gives about this many programs per multiprocessor
NUM_WARPS = 4
MULTIPROCESSORS_OFF_GPU = 132  # the interpreter sizes the split as if on an H200


@triton.jit
def _exponential(bits):
    """E ~ Exp(1) from 32 random bits: ``-log1p(-v)`` for v uniform in (0, 1) with 2**-31 steps near 0 (a series
    there; Triton's interpreter has no log1p). Below 1/16 the series' 7th term is under 1e-8 of E; above it 1 - v is
    exact to 3e-8. v stops short of 1, so E is finite (at most ~16.6)."""
    k = bits.to(tl.int32, bitcast=True)
    k = tl.where(k < 0, ~k, k)  # 31 uniform bits
    v = tl.minimum((k.to(tl.float32) + 0.5) * 4.656612873077393e-10, 0.99999994)
    series = v * (1.0 + v * (0.5 + v * (0.3333333333 + v * (0.25 + v * (0.2 + v * 0.1666666667)))))
    return tl.where(v < 0.0625, series, -tl.log(1.0 - v))


@triton.jit
def _lane_update(row_logits, cols, vocab, race_vocab, bits, inv_temperature, cut, last_tie, best, best_col, run_max,
                 run_sum, SAMPLE: tl.constexpr, LSE: tl.constexpr, FILTER: tl.constexpr):
    """Fold LANES columns into each lane's race winner and online log-sum-exp of the logits over the temperature (of
    every column: the race alone leaves out what top-k/top-p filter, see ``triton_filters``, and the columns from
    ``race_vocab`` on)."""
    x = tl.load(row_logits + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    ok = cols < race_vocab
    if SAMPLE:
        race = x * inv_temperature - tl.log(_exponential(bits))
    else:
        race = x
    if FILTER:
        ok = ok & ((x > cut) | ((x == cut) & (cols <= last_tie)))
    race = tl.where(ok, race, float("-inf"))
    better = race > best  # strict: within a lane the earlier column wins a tie
    best = tl.where(better, race, best)
    best_col = tl.where(better, cols, best_col)
    if LSE:
        scaled = x * inv_temperature
        new_max = tl.maximum(run_max, scaled)
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far: keep the sum at 0, not nan
        run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(scaled - shift)
        run_max = new_max
    return best, best_col, run_max, run_sum


@triton.jit
def _partial_kernel(Logits, Seed, Cut, LastTie, PartRace, PartCol, PartMax, PartSum, stride_lb, vocab, race_vocab,
                    inv_temperature, tiles_per_split, num_tiles, LANES: tl.constexpr, SAMPLE: tl.constexpr,
                    LSE: tl.constexpr, FILTER: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    lanes = tl.arange(0, LANES)
    best = tl.full([LANES], float("-inf"), tl.float32)
    best_col = tl.full([LANES], 2147483647, tl.int32)
    run_max = tl.full([LANES], float("-inf"), tl.float32)
    run_sum = tl.zeros([LANES], tl.float32)
    row_logits = Logits + row.to(tl.int64) * stride_lb
    seed = tl.load(Seed)  # drawn by the caller when sampling (unused when greedy)
    cut = 0.0
    last_tie = 0
    if FILTER:  # the row's top-k/top-p cut (triton_filters.row_cuts)
        cut = tl.load(Cut + row)
        last_tie = tl.load(LastTie + row)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, num_tiles)
    u0 = tl.zeros([LANES], tl.uint32)
    u1 = u0
    u2 = u0
    u3 = u0
    for tile in range(first, last):
        cols = tile * 4 * LANES + lanes
        if SAMPLE:  # one Philox call per 4 columns; its counter names (row, tile, lane): split-independent
            u0, u1, u2, u3 = tl.randint4x(seed, (row * num_tiles + tile) * LANES + lanes)
        best, best_col, run_max, run_sum = _lane_update(row_logits, cols, vocab, race_vocab, u0,
                                                        inv_temperature, cut, last_tie, best, best_col, run_max,
                                                        run_sum, SAMPLE, LSE, FILTER)
        best, best_col, run_max, run_sum = _lane_update(row_logits, cols + LANES, vocab, race_vocab, u1,
                                                        inv_temperature, cut, last_tie, best, best_col, run_max,
                                                        run_sum, SAMPLE, LSE, FILTER)
        best, best_col, run_max, run_sum = _lane_update(row_logits, cols + 2 * LANES, vocab, race_vocab, u2,
                                                        inv_temperature, cut, last_tie, best, best_col, run_max,
                                                        run_sum, SAMPLE, LSE, FILTER)
        best, best_col, run_max, run_sum = _lane_update(row_logits, cols + 3 * LANES, vocab, race_vocab, u3,
                                                        inv_temperature, cut, last_tie, best, best_col, run_max,
                                                        run_sum, SAMPLE, LSE, FILTER)
    top = tl.max(best, 0)
    out = row * tl.num_programs(1) + split
    tl.store(PartRace + out, top)
    tl.store(PartCol + out, tl.min(tl.where(best == top, best_col, 2147483647), 0))  # the first column of the max
    if LSE:
        row_max = tl.max(run_max, 0)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        tl.store(PartMax + out, row_max)
        tl.store(PartSum + out, tl.sum(run_sum * tl.exp(run_max - shift), 0))


@triton.jit
def _combine_kernel(PartRace, PartCol, PartMax, PartSum, Tokens, Lse, splits, SPLITS_PAD: tl.constexpr,
                    LSE: tl.constexpr):
    row = tl.program_id(0)
    parts = tl.arange(0, SPLITS_PAD)
    ok = parts < splits
    at = row * splits + parts
    race = tl.load(PartRace + at, mask=ok, other=float("-inf"))
    col = tl.load(PartCol + at, mask=ok, other=2147483647)
    token = tl.min(tl.where(race == tl.max(race, 0), col, 2147483647), 0)
    tl.store(Tokens + row, tl.where(token == 2147483647, 0, token).to(tl.int64))  # all -inf: column 0, as argmax
    if LSE:
        part_max = tl.load(PartMax + at, mask=ok, other=float("-inf"))
        part_sum = tl.load(PartSum + at, mask=ok, other=0.0)
        row_max = tl.max(part_max, 0)
        shift = tl.where(row_max == float("-inf"), 0.0, row_max)
        tl.store(Lse + row, shift + tl.log(tl.sum(part_sum * tl.exp(part_max - shift), 0)))


@functools.lru_cache(maxsize=None)
def _multiprocessors(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessors(device):
    """``device``'s multiprocessors (off the GPU: MULTIPROCESSORS_OFF_GPU)."""
    if device.type != "cuda":
        return MULTIPROCESSORS_OFF_GPU
    return _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())


def split_count(rows, num_tiles, device):
    """How many programs share a row: enough for ``rows x splits`` to fill the GPU, at least one tile each."""
    return max(1, min(num_tiles, -(-PROGRAMS_PER_SM * multiprocessors(device) // rows)))


def unsupported(logits, generator=None):
    """Why :func:`select_tokens` cannot take these logits (a string), or None. Callers with a fallback check first, so
    that such a call is not taken for a failing kernel (which would turn every Triton kernel off)."""
    if logits.dim() != 2 or logits.shape[0] == 0 or logits.stride(-1) != 1:
        return (f"wants (B > 0, V) logits with contiguous rows, got shape {tuple(logits.shape)} "
                f"strides {logits.stride()}")
    if generator is not None and generator.device.type != logits.device.type:
        return f"a {generator.device.type} generator for {logits.device.type} logits"
    if logits.shape[0] * -(-logits.shape[1] // (4 * LANES)) * LANES >= 2**31:
        return f"{tuple(logits.shape)} logits overflow the 32-bit Philox counters"
    return None


def select_tokens(logits, temperature=1.0, generator=None, do_sample=True, with_lse=False, cuts=None, columns=None):
    """``logits`` (B, V) -> (tokens (B,) int64, log-sum-exp (B,) fp32 of ``logits / temperature`` or None).

    Sampled: one draw per row from ``softmax(logits / temperature)``, over the columns ``cuts`` keeps when given
    (``triton_filters.row_cuts``: top-k/top-p; the log-sum-exp stays the unfiltered one); greedy: the first maximal
    column. ``columns``: only the first ``columns`` columns are chosen from (the tokenizer's ids: ``sampling.py``);
    the log-sum-exp is still of all V. The seed is drawn from ``generator`` (the device's default generator when None)
    on the logits' device, without a host sync."""
    reason = unsupported(logits, generator if do_sample else None)
    if reason is not None:
        raise ValueError(f"select_tokens: {reason}")
    rows, vocab = logits.shape
    race_vocab = vocab if columns is None else min(int(columns), vocab)
    num_tiles = -(-vocab // (4 * LANES))
    splits = split_count(rows, num_tiles, logits.device)
    tiles_per_split = -(-num_tiles // splits)
    splits = -(-num_tiles // tiles_per_split)  # no program without a tile
    device = logits.device
    seed = torch.empty(1, dtype=torch.int64, device=device) if do_sample else torch.zeros(1, dtype=torch.int64,
                                                                                            device=device)
    if do_sample:
        seed.random_(generator=generator)
    part_race = torch.empty((rows, splits), dtype=torch.float32, device=device)
    part_col = torch.empty((rows, splits), dtype=torch.int32, device=device)
    part_max = torch.empty((rows, splits), dtype=torch.float32, device=device) if with_lse else part_race
    part_sum = torch.empty((rows, splits), dtype=torch.float32, device=device) if with_lse else part_race
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    lse = torch.empty(rows, dtype=torch.float32, device=device) if with_lse else None
    cut, last_tie = cuts if cuts is not None else (part_race, part_col)  # unread without cuts
    _partial_kernel[(rows, splits)](logits, seed, cut, last_tie, part_race, part_col, part_max, part_sum,
                                    logits.stride(0), vocab, race_vocab, 1.0 / temperature, tiles_per_split, num_tiles,
                                    LANES=LANES, SAMPLE=bool(do_sample), LSE=with_lse, FILTER=cuts is not None,
                                    num_warps=NUM_WARPS)
    _combine_kernel[(rows,)](part_race, part_col, part_max, part_sum, tokens, lse if with_lse else part_race,
                             splits, SPLITS_PAD=triton.next_power_of_2(splits), LSE=with_lse, num_warps=1)
    return tokens, lse
