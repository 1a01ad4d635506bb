"""DeepSpeed configs for training and frozen (eval-only) models, with DeepSpeed-Chat's knobs."""

DTYPE_KEYS = {"bf16": "bf16", "fp16": "fp16", "fp32": None}


def _precision_block(dtype, check_grad_overflow=False):
    if dtype not in DTYPE_KEYS:
        raise ValueError(f"--dtype must be one of {sorted(DTYPE_KEYS)}, got {dtype!r}")
    key = DTYPE_KEYS[dtype]
    if key is None:
        return {}
    block = {"enabled": True}
    if key == "fp16":
        block["loss_scale_window"] = 100
    else:  # bf16: DeepSpeed's per-tensor overflow scan only when asked (see --check_grad_overflow)
        block["check_grad_overflow"] = check_grad_overflow
    return {key: block}



def get_train_ds_config(offload=False, dtype="bf16", stage=2, micro_batch_size=1, gradient_accumulation_steps=1,
                        world_size=1, enable_hybrid_engine=False, inference_tp_size=1,
                        release_inference_cache=False, pin_parameters=True, tp_gather_partition_size=8,
                        max_out_tokens=512, enable_cuda_graph=False, enable_tensorboard=False,
                        tb_path="", tb_name="", gradient_clipping=1.0, check_grad_overflow=False):
    """A training config: ZeRO stage, optional CPU offload of optimizer and (stage 3) parameters."""
    device = "cpu" if offload else "none"
    zero = {
        "stage": stage,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 3e7,
        "stage3_prefetch_bucket_size": 3e7,
        "memory_efficient_linear": False,
    }
    return {
        "train_batch_size": micro_batch_size * gradient_accumulation_steps * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "steps_per_print": 10**9,  # dschat prints its own progress
        "zero_optimization": zero,
        **_precision_block(dtype, check_grad_overflow),
        "gradient_clipping": gradient_clipping,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        # dschat's own hybrid engine reads this block; DeepSpeed's is never enabled (see hybrid_engine.config)
        "hybrid_engine": {
            "enabled": enable_hybrid_engine,
            "max_out_tokens": max_out_tokens,
            "inference_tp_size": inference_tp_size,
            "release_inference_cache": release_inference_cache,
            "pin_parameters": pin_parameters,
            "tp_gather_partition_size": tp_gather_partition_size,
            "enable_cuda_graph": enable_cuda_graph,
        },
        "tensorboard": {"enabled": enable_tensorboard, "output_path": f"{tb_path}/ds_tensorboard_logs/",
                        "job_name": f"{tb_name}_tensorboard"},
    }


def frozen_copy_stage(trained_stage, world_size, offload=False):
    """ZeRO stage of a frozen model (reference, reward, EMA copy) beside one trained at ``trained_stage``: sharded (3)
    when its twin is and there are several ranks to shard it over, or when its parameters go to the CPU (a ZeRO-3
    feature); otherwise a plain copy (0). On one rank ZeRO-3 splits nothing, holds the same full copy, and only adds
    its per-module hooks (the reference and reward forwards of an OPT-1.3B/350m PPO iteration left the GPU idle
    0.31 s on them, docs/benchmarks.md)."""
    return 3 if trained_stage == 3 and (world_size > 1 or offload) else 0


def get_eval_ds_config(offload=False, dtype="bf16", stage=0, micro_batch_size=1, world_size=1):
    """A config for frozen models (reference, reward): no optimizer; ZeRO-3 shards them if asked."""
    zero = {"stage": stage, "stage3_param_persistence_threshold": 1e4,
            "offload_param": {"device": "cpu" if offload else "none"}, "memory_efficient_linear": False}
    return {
        "train_batch_size": micro_batch_size * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "steps_per_print": 10**9,
        "zero_optimization": zero,
        **_precision_block(dtype),
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }


