"""The bundled tokenizer and the tiny model presets, loaded back through the real from_pretrained path."""
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dschat.tiny import EVAL_FILE
from dschat.tiny.presets import MARKER_FILE, TINY_PRESETS, create_tiny_model, is_tiny_preset



def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.bos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<pad>" and tokenizer.unk_token == "<unk>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert None not in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id,
                        tokenizer.unk_token_id)
    assert tokenizer.padding_side == "right"
    assert not tokenizer.chat_template
    assert 900 <= len(tokenizer) <= 2000


def test_tokenizer_round_trips_text(tokenizer):
    with open(EVAL_FILE, encoding="utf-8") as f:
        records = [json.loads(line) for line in f][:50]
    texts = [f"\n\nHuman: {r['prompt']}\n\nAssistant: {r['chosen']}<|endoftext|>" for r in records]
    texts += ["Unseen words, Ünïcödé and 12345 digits!", "  odd   spacing\tand\nlines  "]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
    # The conversation markers and the special tokens are single tokens; nothing is added on encode.
    assert tokenizer("<|endoftext|>")["input_ids"] == [tokenizer.eos_token_id]
    assert tokenizer("<pad>")["input_ids"] == [tokenizer.pad_token_id]


def test_data_fits_the_short_lengths_cpu_training_assumes(tokenizer):
    with open(EVAL_FILE, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    for r in records:
        assert len(tokenizer(f"\n\nHuman: {r['prompt']}\n\nAssistant:")["input_ids"]) <= 32
        for answer in (r["chosen"], r["rejected"]):
            assert len(tokenizer(" " + answer)["input_ids"]) <= 24


@pytest.mark.parametrize("name", ["tiny-llama", "dschat/tiny-opt", "tiny-gpt2", "tiny-qwen2", "tiny-mistral",
                                  "dschat/tiny-llama"])
def test_preset_names(name):
    assert is_tiny_preset(name)


@pytest.mark.parametrize("name", ["llama", "tiny", "facebook/opt-125m", "other/tiny-llama", "tiny-llama2", None])
def test_non_preset_names(name):
    assert not is_tiny_preset(name)


@pytest.mark.parametrize("name", sorted(TINY_PRESETS))
def test_preset_builds_saves_and_loads_back(name, tmp_path, tokenizer):
    folder = create_tiny_model(f"dschat/{name}", tmp_path / name)
    config = AutoConfig.from_pretrained(folder)
    assert config.vocab_size == len(tokenizer)
    assert (config.pad_token_id, config.eos_token_id, config.bos_token_id) == (
        tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id)
    assert getattr(config, "max_position_embeddings", getattr(config, "n_positions", 0)) >= 256
    assert (tmp_path / name / "model.safetensors").is_file()

    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    loaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = ["\n\nHuman: What is 3 plus 4?\n\nAssistant:", "\n\nHuman: List two colors.\n\nAssistant: red, blue"]
    # Every architecture's folder must tokenize exactly like the bundled tokenizer (qwen2 folders load as
    # Qwen2Tokenizer, which rebuilds the pre-tokenizer).
    for text in texts:
        assert loaded_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    batch = loaded_tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (*batch["input_ids"].shape, len(tokenizer))
    assert torch.isfinite(logits).all()


def test_create_is_idempotent_and_deterministic(tmp_path):
    folder = create_tiny_model("tiny-llama", tmp_path / "a")
    weights = tmp_path / "a" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert create_tiny_model("dschat/tiny-llama", tmp_path / "a") == folder
    assert weights.stat().st_mtime_ns == stamp  # not rebuilt
    create_tiny_model("tiny-llama", tmp_path / "b")
    assert weights.read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    # A folder holding another preset is rebuilt.
    (tmp_path / "a" / MARKER_FILE).write_text(json.dumps({"preset": "tiny-opt"}))
    create_tiny_model("tiny-llama", tmp_path / "a")
    assert json.loads((tmp_path / "a" / MARKER_FILE).read_text())["preset"] == "tiny-llama"


def test_seed_changes_weights(tmp_path):
    create_tiny_model("tiny-gpt2", tmp_path / "a", seed=1)
    create_tiny_model("tiny-gpt2", tmp_path / "b", seed=2)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "b" / "model.safetensors").read_bytes()


def test_tiny_llama_uses_grouped_query_attention():
    config = TINY_PRESETS["tiny-llama"]()
    assert config.num_key_value_heads < config.num_attention_heads


def test_unknown_preset_is_rejected(tmp_path):
    with pytest.raises(ValueError):
        create_tiny_model("tiny-bert", tmp_path)


def test_a_preset_built_on_a_rank_other_than_0_is_complete(tmp_path, monkeypatch):
    # transformers 5 skips writing on torch.distributed ranks other than 0; the rank that builds a preset (whichever
    # takes the cache lock) must still write it, or the other ranks load an empty folder.
    import transformers.distributed.mixin as mixin

    monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
    monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    folder = create_tiny_model("tiny-llama", tmp_path / "rank1")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.model_type == "llama"
