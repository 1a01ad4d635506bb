"""Step 1: supervised fine-tuning on prompt + chosen answer (loss on answer tokens by default)."""
import math

import torch

from dschat.args import step1_parser, step_settings
from dschat.data.samplers import eval_weights
from dschat.models.checkpoint import save_causal_lm
from dschat.models.loading import load_causal_lm
from dschat.models.lora import apply_lora
from dschat.steps.common import StepRecipe, run_supervised_step, to_device
from dschat.utils.dist import all_reduce


def build_sft_model(args, tokenizer, ds_config):
    model = load_causal_lm(args.model_name_or_path, tokenizer, ds_config, dropout=args.dropout)
    return apply_lora(model, args.lora_dim, args.lora_module_name, args.lora_alpha,
                      only_optimize_lora=args.only_optimize_lora)


def sft_collator(tokenizer, pad_to_multiple_of=1, max_length=None):
    from dschat.data import DataCollatorSFT

    return DataCollatorSFT(tokenizer.pad_token_id, pad_to_multiple_of=pad_to_multiple_of,
                           max_length=max_length)


def lm_loss(engine, batch):
    """(the mean loss over the batch's labelled tokens, its tokens)."""
    out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                 use_cache=False)
    return out.loss, int(batch["attention_mask"].sum())


def labelled_tokens(labels):
    """The tokens ``lm_loss`` averages over: those with a label, less the first position (no token predicts it)."""
    return (labels[:, 1:] != -100).sum()


def loss_tokens(batch):
    return int(labelled_tokens(batch["labels"]))


@torch.no_grad()
def evaluate_lm(engine, eval_loader, device):
    """Token-weighted eval loss over all ranks and its perplexity, with the eval records ("eval_records", each once:
    a rank's padding repeats left out) and the tokens it averages ("eval_tokens": those with a label, the answers',
    and the prompts' too under --include_prompt_in_loss) they were taken over."""
    engine.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss x tokens, tokens, records
    for batch in eval_loader:
        batch = to_device(batch, device)
        weights = eval_weights(batch, batch["labels"].shape[0], device)
        # a rank's padding repeats (weight 0) take part in the forward but not in the loss
        batch["labels"] = batch["labels"].masked_fill(weights[:, None] == 0, -100)
        loss, _ = lm_loss(engine, batch)
        n = labelled_tokens(batch["labels"])
        totals[2] += weights.sum()
        if n > 0:  # an all-padding batch has a nan loss over no tokens
            totals[:2] += torch.stack([loss.double() * n, n.double()])
    all_reduce(totals)
    counts = {"eval_records": int(totals[2].item()), "eval_tokens": int(totals[1].item())}
    if totals[1] == 0:  # no eval records (or tokens): no score, rather than a loss of 0 and a perfect perplexity
        return {"eval_loss": None, "perplexity": None, **counts}
    loss = (totals[0] / totals[1]).item()
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0)), **counts}


SFT = StepRecipe(name="step1", phase=1, build_model=build_sft_model, collator=sft_collator, loss_fn=lm_loss,
                 evaluate_fn=evaluate_lm, save_fn=save_causal_lm, loss_tokens=loss_tokens)


def main(args=None):
    """Train an SFT model; returns the final metrics (eval loss and perplexity)."""
    args = step_settings(step1_parser(), args)  # (a notebook's dict too)
    return run_supervised_step(args, SFT)
