"""Command-line flags of the three steps, with DeepSpeed-Chat's names and meanings.

Defaults point at the embedded tiny default (data ``tiny``, model ``tiny-llama``) so every step runs offline
with no arguments; every flag of DeepSpeed-Chat's step scripts is accepted.
"""
import argparse

SCHEDULERS = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"]


def add_data_args(parser, default_split="2,4,4"):
    g = parser.add_argument_group("data")
    g.add_argument("--data_path", nargs="*", default=["tiny"],
                   help="Dataset names (e.g. Dahoas/rm-static) or local files as TYPE:PATH "
                        "(jsonl:, json:, parquet:, csv:, disk:); several are blended. 'tiny' = embedded data.")
    g.add_argument("--data_split", type=str, default=default_split,
                   help="Shares of each dataset for steps 1,2,3, e.g. 2,4,4 (disjoint).")
    g.add_argument("--sft_only_data_path", nargs="*", default=[], help="Datasets used only in step 1.")
    g.add_argument("--data_output_path", type=str, default="/tmp/dschat_data_files/",
                   help="Where tokenized datasets are cached (shared storage for multi-node).")
    g.add_argument("--data_fields", type=str, default="",
                   help="Field names of local data, e.g. prompt=question,chosen=good,rejected=bad.")
    g.add_argument("--reload_data", action="store_true", help="Rebuild the tokenized data cache.")
    return g


def add_model_args(parser, default_model="tiny-llama"):
    g = parser.add_argument_group("model")
    g.add_argument("--model_name_or_path", type=str, default=default_model,
                   help="Hub name, local folder, or a tiny preset (tiny-llama, tiny-opt, tiny-gpt2, ...).")
    g.add_argument("--num_padding_at_beginning", type=int, default=1,
                   help="Accepted for DeepSpeed-Chat compatibility; dschat finds sequence ends from the "
                        "attention mask, so it has no effect.")
    g.add_argument("--dropout", type=float, default=None, help="Override every dropout of the model config.")
    g.add_argument("--add_eot_token", action="store_true",
                   help="Add <|endoftext|> as the end-of-conversation token when the tokenizer has no EOS.")
    return g


def add_training_args(parser, lr=1e-3, batch=16, max_seq_len=512, eval_batch=16):
    g = parser.add_argument_group("training")
    g.add_argument("--per_device_train_batch_size", type=int, default=batch)
    g.add_argument("--per_device_eval_batch_size", type=int, default=eval_batch)
    g.add_argument("--max_seq_len", type=int, default=max_seq_len)
    g.add_argument("--learning_rate", type=float, default=lr)
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--num_train_epochs", type=int, default=1)
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--lr_scheduler_type", type=str, default="cosine", choices=SCHEDULERS)
    g.add_argument("--num_warmup_steps", type=int, default=0)
    g.add_argument("--output_dir", type=str, default=None, help="Where the trained model is saved.")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--local_rank", type=int, default=-1, help="Set by the deepspeed launcher.")
    g.add_argument("--gradient_checkpointing", action="store_true")
    g.add_argument("--compute_fp32_loss", action="store_true", help="Compute the loss in fp32.")
    g.add_argument("--eval_interval", type=int, default=0, help="Evaluate every N steps (0: at the end only).")
    g.add_argument("--eval_iters", type=int, default=100, help="Max eval batches per evaluation.")
    g.add_argument("--print_loss", action="store_true", help="Print the loss of every step.")
    g.add_argument("--max_steps", type=int, default=0, help="Stop after N optimizer steps (0: no limit).")
    return g


def add_deepspeed_args(parser):
    g = parser.add_argument_group("deepspeed")
    g.add_argument("--offload", action="store_true", help="Offload optimizer (and ZeRO-3 parameters) to CPU.")
    g.add_argument("--dtype", type=str, default="bf16", choices=["bf16", "fp16", "fp32"])
    g.add_argument("--zero_stage", type=int, default=0, choices=[0, 1, 2, 3])
    g.add_argument("--enable_tensorboard", action="store_true")
    g.add_argument("--tensorboard_path", type=str, default=None)
    import deepspeed

    deepspeed.add_config_arguments(parser)
    return g


def add_lora_args(parser, prefix=""):
    g = parser.add_argument_group(f"{prefix}lora")
    g.add_argument(f"--{prefix}lora_dim", type=int, default=0, help="LoRA rank (0: no LoRA).")
    if not prefix:
        g.add_argument("--lora_module_name", type=str, default="",
                       help="Adapt Linear modules whose path contains this (empty: all but output heads).")
        g.add_argument("--lora_alpha", type=float, default=None, help="LoRA alpha (default: = lora_dim).")
        g.add_argument("--only_optimize_lora", action="store_true", help="Freeze the base weights.")
    g.add_argument(f"--{prefix}lora_learning_rate", type=float, default=5e-4)
    return g


def step1_parser():
    p = argparse.ArgumentParser(description="Step 1: supervised fine-tuning of a causal LM.")
    add_data_args(p)
    add_model_args(p)
    add_training_args(p, lr=1e-3, batch=16, max_seq_len=512)
    add_deepspeed_args(p)
    add_lora_args(p)
    p.add_argument("--include_prompt_in_loss", action="store_true",
                   help="Train on prompt tokens too (DeepSpeed-Chat did); default: answer tokens only.")
    p.set_defaults(tensorboard_path="step1_tensorboard", output_dir="output/step1_sft")
    return p


def step2_parser():
    p = argparse.ArgumentParser(description="Step 2: reward-model training on preference pairs.")
    add_data_args(p)
    add_model_args(p)
    add_training_args(p, lr=5e-5, batch=16, max_seq_len=512)
    add_deepspeed_args(p)
    add_lora_args(p)
    p.set_defaults(tensorboard_path="step2_tensorboard", output_dir="output/step2_rm")
    return p


def namespace_with_defaults(parser, overrides=None):
    """A parsed namespace with every default, updated from a dict/object (the notebook-friendly form)."""
    args = parser.parse_args([])
    if overrides is None:
        return args
    items = overrides.items() if isinstance(overrides, dict) else vars(overrides).items()
    for key, value in items:
        setattr(args, key, value)
    return args
