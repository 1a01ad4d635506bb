"""Model families whose outputs left padding moves: transformers' modelling of them does not let the attention mask
reach every layer, so a left-padded row scores (or generates) otherwise than the row alone. The reward model / critic
(``RewardModel.token_values``) and the actor (``trainer.hf_generate``, the hybrid engine) look them up here."""

# Backbone families (config.model_type) whose transformers modelling lets left padding into a row's score: the
# attention mask does not reach all of its layers, so a left-padded row scores otherwise than the row alone (0.4 to 2.1
# off on tiny random models: bench/family_sweep.py, docs/benchmarks.md). Listed: nothing in the config tells.
# A reward model or critic given left-padded rows of one of them, or an actor generating from such prompts, warns
# once (``warn_once_of_left_padding``).
LEFT_PADDING_MOVES_SCORES = {
    "rwkv": "its recurrent layers read no attention mask",
    "xlstm": "its recurrent layers read no attention mask",
    "recurrent_gemma": "its recurrent layers read no attention mask",
    "deepseek_v4": "its compressed attention pools over the padding",
}
_WARNED_LEFT_PADDING = set()  # (role, family) warned of in this process


def left_padding_moves(model):
    """Why left padding moves the outputs of ``model`` (an HF model, PEFT-wrapped or not, or a ``RewardModel``): its
    family's reason in ``LEFT_PADDING_MOVES_SCORES``, or None."""
    return LEFT_PADDING_MOVES_SCORES.get(getattr(getattr(model, "config", None), "model_type", None))


def warn_once_of_left_padding(model, attention_mask, role, does, where):
    """Where ``model``'s family is in ``LEFT_PADDING_MOVES_SCORES`` and some row of ``attention_mask`` is
    left-padded: once per ``role`` and family in this process, "warning: {role} on {class} {does}: {reason} ...
    {where}". For other families a dictionary look-up, and no host sync."""
    reason = left_padding_moves(model)
    key = (role, model.config.model_type) if reason else None
    if reason is None or key in _WARNED_LEFT_PADDING or attention_mask is None:
        return
    if not bool(((attention_mask[:, 0] == 0) & attention_mask.bool().any(1)).any()):
        return
    _WARNED_LEFT_PADDING.add(key)
    from dschat.models.lora import unwrap_peft
    from dschat.utils.dist import print_rank_0

    inner = unwrap_peft(getattr(model, "rwtransformer", model))
    print_rank_0(f"warning: {role} on {type(inner).__name__} {does}: {reason} (transformers' modelling). {where}")


def warn_of_padded_generation(model, attention_mask):
    """Once per family: an actor of ``LEFT_PADDING_MOVES_SCORES`` generates from left-padded prompts where the padding
    cannot be left out (HF generate: ``trainer.generate_row_by_row``; the hybrid engine: ``_prompt_lengths_apart``)."""
    warn_once_of_left_padding(
        model, attention_mask, "the actor", "generates from left-padded prompts otherwise than from the prompts alone",
        "Step 3 scores its answers' log-probs on rows shifted to start at their first token (unless "
        "--padded_forwards), so its answers are not sampled from the policy it trains. dschat's HF generate and "
        "hybrid engine take the rows of each prompt length together, without their padding (HF generate: each row "
        "alone where the family's batched decode mixes rows), except for a prompt with no token or a hole and (HF "
        "generate) with no pad id")
