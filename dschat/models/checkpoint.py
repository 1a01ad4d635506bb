"""Saving trained models as folders ``from_pretrained`` loads, atomically, from any ZeRO stage."""
import json
import os
import re
import shutil
from contextlib import contextmanager, suppress

from dschat.errors import UsageError
from dschat.models.loading import TOKENIZER_EXTRA_FILES, TOKENIZER_FILES, is_weights_file
from dschat.models.lora import check_lora_mergeable, head_trains_untied, merge_lora_state_dict, unwrap_peft
from dschat.models.reward_model import REWARD_META_FILE, VALUE_HEAD_FILE, RewardModel
from dschat.run_layout import save_moving_path, save_staging_prefix, save_swap_paths
from dschat.models.zero3 import is_zero3_param
from dschat.utils.dist import barrier, is_rank_0, print_rank_0
from dschat.utils.files import (give_plain_modes, read_json_object, temp_folder, write_json_atomic,
                                writes_said_on_a_full_disk)


def gathered_state_dict(module):
    """The full state dict on rank 0 (None elsewhere), on CPU; every rank must call it under ZeRO-3 (an engine's
    model after :func:`settled_module`). A tied weight
    (e.g. ``lm_head.weight`` sharing the embedding) appears once, under the name ``named_parameters`` gives it:
    ``from_pretrained`` ties it again, and under ZeRO-3 its other name would only hold this rank's empty shard."""
    import deepspeed

    scale_back_inference_rescaling(module)
    state, parameter_ids = {}, set()
    for name, param in module.named_parameters():
        parameter_ids.add(id(param))
        if is_zero3_param(param):
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if is_rank_0():
                    state[name] = param.detach().cpu().clone()
        elif is_rank_0():
            state[name] = param.detach().cpu().clone()
    if not is_rank_0():
        return None
    for name, tensor in module.state_dict(keep_vars=True).items():  # persistent buffers (parameters are already in)
        if name not in state and id(tensor) not in parameter_ids:
            state[name] = tensor.detach().cpu().clone()
    return state


def scale_back_inference_rescaling(module):
    """Weights as trained, where transformers' RWKV (``rescale_every``) holds some divided: a forward in eval mode
    divides them in place by powers of 2 (fp16 inference's scaling, undone only at the next training forward), and a
    step's last forwards are its final evaluation (step 3's: its held-out generations), before the save, which took
    them so. Scaled back as a training forward does (exactly); the next forward in eval mode divides them again.
    Weights quantized by bitsandbytes are refused (``check_rescaled_weights_not_quantized``)."""
    for layers in module.modules():
        if getattr(layers, "layers_are_rescaled", False) and hasattr(layers, "_rescale_layers"):
            check_rescaled_weights_not_quantized(layers)
            training = layers.training
            layers.training = True  # (``_rescale_layers`` scales towards its module's mode)
            layers._rescale_layers()
            layers.training = training


def check_rescaled_weights_not_quantized(layers):
    """RWKV's eval-mode rescaling of weights quantized by bitsandbytes (int8: their scales ``SCB`` divided; 4-bit:
    dequantized, divided, quantized again) has no inverse in transformers: its training-mode scale-back multiplies
    the quantized values themselves (int8 overflows, packed 4-bit values turn to others), so a save would write
    damaged weights. Refused, naming the way out, before anything is written."""
    quantized = [name for name, weight in _rescaled_weights(layers)
                 if hasattr(weight, "SCB") or hasattr(weight, "quant_state")]
    if quantized:
        raise UsageError(f"{type(layers).__name__}: {quantized[0]} is quantized (bitsandbytes) and an eval-mode "
                         f"forward divided it for inference (rescale_every={layers.config.rescale_every}), which "
                         "transformers cannot undo on quantized weights: saving would write them damaged. Save before "
                         "evaluating, or set the model's config.rescale_every = 0 before its first forward (the same "
                         "outputs up to LayerNorm's epsilon, nothing rescaled)")


def _rescaled_weights(layers):
    """(name, weight) of what RWKV's ``_rescale_layers`` scales: each block's attention output and feed-forward
    value weights."""
    for index, block in enumerate(layers.blocks):
        yield f"blocks.{index}.attention.output.weight", block.attention.output.weight
        yield f"blocks.{index}.feed_forward.value.weight", block.feed_forward.value.weight


def plain_model_state_dict(module):
    """State dict of the unwrapped HF model: LoRA merged (fp32, rounded once), PEFT prefixes removed."""
    check_lora_mergeable(module)  # on every rank: none may raise alone after the collective gather
    state = gathered_state_dict(module)
    return None if state is None else merge_lora_state_dict(state, module)


