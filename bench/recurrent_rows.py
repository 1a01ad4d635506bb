"""Step 3's HF generate of the recurrent families, rows of one prompt length together, against each row alone.

dschat's HF generate path (``trainer.hf_generate``, what step 3's rollouts without the hybrid engine and its held-out
evaluation call) generates a ``LEFT_PADDING_MOVES_SCORES`` family's left-padded prompts without their padding: the
rows of one prompt length in one call where the family's batched decode keeps rows apart (``decodes_rows_apart``:
RWKV and xLSTM with dschat's mends, RecurrentGemma, DeepSeek-V4), else one row at a time. Session 62 showed the
grouped tokens equal each row's alone on the CPU in float32; on CUDA a batched bf16 matmul may round otherwise than
one row's, so this measures it there.

For each family (a family the installed transformers lacks is skipped, its reason printed) and dtype, on --device:
the tiny random model the tests use (tests/helpers.py, seed 0), left-padded prompts of --lengths tokens,
--rows_per_length rows of each, greedy --new_tokens tokens (a) through ``trainer.hf_generate`` and (b) each row alone
through HF ``generate`` (from fresh module states, as (a) does: RecurrentGemma keeps them in its modules). The
mends ``decodes_rows_apart`` puts in are the process's, so (b) runs with them too (xLSTM's tiny cache needs it; one
RWKV row is the same with it or without).

    python bench/recurrent_rows.py --device cuda --families rwkv,xlstm --dtypes float32,bfloat16 --json rows.json
    python bench/recurrent_rows.py --device cpu --lengths 20,6,1 --rows_per_length 3 --new_tokens 24   # (defaults)

A markdown table: per family and dtype the rows, the generate calls (a) made (groups), the rows whose tokens equal
alone, the first answer position where a row's differ, and the largest |logit delta| between (a) and (b) over the
steps both had the same tokens before. --json NAME writes the table's rows (each row's own too) to $OUT/NAME.
Exits 1 on a crash or a float32 row unequal to alone; a bf16 difference is reported, not failed.
"""
import argparse
import os
import sys
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "tests", "scripts"))
from helpers import tiny_deepseek_v4_actor, tiny_recurrent_gemma_actor, tiny_rwkv, tiny_xlstm  # noqa: E402
from hybrid_common import PAD, left_padded_batch  # noqa: E402
from results import json_name, list_flag, positive_error, run_benchmark, unknown_name, write_json  # noqa: E402

VOCAB = 96  # (the tiny models' vocabulary)
TINY_MODELS = {"rwkv": tiny_rwkv, "recurrent_gemma": tiny_recurrent_gemma_actor,
               "deepseek_v4": tiny_deepseek_v4_actor, "xlstm": tiny_xlstm}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STRICT_DTYPES = ("float32",)  # (a difference in these fails the run; in bf16 it is the finding to record)


class StepLogits:
    """A logits processor that keeps each step's scores (float32, (B, V)) as generate hands them over and changes
    nothing: what the grouped and the lone calls computed, to compare."""

    def __init__(self):
        self.steps = []

    def __call__(self, input_ids, scores):
        self.steps.append(scores.detach().float().cpu())
        return scores


def generate_logged(generate, calls):
    """``generate``, each call's (prompt ids, StepLogits) appended to ``calls``."""
    from transformers import LogitsProcessorList

    def call(input_ids, **kwargs):
        steps = StepLogits()
        calls.append((input_ids, steps))
        return generate(input_ids, logits_processor=LogitsProcessorList([steps]), **kwargs)
    return call


def stand_in_tokenizer():
    """What ``hf_generate`` reads of a tokenizer: its length (every id of the tiny vocabulary has a token, so none is
    suppressed), its pad id and no EOS."""
    return type("Tokenizer", (), {"__len__": lambda self: VOCAB, "eos_token_id": None, "pad_token_id": PAD})()