# --- a user's DeepSpeed config file (--deepspeed_config / --deepspeed PATH) ---------------------------------------
# Config keys that dschat's own flags set: the file may repeat them (or say "auto"), not contradict them, because the
# data loaders, the model's dtype and the optimizer are built from the flags before DeepSpeed reads the config.
FLAG_OWNED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                   "zero_optimization.stage", "bf16.enabled", "fp16.enabled", "hybrid_engine.enabled")
# Blocks dschat builds itself from flags (it passes DeepSpeed its own optimizer and scheduler).
REFUSED_BLOCKS = {"optimizer": "--learning_rate / --weight_decay (step 3: --actor_learning_rate, ...)",
                  "scheduler": "--lr_scheduler_type / --num_warmup_steps"}


def load_user_ds_config(path):
    """The JSON object in ``path``, with an error naming the file when it is missing or not a JSON object."""
    import json
    import os

    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"DeepSpeed config {path!r} (--deepspeed_config): no such file")
    with open(path, encoding="utf-8") as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"DeepSpeed config {path!r}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"DeepSpeed config {path!r}: expected a JSON object, got {type(config).__name__}")
    return config


def owned_key_flags(micro_batch_flag, stage_flag, hybrid_flag="step 3's --enable_hybrid_engine"):
    """For each of FLAG_OWNED_KEYS, the flag that sets it (named in the error when a file contradicts it)."""
    return {"train_micro_batch_size_per_gpu": micro_batch_flag,
            "gradient_accumulation_steps": "--gradient_accumulation_steps",
            "train_batch_size": f"{micro_batch_flag} x --gradient_accumulation_steps x ranks",
            "zero_optimization.stage": stage_flag, "bf16.enabled": "--dtype", "fp16.enabled": "--dtype",
            "hybrid_engine.enabled": hybrid_flag}


def _lookup(config, dotted):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _flag_value(generated, dotted):
    """What dschat's flags made of a flag-owned key (a precision block it did not write is off)."""
    value = _lookup(generated, dotted)
    return False if value is None and dotted.endswith(".enabled") else value


def _check_flag_owned(generated, user, path, flags):
    for dotted in FLAG_OWNED_KEYS:
        wanted = _lookup(user, dotted)
        if wanted is None or wanted == "auto":
            continue
        have = _flag_value(generated, dotted)
        if wanted != have:
            flag = flags[dotted]
            raise ValueError(f"DeepSpeed config {path!r}: {dotted} = {wanted!r}, but the flags give {have!r}; "
                             f"set it with {flag} (or write \"auto\" in the file)")


def _merge(base, override):
    """``base`` updated from ``override`` recursively; "auto" keeps base's value."""
    merged = dict(base)
    for key, value in override.items():
        if value == "auto":
            continue
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def apply_user_ds_config(generated, path, flags, ignore=()):
    """``generated`` (a config built from dschat's flags) with the user's file ``path`` merged over it: the file
    wins on every key except those in FLAG_OWNED_KEYS, which must agree with the flags (``flags`` maps such a key to
    the flag that sets it, for the error); "auto" keeps dschat's value; top-level blocks in ``ignore`` are not taken
    from the file (e.g. the hybrid engine block for the critic). ``path`` None returns ``generated``."""
    if not path:
        return generated
    user = {key: value for key, value in load_user_ds_config(path).items() if key not in ignore}
    for block, use_instead in REFUSED_BLOCKS.items():
        if block in user:
            raise ValueError(f"DeepSpeed config {path!r}: dschat builds the {block!r} block itself; "
                             f"set it with {use_instead}")
    _check_flag_owned(generated, user, path, flags)
    return _merge(generated, user)


def user_ds_config_path(args):
    """The DeepSpeed config file the command line names: --deepspeed_config PATH, or --deepspeed PATH (the form
    of HF Trainer and of many DeepSpeed-Chat walk-throughs); None when neither names one."""
    from_config = getattr(args, "deepspeed_config", None)
    from_flag = getattr(args, "deepspeed", None)
    from_flag = from_flag if isinstance(from_flag, str) else None
    if from_config and from_flag and from_config != from_flag:
        raise ValueError(f"--deepspeed {from_flag!r} and --deepspeed_config {from_config!r} name different files")
    return from_config or from_flag