@contextmanager
def atomic_folder(output_dir):
    """Write into a temporary folder (:func:`staging_parent`), then move it in (:func:`install_folder`), so a crash
    never leaves a half-written model. A save killed before it moved its folder in left that folder: it goes."""
    parent = os.path.dirname(os.path.abspath(output_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    finish_interrupted_save(output_dir)
    prefix = save_staging_prefix(output_dir)
    staging = staging_parent(output_dir)
    for folder in dict.fromkeys((parent, staging)):  # (an earlier save's may be in either)
        _remove_leftovers(folder, prefix)
    tmp = temp_folder(staging, prefix)
    try:
        with writes_said_on_a_full_disk(output_dir):
            yield tmp
        give_plain_modes(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    install_folder(tmp, output_dir)


def staging_parent(output_dir):
    """Where a save writes its temporary folder: in an existing ``output_dir`` itself, whose files it replaces one
    rename at a time (``install_folder``), else beside it. A rename cannot cross filesystems: staged beside an output
    folder that is a mount point (a container's volume, a network share) or a link to another disk, the finished
    save failed to move in ("Invalid cross-device link") and left the model in the temporary folder, which the next
    save removed."""
    return output_dir if os.path.isdir(output_dir) else os.path.dirname(os.path.abspath(output_dir)) or "."


def _remove_leftovers(parent, prefix):
    for name in sorted(os.listdir(parent)):
        if name.startswith(prefix) and os.path.isdir(os.path.join(parent, name)):
            print_rank_0(f"removing {os.path.join(parent, name)}: an interrupted save's unfinished copy")
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


# The files a model save writes besides transformers' weights and their index (``is_weights_file``): configs, PEFT's
# adapter, the reward model's head and note, tokenizer files (HF's names; its folder of named chat templates too). An
# earlier save's that the new one does not write go: weights of other shard counts (.bin against .safetensors) that
# transformers could load instead, or an earlier tokenizer's chat templates, which would change the format of every
# prompt the folder's tokenizer renders. Only these names: a user's own files in the folder (my_notes.bin) stay.
SAVE_FILES = ("config.json", "generation_config.json", "adapter_config.json", "adapter_model.safetensors",
              "adapter_model.bin", VALUE_HEAD_FILE, REWARD_META_FILE, *TOKENIZER_FILES, *TOKENIZER_EXTRA_FILES)


def is_save_file(name):
    return is_weights_file(name) or name in SAVE_FILES


def install_folder(new, target):
    """Move the files of ``new`` into ``target``. A new target is one atomic rename. An existing one keeps every file
    that is no model save's (the step's log, TensorBoard events, its checkpoints, a user's notes: DeepSpeed-Chat's
    scripts log into the output folder) and loses the earlier save's files (``is_save_file``) the new one does not
    write. Where it can, the folders are swapped (``_swap_in``), so a kill at any point leaves the earlier or the new
    model whole; else (``_swappable``) each new file goes in by an atomic rename (``finish_interrupted_move``)."""
    if not os.path.exists(target):
        os.replace(new, target)
        return
    real = os.path.realpath(target)
    if _swappable(real) and _moved_beside(new, real):
        finish_interrupted_swap(real)
        return
    # (staged in ``target``: on its file system) the names it holds, then one rename that marks it whole, to move in
    write_json_atomic(os.path.join(new, MOVED_FILES), {"files": sorted(os.listdir(new))})
    os.rename(new, save_moving_path(real))
    finish_interrupted_move(real)


# The file in a save's copy that is being moved into its folder one by one (``save_moving_path``): the names it held.
MOVED_FILES = ".dschat-moved-files.json"


def finish_interrupted_move(folder):
    """Move the finished save in ``folder`` (``save_moving_path``) into it file by file, or finish that where a kill
    stopped it: the folder mixed the new save's files with the earlier one's (shards of two models, a new config over
    old weights) until then. Every step is a rename or a removal, redone from where it stopped; the earlier save's files
    the new one did not write go after the new ones are in (a kill never leaves the folder without weights). A copy
    without its record of the names (``MOVED_FILES``) was killed while it was removed, those files gone already."""
    moving = save_moving_path(folder)
    if not os.path.isdir(moving):
        return
    record = read_json_object(os.path.join(moving, MOVED_FILES))
    for name in sorted(os.listdir(moving)):
        if name != MOVED_FILES:
            _move_in(os.path.join(moving, name), os.path.join(folder, name))
    if record is not None:  # (read as no names written, every model file of the folder went: the new save's too)
        _remove_earlier_save_files(folder, set(record.get("files", ())))
    shutil.rmtree(moving)


def _remove_earlier_save_files(folder, written):
    """The model files of ``folder`` (``is_save_file``) that are not among the names a save ``written``."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name not in written and is_save_file(name):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def _move_in(source, destination):
    """``source`` in place of ``destination`` by a rename; a folder (a tokenizer's chat templates) replaces the one
    there, which goes first (a rename cannot replace a folder that holds files)."""
    if os.path.isdir(source) and os.path.isdir(destination) and not os.path.islink(destination):
        shutil.rmtree(destination)
    os.replace(source, destination)


def _swappable(folder):
    """Whether ``folder`` can be replaced by a rename: not a mount point, holding none (a rename cannot move one),
    and not this process's working directory or above it (its relative paths would then read the replaced folder)."""
    try:
        cwd = os.getcwd()
    except OSError:  # (a working directory removed since)
        cwd = ""
    if cwd == folder or cwd.startswith(folder.rstrip(os.sep) + os.sep) or os.path.ismount(folder):
        return False
    return not any(entry.is_dir(follow_symlinks=False) and os.path.ismount(entry.path)
                   for entry in os.scandir(folder))


def _moved_beside(new, folder):
    """Move the finished save ``new`` (staged in ``folder``, so on its file system) beside ``folder`` as the swap's
    new copy (``save_swap_paths``), with ``folder``'s mode and group (a shared project's setgid folder stays one).
    False where it cannot go there (a parent this user cannot write in)."""
    import stat

    ready = save_swap_paths(folder)[0]
    try:
        os.rename(new, ready)
    except OSError:
        return False
    status = os.stat(folder)
    with suppress(OSError):
        os.chown(ready, -1, status.st_gid)
    with suppress(OSError):
        os.chmod(ready, stat.S_IMODE(status.st_mode))
    return True


def finish_interrupted_swap(folder):
    """Swap the finished save beside ``folder`` (``save_swap_paths``) in for it, or finish a swap a kill stopped: every
    step is a rename, and redone from where it stopped, so the path holds the earlier model or the new one, each whole
    (or, between the two renames, neither: the next run or save there moves the new one in). Files that are no
    model's go with the folder (they are moved into the new copy first, and any left are moved back after)."""
    ready, old = save_swap_paths(folder)
    if os.path.isdir(ready):
        if os.path.lexists(folder):
            _move_kept_files(folder, ready)
            os.rename(folder, old)
        os.rename(ready, folder)
    if os.path.isdir(old):
        _move_kept_files(old, folder)
        shutil.rmtree(old)


def finish_interrupted_save(model_path):
    """Finish the swap (``finish_interrupted_swap``) or the move file by file (``finish_interrupted_move``) a save of
    ``model_path`` was killed in, if one was, saying so: what the loaders' refusal of such a folder
    (``run_layout.interrupted_save_message``) tells the user to call."""
    folder = os.path.realpath(model_path)
    if any(os.path.isdir(path) for path in save_swap_paths(folder)):
        print_rank_0(f"{model_path}: finishing a save interrupted while it replaced the folder")
        finish_interrupted_swap(folder)
    if os.path.isdir(save_moving_path(folder)):
        print_rank_0(f"{model_path}: finishing a save interrupted while it moved its files into the folder")
        finish_interrupted_move(folder)


recover_interrupted_swap = finish_interrupted_save  # (its earlier name, which said only the swap)


def recover_interrupted_saves(output_dir):
    """``finish_interrupted_save`` for ``output_dir`` and for each model folder in it (step 3's actor, critic)."""
    finish_interrupted_save(output_dir)
    folder = os.path.realpath(output_dir)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if swapped := re.fullmatch(r"\.(.+)\.save-(?:new|old)", name):
            finish_interrupted_save(os.path.join(folder, swapped[1]))
        elif os.path.isdir(save_moving_path(os.path.join(folder, name))):
            finish_interrupted_save(os.path.join(folder, name))


def _move_kept_files(source, destination):
    """Move each entry of ``source`` that is no model save's into ``destination`` (one of the same name there is the
    new save's)."""
    for name in sorted(os.listdir(source)):
        if not is_save_file(name) and not os.path.lexists(os.path.join(destination, name)):
            os.rename(os.path.join(source, name), os.path.join(destination, name))


def settled_module(model):
    """The model of a DeepSpeed engine or a hybrid engine (DeepSpeed-Chat's ``save_hf_format`` is given the engine,
    ``rlhf_engine.actor``); any other model as it is. Saved as the engine, its parameters' names would start with
    "module." and no model would load from them.

    An engine under ZeRO-3 first releases its parameters (DeepSpeed's ``empty_partition_cache``): a no-grad forward
    (the last evaluation) can leave some prefetched, in flight, for a forward that never comes, and gathering them
    then fails ("Cannot partition a param in flight"; on a GPU, where the prefetches are asynchronous)."""
    from deepspeed import DeepSpeedEngine

    from dschat.hybrid_engine import HybridEngine

    if not isinstance(model, (DeepSpeedEngine, HybridEngine)):
        return model
    if model.zero_optimization_stage() == 3:
        model.empty_partition_cache()
    return model.module


# A model's attribute naming the dtype ``save_causal_lm`` saves it in by default: the EMA copy's, averaged in fp32 and
# saved as its actor is (``DeepSpeedRLHFEngine`` sets it), from a notebook as from step 3
SAVED_DTYPE_ATTRIBUTE = "dschat_saved_dtype"


def save_causal_lm(module, tokenizer, output_dir, dtype=None):
    """Save an actor / SFT model (any ZeRO stage, LoRA merged; or its engine's) with its tokenizer. Collective (a
    gather under ZeRO-3, a barrier at any stage). ``dtype``: save in it rather than the weights' own; by default the
    model's ``SAVED_DTYPE_ATTRIBUTE`` (the fp32 EMA copy is saved as the actor is), else the weights' own."""
    module = settled_module(module)
    if dtype is None:
        dtype = getattr(module, SAVED_DTYPE_ATTRIBUTE, None)
    check_save_arguments(module, tokenizer, output_dir, reward=False)
    state = plain_model_state_dict(module)
    if is_rank_0():
        model = unwrap_peft(module)
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        with atomic_folder(output_dir) as tmp, _untied_config_if(model, head_trains_untied(module)):
            _save_pretrained(model, state, tmp)
            if dtype is not None:
                _say_saved_dtype(tmp, dtype)
            _save_tokenizer(tokenizer, tmp)
    barrier()


def check_save_arguments(model, tokenizer, output_dir, reward):
    """``save_causal_lm``'s (``reward`` False) or ``save_reward_model``'s arguments, checked on every rank before the
    gather: a wrong one failed on rank 0 alone, after it, so on several ranks the others waited at the save's barrier
    while rank 0 lived on (a notebook's kernel) or failed with gloo's "Connection closed by peer" once it ended; and
    its error named no argument ("'RewardModel' object has no attribute 'get_output_embeddings'")."""
    name = "save_reward_model" if reward else "save_causal_lm"
    if reward != isinstance(model, RewardModel):
        raise UsageError(f"{name}: the model is a {type(model).__name__}, "
                         + ("not a reward model or critic (a RewardModel): save a causal LM (the actor, its EMA copy) "
                            "with save_causal_lm" if reward else
                            "a reward model or critic: save it with save_reward_model"))
    if not hasattr(tokenizer, "save_pretrained"):
        raise UsageError(f"{name}(model, tokenizer, output_dir): the tokenizer is a {type(tokenizer).__name__}, "
                         "not a tokenizer; give the model's (it is saved beside the weights)")
    if not isinstance(output_dir, (str, os.PathLike)):
        raise UsageError(f"{name}(model, tokenizer, output_dir): output_dir is a {type(output_dir).__name__}, not "
                         "a folder's path (DeepSpeed-Chat's save_hf_format(model, tokenizer, args, sub_folder) is "
                         f"{name}(model, tokenizer, os.path.join(args.output_dir, sub_folder)))")


def _save_tokenizer(tokenizer, folder):
    from dschat.models.loading import saved_as_loaded

    with saved_as_loaded(tokenizer):
        tokenizer.save_pretrained(folder)


def save_reward_model(reward_model, tokenizer, output_dir):
    """Save a reward model / critic (or its engine's): backbone as an HF folder plus the value head. Collective (a
    gather under ZeRO-3, a barrier at any stage)."""
    reward_model = settled_module(reward_model)
    check_save_arguments(reward_model, tokenizer, output_dir, reward=True)
    backbone = reward_model.rwtransformer
    check_lora_mergeable(backbone)  # on every rank: none may raise alone after the collective gather
    state = gathered_state_dict(reward_model)
    if is_rank_0():
        backbone_state = {k[len("rwtransformer."):]: v for k, v in state.items() if k.startswith("rwtransformer.")}
        backbone_state = merge_lora_state_dict(backbone_state, backbone)
        with atomic_folder(output_dir) as tmp:
            _save_pretrained(unwrap_peft(backbone), backbone_state, tmp)
            reward_model.save_head_and_meta(tmp, state)
            _save_tokenizer(tokenizer, tmp)
    barrier()


def _say_saved_dtype(folder, dtype):
    """The saved config names the dtype the weights were saved in (``save_pretrained`` writes the model's own)."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["dtype"] = str(dtype).removeprefix("torch.")
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


@contextmanager
def _untied_config_if(model, untie):
    """Save a trained head apart from the embeddings it was tied to (see ``head_trains_untied``)."""
    if not untie:
        yield
        return
    model.config.tie_word_embeddings = False
    try:
        yield
    finally:
        model.config.tie_word_embeddings = True


def _save_pretrained(model, state, folder):
    """``save_pretrained`` with an explicit (gathered, merged) state dict, in the weights' training dtype."""
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    model.save_pretrained(folder, state_dict={k: v.contiguous() for k, v in state.items()},
                          safe_serialization=True)