def grouped(model, ids, mask, new_tokens):
    """(answers (B, new_tokens), [(rows, StepLogits)] of each generate call) of step 3's HF generate path."""
    from dschat.hybrid_engine.generate_args import left_padded_lengths
    from dschat.rlhf.trainer import decodes_rows_apart, hf_generate, rows_to_generate_together

    calls = []
    model.generate = generate_logged(model.generate, calls)  # (read by hf_generate: its calls are logged)
    try:
        seq = hf_generate(model, stand_in_tokenizer())(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                                       do_sample=False, pad_token_id=PAD)
    finally:
        del model.generate
    # (generate_row_by_row makes its calls in the order rows_to_generate_together gives; checked on the prompts)
    groups = rows_to_generate_together(left_padded_lengths(mask), decodes_rows_apart(model))
    width = ids.shape[1]
    if len(groups) != len(calls) or any(not torch.equal(prompt, ids[rows, width - length:])
                                        for (prompt, _), (rows, length) in zip(calls, groups)):
        raise RuntimeError(f"hf_generate made {len(calls)} calls, not one per group of rows_to_generate_together "
                           f"({len(groups)}) in its order")
    return seq[:, width:], [(rows.tolist(), steps) for (_, steps), (rows, _) in zip(calls, groups)]


def alone(model, ids, mask, row, new_tokens):
    """(answer (new_tokens,), StepLogits) of HF generate on row ``row``'s prompt without its padding."""
    from dschat.rlhf.trainer import from_fresh_module_states

    length = int(mask[row].sum())
    prompt = ids[row:row + 1, ids.shape[1] - length:]
    calls = []
    generate = generate_logged(model.generate, calls)
    seq = from_fresh_module_states(model, generate, prompt, attention_mask=torch.ones_like(prompt),
                                   max_new_tokens=new_tokens, do_sample=False, pad_token_id=PAD)
    return seq[0, length:], calls[0][1]


def first_difference(together, by_itself):
    """The first answer position whose tokens differ, or None."""
    differ = (together != by_itself).nonzero()
    return int(differ[0]) if len(differ) else None


def logit_delta(together_steps, index, alone_steps, last_step):
    """Largest |logit difference| of a row (``index`` in its call) over steps 0..``last_step``: those computed from
    the same tokens (at the first differing one too; after it the two read other tokens)."""
    return max(float((together_steps[step][index] - alone_steps[step][0]).abs().max())
               for step in range(last_step + 1))


def compare_rows(model, ids, mask, new_tokens):
    """(count of the grouped path's generate calls, per row {row, prompt_length, first_difference,
    max_logit_delta})."""
    answers, calls = grouped(model, ids, mask, new_tokens)
    rows = []
    for rows_of_call, steps in calls:
        for index, row in enumerate(rows_of_call):
            answer, steps_alone = alone(model, ids, mask, row, new_tokens)
            differ = first_difference(answers[row, :len(answer)], answer)
            rows.append({"row": row, "prompt_length": int(mask[row].sum()), "first_difference": differ,
                         "max_logit_delta": logit_delta(steps.steps, index, steps_alone.steps,
                                                        new_tokens - 1 if differ is None else differ)})
    return len(calls), sorted(rows, key=lambda r: r["row"])


def measure(family, dtype_name, device, lengths, new_tokens):
    """The table row of ``family`` in ``dtype_name``: its counts, or a skip or error saying why."""
    result = {"family": family, "dtype": dtype_name}
    try:
        model = TINY_MODELS[family]()
    except ImportError as error:  # (a family this transformers lacks)
        return {**result, "dtype": "all", "skip": f"transformers lacks it: {error}"}  # (so every dtype)
    try:
        model = model.to(device=device, dtype=DTYPES[dtype_name])
        ids, mask = (t.to(device) for t in left_padded_batch(lengths, vocab_size=VOCAB, seed=0))
        with torch.no_grad():
            groups, rows = compare_rows(model, ids, mask, new_tokens)
    except Exception as error:  # noqa: BLE001 - reported, the run fails, the other families go on
        traceback.print_exc()
        return {**result, "error": f"{type(error).__name__}: {str(error)[:300]}"}
    differing = [r["first_difference"] for r in rows if r["first_difference"] is not None]
    return {**result, "rows": len(rows), "groups": groups, "equal": len(rows) - len(differing),
            "first_difference": min(differing, default=None),
            "max_logit_delta": max(r["max_logit_delta"] for r in rows), "per_row": rows}


