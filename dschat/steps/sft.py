"""Step 1: supervised fine-tuning on prompt + chosen answer (loss on answer tokens by default)."""
import math
import time

import torch
from transformers import AutoModelForCausalLM

from dschat.args import step1_parser
from dschat.models.checkpoint import save_causal_lm
from dschat.models.loading import create_hf_model, load_tokenizer
from dschat.models.lora import apply_lora
from dschat.steps.common import (Throughput, build_dataloaders, count_params, format_metrics, initialize_engine,
                                 num_update_steps, run_training, setup_run, tensorboard_writer, to_device,
                                 write_metrics)
from dschat.utils.dist import all_reduce, get_world_size, print_rank_0
from dschat.utils.ds_config import get_train_ds_config


def load_step_data(args, tokenizer, phase):
    """The tokenized train/eval datasets of one phase, from the data flags every step shares."""
    from dschat.data import create_prompt_dataset, get_eot_token

    return create_prompt_dataset(
        args.local_rank, args.data_path, args.data_split, args.data_output_path, phase, args.seed, tokenizer,
        args.max_seq_len, end_of_conversation_token=get_eot_token(tokenizer),
        sft_only_data_path=args.sft_only_data_path if phase == 1 else (), reload=args.reload_data,
        include_prompt_in_loss=getattr(args, "include_prompt_in_loss", False),
        data_fields=args.data_fields or None)


def lm_loss(engine, batch):
    out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                 use_cache=False)
    return out.loss, int(batch["attention_mask"].sum())


@torch.no_grad()
def evaluate_lm(engine, eval_loader, device, max_batches):
    """Token-weighted eval loss over all ranks and its perplexity."""
    engine.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for i, batch in enumerate(eval_loader):
        if max_batches and i >= max_batches:
            break
        batch = to_device(batch, device)
        out = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     labels=batch["labels"], use_cache=False)
        n = (batch["labels"][:, 1:] != -100).sum()
        totals += torch.stack([out.loss.double() * n, n.double()])
    all_reduce(totals)
    loss = (totals[0] / totals[1].clamp(min=1)).item()
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 50.0))}


def main(args=None):
    """Train an SFT model; returns the final metrics (eval loss and perplexity)."""
    if args is None or isinstance(args, (list, tuple)):
        args = step1_parser().parse_args(args)
    started = time.time()
    device = setup_run(args)
    tokenizer = load_tokenizer(args.model_name_or_path, add_eot_token=args.add_eot_token)
    ds_config = get_train_ds_config(
        offload=args.offload, dtype=args.dtype, stage=args.zero_stage,
        micro_batch_size=args.per_device_train_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, world_size=get_world_size(),
        enable_tensorboard=args.enable_tensorboard, tb_path=args.tensorboard_path, tb_name="step1_model")
    model = create_hf_model(AutoModelForCausalLM, args.model_name_or_path, tokenizer, ds_config,
                            dropout=args.dropout)
    model = apply_lora(model, args.lora_dim, args.lora_module_name, args.lora_alpha,
                       only_optimize_lora=args.only_optimize_lora)
    train_data, eval_data = load_step_data(args, tokenizer, phase=1)
    from dschat.data import DataCollatorSFT

    train_loader, eval_loader = build_dataloaders(train_data, eval_data, DataCollatorSFT(tokenizer.pad_token_id),
                                                  args.per_device_train_batch_size,
                                                  args.per_device_eval_batch_size, args.seed)
    total_steps = num_update_steps(len(train_loader), args.gradient_accumulation_steps, args.num_train_epochs,
                                   args.max_steps)
    engine = initialize_engine(model, ds_config, args.learning_rate, args.weight_decay,
                               args.lora_learning_rate if args.lora_dim else None, args.offload,
                               args.lr_scheduler_type, args.num_warmup_steps, total_steps,
                               args.gradient_checkpointing)
    print_rank_0(f"[step1] {len(train_data)} train / {len(eval_data)} eval samples, {total_steps} steps, "
                 f"{count_params(model) / 1e6:.2f}M parameters, ZeRO-{args.zero_stage}, {args.dtype}")
    evaluate = lambda: evaluate_lm(engine, eval_loader, device, args.eval_iters)  # noqa: E731
    print_rank_0(f"[step1] before training: {format_metrics(evaluate())}")
    throughput = Throughput(count_params(model), args.gradient_checkpointing)
    writer = tensorboard_writer(args, "step1")
    train_loss = run_training(engine, train_loader, lm_loss, evaluate, args, device, "step1", total_steps,
                              writer, throughput)
    metrics = {**evaluate(), "train_loss": train_loss, **throughput.summary(),
               "steps": total_steps, "seconds": time.time() - started}
    print_rank_0(f"[step1] after training: {format_metrics(metrics)}")
    save_causal_lm(engine.module, tokenizer, args.output_dir)
    write_metrics(args.output_dir, metrics)
    return metrics
