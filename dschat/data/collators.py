"""Batch collators for the three phases (items are unpadded 1-D tensors; padding happens here).

Training batches are right-padded (positions of real tokens start at 0 without position-id fixes);
step-3 prompts are left-padded so every row's generation starts at the same column.

``pad_to_multiple_of`` rounds a batch's padded length up to a multiple of N, so only a few shapes ever reach
the models: on CUDA, SDPA's cuDNN backend builds an execution plan per new shape (0.1-1.7 s each on an H200).
"""
import torch


def check_multiple_of(multiple_of):
    if not isinstance(multiple_of, int) or isinstance(multiple_of, bool) or multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be a positive integer, got {multiple_of!r}")


def padded_length(length, multiple_of=1, max_length=None):
    """``length`` rounded up to a multiple of ``multiple_of`` (a positive int), but not past ``max_length`` (the
    length the data was cut to: position tables and buffers are sized for it) unless ``length`` already is."""
    check_multiple_of(multiple_of)
    rounded = -(-length // multiple_of) * multiple_of
    return rounded if max_length is None else max(length, min(rounded, max_length))


def pad_sequences(sequences, pad_value, side="right", length=None, multiple_of=1, max_length=None):
    """Stack 1-D tensors into (N, L), padding each on ``side`` ("right" or "left") to ``length``
    (default: the longest, rounded up to a multiple of ``multiple_of`` but not past ``max_length``, the length the
    data was cut to: position tables and generation buffers are sized for it)."""
    if side not in ("right", "left"):
        raise ValueError(f"padding side must be 'right' or 'left', got {side!r}")
    if length is None:
        length = padded_length(max((len(seq) for seq in sequences), default=0), multiple_of, max_length)
    out = torch.full((len(sequences), length), pad_value, dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq) > length:
            raise ValueError(f"sequence of length {len(seq)} does not fit in padded length {length}")
        if len(seq):
            if side == "right":
                out[row, :len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            else:
                out[row, length - len(seq):] = torch.as_tensor(seq, dtype=torch.long)
    return out


class RoundedPadding:
    """What every collator does with ``pad_to_multiple_of`` and ``max_length``: pad a batch's rows to the longest,
    rounded up to a multiple of ``pad_to_multiple_of`` but not past ``max_length``. A bad multiple fails when the
    collator is built, not at the first batch."""

    def __init__(self, pad_to_multiple_of=1, max_length=None):
        check_multiple_of(pad_to_multiple_of)
        self.multiple_of = pad_to_multiple_of
        self.max_length = max_length

    def pad(self, sequences, pad_value, side="right"):
        return pad_sequences(sequences, pad_value, side=side, multiple_of=self.multiple_of, max_length=self.max_length)


class DataCollatorSFT(RoundedPadding):
    """Phase 1: right-pads input_ids (pad id), attention_mask (0) and labels (-100) to the batch max (rounded up
    to a multiple of ``pad_to_multiple_of``)."""

    def __init__(self, pad_token_id, pad_to_multiple_of=1, max_length=None):
        super().__init__(pad_to_multiple_of, max_length)
        self.pad_token_id = pad_token_id

    def __call__(self, items):
        return {"input_ids": self.pad([i["input_ids"] for i in items], self.pad_token_id),
                "attention_mask": self.pad([i["attention_mask"] for i in items], 0),
                "labels": self.pad([i["labels"] for i in items], -100)}


class DataCollatorReward(RoundedPadding):
    """Phase 2: (2B, L) input_ids/attention_mask, the B chosen rows first and then the B rejected rows
    (DeepSpeed-Chat's convention: the reward model splits the batch in halves), right-padded together (to a
    multiple of ``pad_to_multiple_of``), and ``margin`` (B,) float32: each pair's margin, which the reward model's
    loss subtracts (TRL's RewardTrainer's; 0.0 for an item without one)."""

    def __init__(self, pad_token_id, pad_to_multiple_of=1, max_length=None):
        super().__init__(pad_to_multiple_of, max_length)
        self.pad_token_id = pad_token_id

    def __call__(self, items):
        ids = [i["chosen_input_ids"] for i in items] + [i["rejected_input_ids"] for i in items]
        masks = [i["chosen_attention_mask"] for i in items] + [i["rejected_attention_mask"] for i in items]
        return {"input_ids": self.pad(ids, self.pad_token_id), "attention_mask": self.pad(masks, 0),
                "margin": torch.tensor([float(i.get("margin", 0.0)) for i in items], dtype=torch.float32)}


class DataCollatorDPO(DataCollatorReward):
    """Phase 2 for DPO: the reward collator's batch plus ``response_mask`` (2B, L), 1 on the answer tokens
    (after each pair's ``prompt_length``, EOT included unless max_seq_len cut the answer) and 0 on the prompt and
    the padding, and ``answer_start`` (int): the batch's first answer column, computed here on the CPU so the
    forward needs no device sync for it. Padding columns (``pad_to_multiple_of``) have attention mask 0, so they
    are never answer tokens."""

    def __call__(self, items):
        batch = super().__call__(items)
        prompt_lengths = torch.tensor([int(i["prompt_length"]) for i in items] * 2)
        answer_ends = torch.tensor([answer_end(i, side) for side in ("chosen", "rejected") for i in items])
        positions = torch.arange(batch["input_ids"].shape[1])[None, :]
        in_answer = (positions >= prompt_lengths[:, None]) & (positions < answer_ends[:, None])
        batch["response_mask"] = in_answer.long() * batch["attention_mask"]
        batch["answer_start"] = first_answer_position(batch["response_mask"])
        return batch


def answer_end(item, side):
    """Where ``side``'s trained answer tokens end: the end of its row, or before the EOT of an answer that
    max_seq_len cut (training that EOT would teach the policy to stop mid-sentence; the reward model keeps it)."""
    end = len(item[f"{side}_input_ids"])
    return end - int(item["eot_length"]) if item.get(f"{side}_truncated") else end


def first_answer_position(response_mask):
    """The earliest column holding an answer token in any row (the sequence length when there is none)."""
    columns = response_mask.bool().any(0).nonzero()
    return int(columns[0]) if len(columns) else response_mask.shape[1]


def check_rlhf_collator_arguments(max_prompt_len, positional, pad_token_id):
    """A TypeError saying how DataCollatorRLHF takes its pad id: DeepSpeed-Chat's call, ``(max_size,
    inference_tp_size)``, said only "takes 2 positional arguments but 3 were given", and one without the id that it
    misses a keyword-only argument (or, given None, padding failed at the first batch)."""
    if positional:
        raise TypeError(f"DataCollatorRLHF({max_prompt_len}, {', '.join(map(repr, positional))}): the pad id is the "
                        "keyword pad_token_id (DataCollatorRLHF(max_prompt_len, pad_token_id=tokenizer.pad_token_id)); "
                        "DeepSpeed-Chat's DataCollatorRLHF(max_size, inference_tp_size) is not taken, as its second "
                        "argument, the tp size, would pad the prompts")
    if pad_token_id is None:
        raise TypeError("DataCollatorRLHF needs pad_token_id=tokenizer.pad_token_id, the id the prompts are "
                        "left-padded with (a tokenizer without a pad token: set tokenizer.pad_token first)")


class DataCollatorRLHF(RoundedPadding):
    """Phase 3: ``prompt``/``prompt_att_mask`` left-padded to the batch's longest prompt, rounded up to a multiple
    of ``pad_to_multiple_of`` but never past ``max_prompt_len`` (no prompt batch is longer than the limit, and
    generation's buffers are sized for it); every other item key (prompt_text, messages, extra columns) is passed
    through as a list, None where an item lacks it. ``pad_token_id`` is a keyword: DeepSpeed-Chat's collator of this
    name takes ``(max_size, inference_tp_size)``, and its call would otherwise pad prompts with the tp size."""

    TENSOR_KEYS = ("prompt_input_ids",)

    def __init__(self, max_prompt_len, *positional, pad_token_id=None, pad_to_multiple_of=1):
        check_rlhf_collator_arguments(max_prompt_len, positional, pad_token_id)
        super().__init__(pad_to_multiple_of, max_length=max_prompt_len)
        self.max_prompt_len = max_prompt_len
        self.pad_token_id = pad_token_id

    def __call__(self, items):
        prompts = [i["prompt_input_ids"] for i in items]
        longest = max(len(p) for p in prompts)
        if self.max_prompt_len is not None and longest > self.max_prompt_len:
            raise ValueError(f"a prompt has {longest} tokens, more than max_prompt_len={self.max_prompt_len}; "
                             "build the dataset with the same max_prompt_len")
        batch = {"prompt": self.pad(prompts, self.pad_token_id, side="left"),
                 "prompt_att_mask": self.pad([torch.ones(len(p), dtype=torch.long) for p in prompts], 0, side="left")}
        keys = dict.fromkeys(key for item in items for key in item if key not in self.TENSOR_KEYS)
        for key in keys:
            batch[key] = [item.get(key) for item in items]
        return batch