def failed(result):
    """Whether ``result`` fails the run: a crash, or a row unequal to alone in a strict dtype."""
    return "error" in result or (result["dtype"] in STRICT_DTYPES and result.get("equal", 0) < result.get("rows", 0))


def table(results):
    lines = ["| family | dtype | rows | groups | equal to alone | first differing position | max abs logit delta |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "rows" in r:
            differ = "-" if r["first_difference"] is None else r["first_difference"]
            cells = [r["rows"], r["groups"], r["equal"], differ, f"{r['max_logit_delta']:.3g}"]
        else:
            cells = ["SKIP " + r["skip"] if "skip" in r else "ERROR " + r["error"], "", "", "", ""]
        lines.append("| " + " | ".join(str(c) for c in [r["family"], r["dtype"], *cells]) + " |")
    return "\n".join(lines)


def device_flag(text):
    """An argparse type for --device: cpu, cuda or cuda:N. A typo ("cuda0") was a traceback of torch.device's naming
    no flag, and another device type (meta) failed each family's run. (Whether torch sees that GPU is asked after the
    parse, ``gpu_not_seen``: the commands the docs quote for the GPU machine parse on a CPU.)"""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: not a device this check runs on (cpu, cuda or cuda:N)")
    return text


def gpu_not_seen(text):
    """Why --device ``text`` names a GPU torch does not see (failing only once each family's model was built), else
    None."""
    device = torch.device(text)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and (device.index or 0) >= gpus:
        return f"{text!r}: torch {torch.__version__} sees {gpus} CUDA GPU(s) (--device cpu runs on the CPU)"
    return None


def parse_args(argv):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=device_flag,
                   help="cpu, cuda or cuda:N: where the models run (default: cuda if torch sees a GPU, else cpu)")
    p.add_argument("--families", default=",".join(TINY_MODELS), type=list_flag(unknown_name(TINY_MODELS, "family")),
                   help="comma-separated, of %(default)s")
    p.add_argument("--dtypes", default=",".join(DTYPES), type=list_flag(unknown_name(DTYPES, "dtype")),
                   help="comma-separated, of %(default)s")
    # (defaults: prompts past the tiny models' attention windows (16) and DeepSeek-V4's pooling every 4 tokens, within
    # the tiny RWKV's context length (64) with the answer)
    p.add_argument("--lengths", default="20,6,1", type=list_flag(positive_error("a prompt length")),
                   help="comma-separated prompt lengths, each a group of rows (default %(default)s)")
    p.add_argument("--rows_per_length", type=int, default=3, help="rows of each prompt length (default %(default)s)")
    p.add_argument("--new_tokens", type=int, default=24, help="greedy tokens generated (default %(default)s)")
    p.add_argument("--json", type=json_name, help="a file name: the rows are written to $OUT/JSON")
    args = p.parse_args(argv)
    if why := gpu_not_seen(args.device):
        p.error(f"argument --device: {why}")
    for flag in ("rows_per_length", "new_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} {getattr(args, flag)}: at least 1")
    return args


def main(argv=None):
    import transformers

    args = parse_args(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} transformers {transformers.__version__} {name}", flush=True)
    # (interleaved, as a loader's batch mixes them: 20, 6, 1, 20, 6, 1, ...)
    lengths = [int(n) for _ in range(args.rows_per_length) for n in args.lengths.split(",")]
    results = []
    for family in args.families.split(","):
        for dtype_name in args.dtypes.split(","):
            results.append(measure(family, dtype_name, device, lengths, args.new_tokens))
            if "skip" in results[-1]:
                print(f"{family}: skipped, {results[-1]['skip']}", flush=True)
                break
    print(table(results), flush=True)
    if args.json:
        write_json(args.json, {"device": name, "transformers": transformers.__version__, "lengths": lengths,
                               "new_tokens": args.new_tokens, "results": results})
    failures = [f"{r['family']} {r['dtype']}" for r in results if failed(r)]
    print(f"failures (a crash, or float32 rows unequal to alone): {', '.join(failures) or 'none'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    run_benchmark(main)
