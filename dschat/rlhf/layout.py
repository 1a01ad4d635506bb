"""Step 3's forwards over rows shifted to start at column 0, so that they need no attention mask.

Experience sequences are left-padded prompts followed by answers (right-padded after their end). Run as they are, every
forward needs a padding mask, and with one PyTorch's SDPA runs masked attention kernels: on an H200 cuDNN's masked
forward + backward took 2.8 ms against 1.7 ms causal per layer call at 64 x 512 (``bench/sdpa_first_call.py``,
docs/benchmarks.md), and a new mask pattern or length costs a new execution plan. Shifted left by its number of
leading pads, each row is one run of real tokens followed by padding; in a causal model no real token attends to a
later position, so the real tokens' outputs are exactly those of the masked forward, with no padding mask (plain
causal attention; a model with a sliding window still builds its window's mask) and positions 0, 1, ... . Rows are
cut to the longest one, rounded up to ``--pad_to_multiple_of`` (few shapes) but never past a length at which a model's
positions would behave differently (its position table, the length its RoPE scaling switches at:
``models.positions.position_limit``). Per-token outputs are mapped back to the original columns (cheap), and the LM
head runs on each row's answer positions only (:func:`head_reads`).

A row with a masked token between real ones cannot be shifted this way; for such a batch :meth:`LeftAligned.of` returns
None and the forwards keep the mask. Step 3 never makes one (a pad token sampled inside an answer is a real token:
``trainer.answer_mask``), but a caller's prompt mask may have holes.
"""
import contextlib
import dataclasses
import logging

import torch

from dschat.data.collators import padded_length


@dataclasses.dataclass
class LeftAligned:
    """How one batch's rows are shifted: ``aligned[:, j] = original[:, index[:, j]]``, cut to ``width`` columns (the
    longest row, rounded up within the models' position limits: see :meth:`of`)."""

    index: torch.Tensor  # (B, width)
    inverse: torch.Tensor  # (B, L): original[:, p] = aligned[:, inverse[:, p]]; width and over: padding
    lead: torch.Tensor  # (B,) leading pads of each row
    max_lead: int
    width: int  # columns kept: the longest row's real tokens, rounded up
    mask: torch.Tensor  # (B, width) the shifted attention mask: ones, then zeros

    @classmethod
    def of(cls, attention_mask, multiple_of=1, position_limit=None):
        """The shift for ``attention_mask`` (B, L), or None if some row has a gap between real tokens.

        The width (the longest row) is rounded up to a multiple of ``multiple_of`` (``--pad_to_multiple_of``: few
        shapes, so few cuDNN plans) but not past L nor past ``position_limit`` (the models' position tables and the
        lengths their RoPE scaling switches at, ``models.positions.position_limit``), so rounding moves no real
        token's result."""
        length = attention_mask.shape[1]
        columns = torch.arange(length, device=attention_mask.device)
        lead = (attention_mask.long().cumsum(1) == 0).sum(1)
        index = (columns + lead[:, None]) % length
        mask = attention_mask.long().gather(1, index)
        prefix = (mask[:, 1:] <= mask[:, :-1]).all()
        prefix, max_lead, width = torch.stack([prefix.long(), lead.max(), mask.sum(1).max()]).tolist()  # one sync
        if not prefix or width == 0:
            return None
        width = padded_length(width, multiple_of, min(length, position_limit or length))
        inverse = (columns - lead[:, None]) % length
        return cls(index[:, :width], inverse, lead, max_lead, width, mask[:, :width])

    def align(self, tensor):
        """(B, L) in the original columns -> shifted, (B, width)."""
        return tensor.gather(1, self.index)

    def restore(self, tensor):
        """(B, width) shifted -> the original columns, (B, L); padding columns hold zeros or values of other padding."""
        padded = torch.nn.functional.pad(tensor, (0, self.inverse.shape[1] - tensor.shape[1]))
        return padded.gather(1, self.inverse)

    def model_inputs(self, seq):
        """Keyword arguments of a forward over the shifted rows: no mask (causal attention) and the models' default
        positions 0, 1, ... (passing them would make transformers look for packed sequences, a host sync)."""
        return {"input_ids": self.align(seq), "attention_mask": None}

    def forward(self, fn, seq, **kwargs):
        """``fn(**model_inputs(seq), **kwargs)``: a model's forward (or ``forward_value``) over the shifted rows."""
        with quiet_padding_warning():
            return fn(**self.model_inputs(seq), **kwargs)

    def answer_window(self, start):
        """How many of the shifted rows' last columns hold every row's answer predictions: the logits at a row's
        original column ``start`` (which predict its first answer token) are at ``start - lead`` after the shift."""
        return self.width - (start - self.max_lead)

    def answer_columns(self, start, count):
        """(B, count) indices into the window of :meth:`answer_window` of the positions predicting the original
        columns ``start + 1``, ``start + 2``, ...; a row's columns past its own end (padding) are clamped into the
        window."""
        steps = torch.arange(count, device=self.lead.device)
        window = self.answer_window(start)
        return (steps + (self.max_lead - self.lead)[:, None]).clamp(max=window - 1)


