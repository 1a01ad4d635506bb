"""Answers from an HF causal LM to formatted prompts, tokenized and decoded the way training does it."""
import torch

from dschat.data.collators import pad_sequences
from dschat.data.formatting import uses_chat_template
from dschat.data.pipeline import tokenize_texts
from dschat.models.loading import check_sequence_fits, stop_token_ids
from dschat.rlhf.trainer import answer_mask, answer_texts, hf_generate, suppress_untokenized


def encode_prompts(tokenizer, prompt_texts):
    """Token ids of ``format_prompt`` texts, exactly as the data pipeline makes step 3's prompts.

    A chat template already writes its BOS text, so special tokens are added only without one.
    """
    return tokenize_texts(tokenizer, list(prompt_texts), add_special_tokens=not uses_chat_template(tokenizer))


def left_padded(ids_list, pad_token_id, device):
    """(input_ids, attention_mask), left-padded so every row's answer starts at the same column."""
    ids = pad_sequences([torch.tensor(ids) for ids in ids_list], pad_token_id, side="left")
    mask = pad_sequences([torch.ones(len(ids), dtype=torch.long) for ids in ids_list], 0, side="left")
    return ids.to(device), mask.to(device)


def decode_answers(tokenizer, answer_ids, stop_ids=None):
    """Answer texts: generated tokens before the first stop id (default: the tokenizer's EOS), without it or
    padding."""
    stop_ids = stop_ids or [tokenizer.eos_token_id]
    is_stop = torch.isin(answer_ids, torch.tensor(stop_ids, device=answer_ids.device))
    keep = answer_mask(answer_ids, stop_ids).bool() & ~is_stop
    return answer_texts(tokenizer, answer_ids, keep)


def generate_answers(model, tokenizer, prompt_texts, generation_kwargs, batch_size=8):
    """One answer per formatted prompt, with HF ``generate`` stopping at the tokenizer's EOS (and the model's other
    EOS ids, ``stop_token_ids``), never choosing an id the tokenizer has no token for (``untokenized_ids``: it would
    decode to nothing), as step 3's rollouts do: through their ``hf_generate`` (a family that left padding moves
    generates without it, and RWKV's batched decode keeps its rows apart)."""
    return generate_answers_and_cuts(model, tokenizer, prompt_texts, generation_kwargs, batch_size)[0]


def unended(answer_ids, stop_ids):
    """Per row of generated ids, whether it holds no stop id: generation ended it at its length (max_new_tokens), not
    the model."""
    return (~torch.isin(answer_ids, torch.tensor(stop_ids, device=answer_ids.device)).any(dim=1)).tolist()


@torch.no_grad()
def generate_answers_and_cuts(model, tokenizer, prompt_texts, generation_kwargs, batch_size=8):
    """(``generate_answers``' answers, whether each was cut: it reached max_new_tokens before the model ended it)."""
    answers, cuts, stop_ids = [], [], stop_token_ids(model, tokenizer)
    generation_kwargs = {**suppress_untokenized(model, tokenizer), **generation_kwargs}  # (the caller's own wins)
    say_generation_config_settings(model, {"eos_token_id": stop_ids, "pad_token_id": tokenizer.pad_token_id,
                                           **generation_kwargs})
    for start in range(0, len(prompt_texts), batch_size):
        ids, mask = left_padded(encode_prompts(tokenizer, prompt_texts[start:start + batch_size]),
                                tokenizer.pad_token_id, model.device)
        new_tokens = generation_kwargs.get("max_new_tokens")
        if new_tokens:  # past a learned position table, generate fails with an IndexError (a CUDA assert on GPUs)
            check_sequence_fits(model, ids.shape[1] + new_tokens,
                                f"a prompt of {ids.shape[1]} tokens + --max_new_tokens {new_tokens}")
        # (step 3's path, not model.generate: an RWKV batch answered from padded, mixed rows otherwise)
        sequences = hf_generate(model, tokenizer)(ids, attention_mask=mask, eos_token_id=stop_ids,
                                                  pad_token_id=tokenizer.pad_token_id, **generation_kwargs)
        answers += decode_answers(tokenizer, sequences[:, ids.shape[1]:], stop_ids)
        cuts += unended(sequences[:, ids.shape[1]:], stop_ids)
    return answers, cuts


def say_generation_config_settings(model, call_kwargs):
    """The model's generation_config settings that no flag of the tool sets and HF's ``generate`` applies (e.g.
    Qwen2.5-Instruct's repetition_penalty 1.05): said once per model, as the flags' settings are seen on the command
    line (``generation_config_note``)."""
    from dschat.hybrid_engine.generate_args import generation_config_note
    from dschat.utils.cli import say_once

    name = getattr(model, "name_or_path", "") or "the model"
    note = generation_config_note(model, call_kwargs, f"{name}'s", "", "flag of this tool")
    if note:
        say_once(f"note: {note}")