def forward_layout(attention_mask, start, multiple_of=1, position_limit=None, padded=False):
    """How step 3 runs a batch's forwards (experience, training, held-out scores): over rows shifted left
    (:class:`LeftAligned`), or as they are (None) with ``padded`` (``--padded_forwards``), for a row with a gap (a
    prompt mask with a hole) or an empty prompt (a lead past ``start``, the last prompt column)."""
    if padded:
        return None
    layout = LeftAligned.of(attention_mask, multiple_of, position_limit)
    return layout if layout is not None and layout.max_lead <= start else None


def reward_scores(scorer, seq, attention_mask, layout=None):
    """(B,) a reward model's (``RewardModel``) score of each row at its scored token (its last real one): one
    ``forward_value`` over the rows as they are (``layout`` None) or shifted (a ``LeftAligned``, whose scored token is
    found in the shifted columns)."""
    if layout is None:
        return scorer.forward_value(seq, attention_mask)["chosen_end_scores"]
    values = layout.forward(scorer.forward_value, seq, return_value_only=True)
    return values.gather(1, scorer.score_index(layout.align(seq), layout.mask)[:, None]).squeeze(1)


class _PaddingWarningFilter(logging.Filter):
    def filter(self, record):
        return "strongly recommend passing in an `attention_mask`" not in record.getMessage()


@contextlib.contextmanager
def quiet_padding_warning():
    """Around a forward over shifted rows: GPT-2's forward warns when its input has padding and no mask ("We strongly
    recommend passing in an `attention_mask`"), but the shifted rows' padding follows every real token, which no real
    token attends to. Other forwards of the process keep the warning."""
    logger, hush = logging.getLogger("transformers.modeling_utils"), _PaddingWarningFilter()
    logger.addFilter(hush)
    try:
        yield
    finally:
        logger.removeFilter(hush)


@contextlib.contextmanager
def head_reads(model, columns, window):
    """Inside: the LM head of ``model`` (an HF model) runs only on the hidden states at ``columns`` (B, count) of the
    rows' last ``window`` positions (what ``logits_to_keep`` gives it, or all positions where the model has no such
    argument), so each row's answer logits come out in the answer's own columns and no others are computed."""
    calls = []

    def gather_rows(module, args):
        calls.append(1)
        hidden = args[0]
        index = columns + (hidden.shape[1] - window)
        return (hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1])), *args[1:])

    head = model.get_output_embeddings()
    if head is None:
        raise RuntimeError(f"{type(model).__name__} has no output embeddings module; run step 3 with "
                           "--padded_forwards")
    handle = head.register_forward_pre_hook(gather_rows)
    try:
        yield
    finally:
        handle.remove()
    if len(calls) != 1:  # the logits would not be the answers' (a model that computes them another way)
        raise RuntimeError(f"{type(model).__name__}'s LM head ran {len(calls)} times in one forward; run step 3 with "
                           "--padded_forwards")
