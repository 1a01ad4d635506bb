"""Step 3's generation and hybrid-engine flags: what each combination does, and the combinations that are errors
named by their flag before any data or model loads (``check_step3_settings``), not tracebacks after."""
import shlex
from types import SimpleNamespace

import pytest
import torch

from dschat.args import check_sampling_flags, step3_parser
from dschat.errors import UsageError
from dschat.rlhf.config import step3_args
from dschat.rlhf.engine import DeepSpeedRLHFEngine, check_step3_settings, step3_train_config
from dschat.rlhf.trainer import DeepSpeedPPOTrainer, sampling_kwargs
from launch import WRITE_SEEN_AND_END


# --- --top_k: 0 or negative is no top-k filtering, on both generation paths -----------------------------------------

def _tiny_policy(vocab=64):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    # a checkpoint's own sampling settings: "off" must not fall back to them (nor to HF's default top_k of 50)
    model.generation_config.top_k = 1
    return model


@pytest.mark.parametrize("top_k", [-1, 0])
def test_non_positive_top_k_is_no_filtering_for_the_hybrid_engine_and_hf_generate(top_k):
    args = step3_args({"top_k": top_k})
    assert sampling_kwargs(args)["top_k"] == 0  # the hybrid engine: None would take the generation_config's
    assert sampling_kwargs(args, hf_generate=True)["top_k"] == 0  # HF reads 0 as off and refuses a negative top_k
    assert sampling_kwargs(step3_args({"top_k": 5}))["top_k"] == 5
    greedy = sampling_kwargs(step3_args({"top_k": top_k, "greedy": True}), hf_generate=True)
    assert greedy == {"do_sample": False, "temperature": None, "top_k": None, "top_p": None, "repetition_penalty": 1.0}

    # the trainer's HF-generate path (no hybrid engine), as step 3 runs it
    model = _tiny_policy()
    trainer = SimpleNamespace(args=args, hybrid=False, actor_model=SimpleNamespace(module=model), eos_token_id=1,
                              pad_token_id=0, z3_enabled=False, generator=torch.Generator().manual_seed(1),
                              tokenizer=type("Tokenizer", (), {"__len__": lambda self: 64, "eos_token_id": 1,
                                                               "pad_token_id": 0})())
    prompts = torch.randint(2, 64, (8, 4))
    mask = torch.ones_like(prompts)
    args.max_answer_seq_len = 6
    seq, logprobs = DeepSpeedPPOTrainer._generate_sequence(trainer, prompts, mask)
    assert logprobs is None and seq.shape[0] == 8
    with torch.no_grad():
        greedy_seq = model.generate(prompts, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=1,
                                    pad_token_id=0)
    # with the checkpoint's top_k=1 applied every sampled first token would be the greedy one
    assert not torch.equal(seq[:, 4], greedy_seq[:, 4])


# --- --advantage_estimator rloo -----------------------------------------------------------------------------------

def test_rloo_with_one_answer_per_prompt_is_a_usage_error_before_anything_loads():
    """RLOO's baseline is the other answers to the prompt: with the default --n_samples_per_prompt 1 the run loaded
    every model, ran the held-out evaluation, then died in its first update with "rloo_advantages needs group_size
    >= 2" (a ValueError traceback naming no flag)."""
    for n in (None, 1):
        settings = {"advantage_estimator": "rloo", "reward_fn": "tiny", "reward_model_weight": 0,
                    **({"n_samples_per_prompt": n} if n else {})}
        with pytest.raises(UsageError, match=r"--advantage_estimator rloo .* --n_samples_per_prompt 2 or more, not 1"):
            check_step3_settings(step3_args(settings), 1)
        with pytest.raises(UsageError, match=r"--n_samples_per_prompt 2 or more"):  # the notebook API too
            DeepSpeedRLHFEngine(actor_model_name_or_path="unused", tokenizer=object(), args=settings)
    check_step3_settings(step3_args({"advantage_estimator": "rloo", "n_samples_per_prompt": 2, "reward_fn": "tiny",
                                     "reward_model_weight": 0}), 1)


def test_a_generation_past_the_actors_local_window_is_refused_before_anything_loads(tmp_path):
    """GPT-Neo's local layers bound the hybrid engine's cache (125M: a 256-token window, against DeepSpeed-Chat's
    256 + 256): refused at the first generation, after every model had loaded."""
    from transformers import GPTNeoConfig

    GPTNeoConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
                 attention_types=[[["global", "local"], 1]], window_size=12).save_pretrained(tmp_path / "neo")
    settings = {"actor_model_name_or_path": str(tmp_path / "neo"), "enable_hybrid_engine": True,
                "max_prompt_seq_len": 8, "max_answer_seq_len": 8}
    with pytest.raises(UsageError, match=r"local window of 12 tokens.* is 16: generate at most the window"):
        check_step3_settings(step3_args(settings), 1)
    check_step3_settings(step3_args({**settings, "max_answer_seq_len": 4}), 1)
    check_step3_settings(step3_args({**settings, "enable_hybrid_engine": False}), 1)  # (HF's generate)


def test_an_actor_whose_forward_takes_no_kv_cache_is_refused_before_anything_loads(tmp_path):
    """GPT-1's forward takes no KV cache, which the hybrid engine's decode steps need: the engine refused it only when
    built, after the actor had loaded and its DeepSpeed engine had been set up; its config says so before."""
    from transformers import OpenAIGPTConfig

    OpenAIGPTConfig(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64).save_pretrained(tmp_path / "gpt")
    settings = {"actor_model_name_or_path": str(tmp_path / "gpt"), "enable_hybrid_engine": True,
                "max_prompt_seq_len": 8, "max_answer_seq_len": 8}
    with pytest.raises(UsageError, match=r"OpenAIGPTLMHeadModel's forward takes no past_key_values.*"
                                         r"--no-enable_hybrid_engine"):
        check_step3_settings(step3_args(settings), 1)
    check_step3_settings(step3_args({**settings, "enable_hybrid_engine": False}), 1)  # (HF's generate)


def test_an_actor_calling_other_submodules_by_length_under_zero3_module_fetch_is_refused_before_anything_loads(
        tmp_path):
    """RecurrentGemma (a one-token prompt reads conv_1d's weight, a longer one calls conv_1d) and DeepSeek-V4 (its
    compressors' norms are called once a window fills) generating on 2 ranks under ZeRO-3 fetched submodule by
    submodule, every forward a gather (HF generate; the hybrid engine unpinned): the ranks gathered other weights and
    gloo aborted (2 CPU ranks, both families on HF generate; RecurrentGemma's hybrid engine:
    tests/scripts/hybrid_zero3_recurrent.py). Refused from the config; not with layer units, pinned parameters, ZeRO-2
    or one rank."""
    from tests.helpers import tiny_deepseek_v4_actor, tiny_recurrent_gemma_actor

    tiny_recurrent_gemma_actor().config.save_pretrained(tmp_path / "rg")
    tiny_deepseek_v4_actor().config.save_pretrained(tmp_path / "v4")
    module = {"actor_zero_stage": 3, "zero3_fetch": "module", "max_prompt_seq_len": 8, "max_answer_seq_len": 8}
    for family, hybrid in (("rg", {"enable_hybrid_engine": False}),
                           ("rg", {"enable_hybrid_engine": True, "unpin_actor_parameters": True}),
                           ("v4", {"enable_hybrid_engine": False})):
        settings = {**module, **hybrid, "actor_model_name_or_path": str(tmp_path / family)}
        with pytest.raises(UsageError, match=r"on 2 ranks.*--zero3_fetch module.*(conv_1d|compressors' norms).*"
                                             r"--zero3_fetch layer"):
            check_step3_settings(step3_args(settings), 2)
        check_step3_settings(step3_args({**settings, "zero3_fetch": "layer"}), 2)
        check_step3_settings(step3_args({**settings, "actor_zero_stage": 2, "unpin_actor_parameters": False}), 2)
        check_step3_settings(step3_args(settings), 1)
    check_step3_settings(step3_args({**module, "enable_hybrid_engine": True,
                                     "actor_model_name_or_path": str(tmp_path / "rg")}), 2)  # (pinned)


def test_a_notebooks_engine_refuses_ranks_gathering_other_weights_before_anything_loads(tmp_path, monkeypatch):
    """A notebook's DeepSpeedRLHFEngine (no ``check_step3_settings``) met the ZeRO-3 --zero3_fetch module refusals of
    RecurrentGemma and DeepSeek-V4 on several ranks only once its actor had loaded (the load-time checks). It refuses
    them from the configs now, before its tokenizer or any weight loads, in the words of the command line's check:
    the actor generating every forward a gather, every engine of DeepSeek-V4 (actor, critic, a reward model given
    to the engine alone); with --zero3_fetch layer it goes on to load."""
    from dschat.rlhf import engine as engine_module
    from tests.helpers import tiny_deepseek_v4_actor, tiny_recurrent_gemma_actor

    tiny_recurrent_gemma_actor().config.save_pretrained(tmp_path / "rg")
    tiny_deepseek_v4_actor().config.save_pretrained(tmp_path / "v4")
    _tiny_policy().config.save_pretrained(tmp_path / "llama")
    monkeypatch.setattr(engine_module, "setup_run", lambda args: None)  # (distributed init: the 2 ranks are faked)
    monkeypatch.setattr(engine_module, "get_world_size", lambda: 2)
    # (config-only folders: the paths' check would want weights)
    monkeypatch.setattr(engine_module, "check_earlier_step_outputs", lambda *given: None)

    class Loaded(Exception):
        pass

    def loading(*given, **kwargs):
        raise Loaded

    for name in ("load_tokenizer", "load_causal_lm", "create_critic_model"):
        monkeypatch.setattr(engine_module, name, loading)
    module = {"actor_zero_stage": 3, "critic_zero_stage": 3, "zero3_fetch": "module", "max_prompt_seq_len": 8,
              "max_answer_seq_len": 8, "enable_hybrid_engine": False}
    grpo = {"advantage_estimator": "grpo", "n_samples_per_prompt": 2}
    for actor, critic, reward, settings, refused in (
            ("rg", "llama", None, {}, r"^HF generate .*\(recurrent_gemma\)"),
            ("rg", "llama", None, {"enable_hybrid_engine": True, "unpin_actor_parameters": True},
             r"^the hybrid engine generating without pinned parameters .*\(recurrent_gemma\)"),
            ("v4", "llama", None, {"enable_hybrid_engine": True}, r"gathering the actor's \(deepseek_v4\)"),
            ("llama", "v4", None, {}, r"gathering the critic's \(deepseek_v4\)"),
            ("llama", None, "v4", grpo, r"gathering the reward model's \(deepseek_v4\)")):
        paths = {"actor_model_name_or_path": str(tmp_path / actor),
                 "critic_model_name_or_path": str(tmp_path / critic) if critic else None,
                 "reward_model_name_or_path": str(tmp_path / reward) if reward else None}
        flags = {**module, **settings, **{name: path for name, path in paths.items() if path}}
        given = {**module, **settings}  # (the notebook gives the engine its paths, not its args)
        with pytest.raises(UsageError, match=refused) as built:
            DeepSpeedRLHFEngine(args=given, **paths)
        with pytest.raises(UsageError) as from_the_flags:
            check_step3_settings(step3_args(flags), 2)
        assert str(built.value) == str(from_the_flags.value)
        with pytest.raises(Loaded):
            DeepSpeedRLHFEngine(args={**given, "zero3_fetch": "layer"}, **paths)


def test_an_unpinned_actor_is_refused_in_the_same_words_before_loading_and_by_the_hybrid_engine(tmp_path):
    """The refusal of RecurrentGemma generating unpinned under ZeRO-3 --zero3_fetch module on 2 ranks is made from its
    config before it loads (``check_generation_gathers_alike``) and by the hybrid engine once built
    (``check_ranks_gather_alike``); each wrote its own advice to keep the actor pinned, in other words. One wording."""
    from dschat.models.layers import check_ranks_gather_alike
    from tests.helpers import tiny_recurrent_gemma_actor

    model = tiny_recurrent_gemma_actor()
    model.config.save_pretrained(tmp_path / "rg")
    with pytest.raises(UsageError) as before_loading:
        check_step3_settings(step3_args({"actor_zero_stage": 3, "zero3_fetch": "module", "max_prompt_seq_len": 8,
                                         "max_answer_seq_len": 8, "enable_hybrid_engine": True,
                                         "unpin_actor_parameters": True,
                                         "actor_model_name_or_path": str(tmp_path / "rg")}), 2)
    with pytest.raises(UsageError) as built:
        check_ranks_gather_alike(model, 2)
    assert str(before_loading.value) == str(built.value)
    assert str(built.value).endswith("or keep the actor's parameters pinned (no --unpin_actor_parameters: "
                                     "hybrid_engine.pin_parameters true)")


def test_an_actor_on_hf_generate_calling_other_submodules_by_length_is_refused_once_loaded(monkeypatch):
    """RecurrentGemma on HF generate (--no-enable_hybrid_engine) under ZeRO-3 --zero3_fetch module on 2 ranks was
    refused only from its config (``check_generation_gathers_alike``), which reads no config of a hub actor not yet
    cached (nor did a notebook's DeepSpeedRLHFEngine make it then): the engine loaded it, and the ranks' first
    rollouts gathered other weights (gloo aborted). The loaded actor is checked as the hybrid engine checks its own,
    in the words of the check before loading; with whole layers as units it loads."""
    from dschat.models.layers import mark_zero3_leaf_layers
    from dschat.rlhf import engine as engine_module
    from dschat.rlhf.engine import check_generation_gathers_alike
    from tests.helpers import tiny_recurrent_gemma_actor

    model = tiny_recurrent_gemma_actor()
    monkeypatch.setattr(engine_module, "load_causal_lm", lambda *given, **kwargs: model)
    # (DeepSpeed's own engine needs its ranks: the module as initialize_engine gives it)
    monkeypatch.setattr(engine_module, "initialize_engine", lambda module, *given, **kwargs: SimpleNamespace(
        module=module))
    settings = step3_args({"actor_zero_stage": 3, "zero3_fetch": "module", "enable_hybrid_engine": False,
                           "max_prompt_seq_len": 8, "max_answer_seq_len": 8, "actor_model_name_or_path": "rg"})
    engine = SimpleNamespace(args=settings, world_size=2, actor_path="rg", tokenizer=None, actor_total_iters=1,
                             _check_sequence_fits=lambda model: None,
                             _trained_config=lambda stage, hybrid=False: step3_train_config(settings, 2, stage, hybrid))
    with pytest.raises(UsageError, match=r"^HF generate \(--no-enable_hybrid_engine\) under ZeRO-3 on 2 ranks.*"
                                         r"\(--zero3_fetch module\).*conv_1d.*--zero3_fetch layer") as loaded:
        DeepSpeedRLHFEngine._init_actor(engine)
    with pytest.raises(UsageError) as before_loading:
        check_generation_gathers_alike(settings, 2, step3_train_config(settings, 2, 3), model.config)
    assert str(loaded.value) == str(before_loading.value)
    assert mark_zero3_leaf_layers(model) == 2  # (--zero3_fetch layer's units)
    DeepSpeedRLHFEngine._init_actor(engine)


def test_a_cpmant_actor_is_refused_before_anything_loads(tmp_path):
    """CPMAnt takes transformers' cache but cannot be decoded one token at a time over it
    (``NOT_DECODABLE_PER_TOKEN``): its config says so before the actor loads."""
    from transformers import CpmAntConfig

    CpmAntConfig(vocab_size=96, hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=64,
                 num_hidden_layers=2).save_pretrained(tmp_path / "cpmant")
    settings = {"actor_model_name_or_path": str(tmp_path / "cpmant"), "enable_hybrid_engine": True,
                "max_prompt_seq_len": 8, "max_answer_seq_len": 8}
    with pytest.raises(UsageError, match=r"CpmAntForCausalLM cannot be decoded.*--no-enable_hybrid_engine"):
        check_step3_settings(step3_args(settings), 1)
    check_step3_settings(step3_args({**settings, "enable_hybrid_engine": False}), 1)  # (HF's generate)


def _small_neo_config():
    from transformers import GPTNeoConfig

    return GPTNeoConfig(vocab_size=96, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=64,
                        attention_types=[[["global", "local"], 1]], window_size=12)


@pytest.fixture
def online_hub(monkeypatch, hub_cache, reachable_hub):
    """The hub answering, its downloads mocked: ``hf_hub_download`` of a model the test put in ``online_hub``'s first
    (name -> save(folder)) fills the hub cache; every download is recorded in its second."""
    hub, downloads = {}, []

    def download(repo_id, filename, **kwargs):
        downloads.append((repo_id, filename))
        return str(hub_cache(repo_id, hub[repo_id]) / filename)

    monkeypatch.setattr("huggingface_hub.hf_hub_download", download)
    return hub, downloads


def test_a_hub_actor_not_in_the_cache_has_its_local_window_checked_before_anything_trains(online_hub):
    """train.py checks step 3's actor before step 1; a hub actor not in the hub cache yet (the first run of a model)
    passed the check read from the cache alone, and step 3 refused its window after steps 1 and 2 had trained."""
    hub, downloads = online_hub
    hub["acme/neo"] = _small_neo_config().save_pretrained
    settings = {"enable_hybrid_engine": True, "max_prompt_seq_len": 8, "max_answer_seq_len": 8}
    with pytest.raises(UsageError, match=r"the actor acme/neo attends within a local window of 12 tokens"):
        check_step3_settings(step3_args(settings), 1, "acme/neo")
    assert downloads == [("acme/neo", "config.json")]  # (its config alone: the weights come with step 1)


def test_a_hub_actor_whose_config_cannot_be_fetched_is_said_to_be_unchecked(capsys, online_hub, monkeypatch):
    """A gated model (the hub answering, its config refused): the window check cannot be made before step 1, and a
    warning says so with the flag that makes it unneeded, instead of passing in silence."""
    def gated(repo_id, filename, **kwargs):
        online_hub[1].append((repo_id, filename))
        raise OSError("401 Client Error: access to model acme/neo is restricted")

    monkeypatch.setattr("huggingface_hub.hf_hub_download", gated)
    settings = {"enable_hybrid_engine": True, "max_prompt_seq_len": 8, "max_answer_seq_len": 8}
    check_step3_settings(step3_args(settings), 1, "acme/neo")
    out = capsys.readouterr().out
    assert ("warning: the config of the actor acme/neo could not be fetched (401 Client Error: access to model "
            "acme/neo is restricted): it was not checked for a local attention window (GPT-Neo's)") in out
    assert "--step3-args --no-enable_hybrid_engine (step 3's --no-enable_hybrid_engine) generates with HF's" in out
    check_step3_settings(step3_args({**settings, "enable_hybrid_engine": False}), 1, "acme/neo")  # (nothing to check)
    assert "warning" not in capsys.readouterr().out
    assert online_hub[1] == [("acme/neo", "config.json")]


@pytest.mark.parametrize("architecture, flag", [(None, "--actor_model_name_or_path"), ("acme/neo", "--actor-model")])
def test_a_hub_actor_that_cannot_be_had_offline_is_an_error_naming_its_flag_not_a_warning(capsys, online_hub,
                                                                                           monkeypatch, architecture,
                                                                                           flag):
    """Offline (or the hub unreachable) a hub actor not in the cache cannot load at all: the settings' check warned
    that "step 3 checks it when it loads the actor (with train.py, after steps 1 and 2)", and step 3 refused it right
    after (step 3 alone; train.py's --actor-model before), or was loading it (the engine's _init_actor)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    settings = {"enable_hybrid_engine": True, "max_prompt_seq_len": 8, "max_answer_seq_len": 8,
                "actor_model_name_or_path": "acme/neo"}
    said = rf"^{flag} acme/neo: no such folder here, nor a model of that name in the Hugging Face hub cache, and " \
           "HF_HUB_OFFLINE is set, so the hub is not asked"
    with pytest.raises(UsageError, match=said):
        check_step3_settings(step3_args(settings), 1, architecture)
    assert "warning" not in capsys.readouterr().out and online_hub[1] == []


def test_the_engine_loading_a_hub_actor_says_no_warning_of_a_later_check(capsys, online_hub, monkeypatch):
    """_init_actor (hybrid engine on) warned of a hub actor whose config could not be fetched that "step 3 checks it
    when it loads the actor (with train.py, after steps 1 and 2)": it was that load. The load that follows fetches the
    same file and says why it cannot; offline, it is the error naming --actor_model_name_or_path, before the load."""
    from huggingface_hub import constants

    from dschat.rlhf import engine as engine_module

    class Loaded(Exception):
        pass

    def loaded(*args, **kwargs):
        raise Loaded

    def gated(repo_id, filename, **kwargs):
        raise OSError("401 Client Error: access to model acme/neo is restricted")

    monkeypatch.setattr(engine_module, "load_causal_lm", loaded)
    monkeypatch.setattr("huggingface_hub.hf_hub_download", gated)
    settings = step3_args({"enable_hybrid_engine": True, "actor_model_name_or_path": "acme/neo"})
    engine = SimpleNamespace(args=settings, world_size=1, actor_path="acme/neo", tokenizer=None,
                             _trained_config=lambda stage, hybrid=False: step3_train_config(settings, 1, stage, hybrid))
    with pytest.raises(Loaded):
        DeepSpeedRLHFEngine._init_actor(engine)
    assert "warning" not in capsys.readouterr().out
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UsageError, match=r"^--actor_model_name_or_path acme/neo: no such folder here, nor a model of "
                                         r"that name in the Hugging Face hub cache, and HF_HUB_OFFLINE is set"):
        DeepSpeedRLHFEngine._init_actor(engine)


def test_a_polynomial_schedule_with_a_rate_at_its_end_is_refused_before_anything_loads():
    """transformers' polynomial schedule refuses a base rate at or below its lr_end (1e-7): --actor_learning_rate 0 (the
    critic trained alone) failed with its ValueError after every model had loaded."""
    from dschat.args import step1_parser
    from dschat.steps.common import check_supervised_settings

    with pytest.raises(UsageError, match=r"polynomial decays the learning rate to 1e-07 .*\(--actor_learning_rate 0\)"):
        check_step3_settings(step3_args({"lr_scheduler_type": "polynomial", "actor_learning_rate": 0}), 1)
    # a rate at its end exactly (transformers needs one above it), and one just above it, which is taken
    with pytest.raises(UsageError, match=r"decays the learning rate to 1e-07 .*\(--actor_learning_rate 1e-07\)"):
        check_step3_settings(step3_args({"lr_scheduler_type": "polynomial", "actor_learning_rate": 1e-7}), 1)
    check_step3_settings(step3_args({"lr_scheduler_type": "polynomial", "actor_learning_rate": 2e-7}), 1)
    # GRPO trains no critic: its rate is not read
    check_step3_settings(step3_args({"lr_scheduler_type": "polynomial", "critic_learning_rate": 0, "reward_fn": "tiny",
                                     "advantage_estimator": "grpo", "n_samples_per_prompt": 2,
                                     "reward_model_weight": 0}), 1)
    step1 = step1_parser().parse_args(["--lr_scheduler_type", "polynomial", "--learning_rate", "1e-8"])
    with pytest.raises(UsageError, match=r"\(--learning_rate 1e-08\)"):
        check_supervised_settings(step1, 1)


# --- --temperature / --top_p --------------------------------------------------------------------------------------

def test_temperature_zero_without_greedy_and_top_p_outside_0_1_are_usage_errors():
    with pytest.raises(UsageError, match="an infinite temperature"):
        check_sampling_flags(float("inf"), 1.0)
    with pytest.raises(UsageError, match=r"--temperature 0(\.0)?: sampling needs a temperature > 0; --greedy"):
        check_step3_settings(step3_args({"temperature": 0}), 1)
    with pytest.raises(UsageError, match="--temperature -0.5"):
        check_step3_settings(step3_args({"temperature": -0.5}), 1)
    check_step3_settings(step3_args({"temperature": 0, "greedy": True}), 1)  # greedy reads no temperature
    for top_p in (0, 1.5, -0.1):
        with pytest.raises(UsageError, match=rf"--top_p {top_p}: must be in \(0, 1\]"):
            check_step3_settings(step3_args({"top_p": top_p}), 1)
    check_step3_settings(step3_args({"top_p": 1.0, "temperature": 0.7}), 1)
    check_step3_settings(step3_args({"top_p": 0.9}), 1)


def test_an_ema_beta_outside_0_1_is_a_usage_error_before_anything_loads():
    # 1.5 made each update 1.5 x EMA - 0.5 x actor: the saved actor_ema drifted without bound, silently
    for beta in ("1.5", "-0.2", "nan"):
        with pytest.raises(UsageError, match=rf"--ema_beta {beta}: the EMA's decay per optimizer step must be in"):
            check_step3_settings(step3_args(step3_parser().parse_args(["--enable_ema", "--ema_beta", beta])), 1)
    for beta in (0.0, 0.992, 1.0):
        check_step3_settings(step3_args({"enable_ema": True, "ema_beta": beta}), 1)
    check_step3_settings(step3_args({"ema_beta": 1.5}), 1)  # no EMA: not read (said to be ignored)


def test_a_negative_or_non_finite_unsup_coef_is_an_error_naming_the_flag():
    # -1 was gradient ascent on the pretraining text, silently; NaN made the actor's weights NaN at its first step
    for coef in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            step3_parser().parse_args(["--unsup_coef", coef])
        with pytest.raises(UsageError, match=rf"unsup_coef: expected a number >= 0, got {coef}"):
            step3_args({"unsup_coef": float(coef)})
    assert step3_args({"unsup_coef": 0}).unsup_coef == 0.0


def test_a_non_finite_reward_weight_is_an_error_naming_the_flag(capsys):
    """--reward_fn_weight nan (or inf, or --reward_model_weight) made every reward of the first rollout nan: after
    every model had loaded, "reward scores is not finite", naming neither flag. A negative weight stays allowed."""
    for flag in ("reward_fn_weight", "reward_model_weight"):
        for weight in ("nan", "inf", "-inf"):
            with pytest.raises(SystemExit):
                step3_parser().parse_args([f"--{flag}={weight}"])
            assert f"--{flag}: expected a finite number, got {weight}" in capsys.readouterr().err
            with pytest.raises(UsageError, match=rf"{flag}: expected a finite number, got {weight}"):
                step3_args({flag: float(weight), "reward_fn": "tiny"})
        assert getattr(step3_args({flag: -0.5, "reward_fn": "tiny"}), flag) == -0.5


def test_a_non_finite_entropy_coef_is_an_error_naming_the_flag(capsys):
    """--entropy_coef nan (or inf) made the first actor loss nan: "actor loss is not finite", after every model had
    loaded, naming no flag. Either sign stays allowed (< 0: an entropy penalty, as verl's entropy_coeff takes)."""
    for coef in ("nan", "inf", "-inf"):
        with pytest.raises(SystemExit):
            step3_parser().parse_args([f"--entropy_coef={coef}"])
        assert f"--entropy_coef: expected a finite number, got {coef}" in capsys.readouterr().err
        with pytest.raises(UsageError, match=rf"entropy_coef: expected a finite number, got {coef}"):
            step3_args({"entropy_coef": float(coef)})
    assert step3_args({"entropy_coef": -0.01}).entropy_coef == -0.01


def test_a_compile_mode_torch_does_not_have_is_refused_before_anything_loads(capsys):
    # a typo ('defualt') failed with torch's "Unrecognized mode=defualt" at the first generation, after the models
    # had loaded (in train.py, after steps 1 and 2)
    from dschat.hybrid_engine import HybridEngine

    with pytest.raises(SystemExit):
        step3_parser().parse_args(["--compile_decode_step", "defualt"])
    assert "invalid choice: 'defualt'" in capsys.readouterr().err
    assert step3_parser().parse_args(["--compile_decode_step", "default"]).compile_decode_step == "default"
    with pytest.raises(ValueError, match="compile_decode_step: 'reduce-overhead' is not a torch.compile mode for the "
                                         "decode step: one of default, max-autotune-no-cudagraphs"):
        HybridEngine(None, compile_decode_step="reduce-overhead")  # (checked before the engine is read)


def test_temperature_zero_ends_the_step_with_error_and_status_2_before_loading(tmp_path, capsys):
    from dschat.steps import ppo
    from dschat.utils.cli import run_entry_point

    with pytest.raises(SystemExit) as stop:
        run_entry_point(lambda: ppo.main(["--temperature", "0", "--output_dir", str(tmp_path / "ppo"),
                                          "--actor_model_name_or_path", str(tmp_path / "no_such_actor")]))
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("error: --temperature 0.0: sampling needs a temperature > 0")


# --- --inference_tp_size ------------------------------------------------------------------------------------------

def test_inference_tp_size_must_divide_the_ranks():
    hybrid = {"enable_hybrid_engine": True, "actor_model_name_or_path": "tiny-llama"}
    with pytest.raises(UsageError, match=r"--inference_tp_size 2: the run's 1 rank\(s\) do not split into "
                                         "inference groups of 2; give a divisor of 1"):
        check_step3_settings(step3_args({**hybrid, "inference_tp_size": 2}), 1)
    with pytest.raises(UsageError, match="--inference_tp_size 4: the run's 6 rank"):
        check_step3_settings(step3_args({**hybrid, "inference_tp_size": 4}), 6)
    check_step3_settings(step3_args({**hybrid, "inference_tp_size": 2}), 2)
    check_step3_settings(step3_args({**hybrid, "inference_tp_size": 2}), 4)


def test_inference_tp_size_from_the_config_file_is_named_as_the_file_key(tmp_path):
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"hybrid_engine": {"inference_tp_size": 2}}))
    with pytest.raises(UsageError, match=r"hybrid_engine.inference_tp_size 2 \(the DeepSpeed config file\)"):
        check_step3_settings(step3_args({"enable_hybrid_engine": True, "deepspeed_config": str(path)}), 3)


def test_inference_tp_under_zero3_needs_the_actor_pinned():
    settings = step3_args({"enable_hybrid_engine": True, "inference_tp_size": 2, "actor_zero_stage": 3,
                           "unpin_actor_parameters": True, "actor_model_name_or_path": "tiny-llama"})
    with pytest.raises(UsageError, match="--inference_tp_size 2 under ZeRO-3 .* --unpin_actor_parameters"):
        check_step3_settings(settings, 2)


def test_an_actor_family_without_a_tensor_parallel_plan_fails_before_its_weights_load(monkeypatch, tmp_path):
    from transformers import CTRLConfig

    # CTRL: no plan of transformers' or dschat's, its projections named Wq, Wk, Wv, dense (only its config is written)
    actor = str(tmp_path / "ctrl")
    CTRLConfig(vocab_size=96, n_embd=64, n_layer=1, n_head=4, dff=128).save_pretrained(actor)
    settings = step3_args({"enable_hybrid_engine": True, "inference_tp_size": 2, "actor_model_name_or_path": actor})
    with pytest.raises(UsageError, match=r"--inference_tp_size 2: .*/ctrl \(model type 'ctrl'\) over 2 "
                                         r"ranks: no tensor-parallel plan for CTRLLMHeadModel"):
        check_step3_settings(settings, 2)
    # the engine, built directly (the notebook API, no check_step3_settings), says so before loading the actor too
    from dschat.rlhf import engine as engine_module

    def no_loading(*args, **kwargs):
        raise AssertionError("the actor's weights were loaded before the check")

    monkeypatch.setattr(engine_module, "load_causal_lm", no_loading)
    engine = SimpleNamespace(args=settings, world_size=2, actor_path=actor, tokenizer=None,
                             _trained_config=lambda stage, hybrid=False: step3_train_config(settings, 2, stage, hybrid))
    with pytest.raises(UsageError, match="--inference_tp_size 2: .*model type 'ctrl'"):
        DeepSpeedRLHFEngine._init_actor(engine)


def test_the_actors_config_is_read_once_for_the_checks_before_its_weights_load(monkeypatch):
    """The inference-TP, local-window, KV-cache and LoRA-name checks each read the actor's config from disk again
    (four reads in check_step3_settings, three in the engine's _init_actor): it is read once and passed along."""
    from transformers import AutoConfig

    from dschat.rlhf import engine as engine_module

    real, reads = AutoConfig.from_pretrained, []
    monkeypatch.setattr(AutoConfig, "from_pretrained",
                        lambda path, **kwargs: reads.append(path) or real(path, **kwargs))
    settings = step3_args({"enable_hybrid_engine": True, "inference_tp_size": 2, "actor_lora_dim": 4,
                           "actor_lora_module_name": "layers.", "actor_model_name_or_path": "tiny-llama"})
    check_step3_settings(settings, 2)
    assert len(reads) == 1, reads

    class Loaded(Exception):
        pass

    def loaded(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(engine_module, "load_causal_lm", loaded)
    engine = SimpleNamespace(args=settings, world_size=2, actor_path="tiny-llama", tokenizer=None,
                             _trained_config=lambda stage, hybrid=False: step3_train_config(settings, 2, stage, hybrid))
    reads.clear()
    with pytest.raises(Loaded):
        DeepSpeedRLHFEngine._init_actor(engine)
    assert len(reads) == 1, reads


def test_the_engine_reads_a_hub_actors_config_from_the_hub_cache_and_only_for_the_hybrid_engines_checks(
        monkeypatch, hub_cache, unreachable_hub):
    """_init_actor read the actor's config with local_files_only=False whether or not the hybrid engine (whose checks
    alone read it there) was on: a hub actor's config was asked of the hub before its weights (an offline run without
    HF_HUB_OFFLINE waited through the hub client's retries), where step 3's settings check reads the hub cache."""
    from transformers import AutoConfig

    from dschat.rlhf import engine as engine_module
    from dschat.tiny.presets import tiny_llama_config

    hub_cache("acme/tiny", tiny_llama_config().save_pretrained)
    real, reads = AutoConfig.from_pretrained, []
    monkeypatch.setattr(AutoConfig, "from_pretrained", lambda path, **kwargs: reads.append(
        kwargs.get("local_files_only", False)) or real(path, **kwargs))

    class Loaded(Exception):
        pass

    def loaded(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(engine_module, "load_causal_lm", loaded)
    for hybrid, read in ((False, []), (True, [True])):
        settings = step3_args({"enable_hybrid_engine": hybrid, "actor_model_name_or_path": "acme/tiny"})
        engine = SimpleNamespace(args=settings, world_size=1, actor_path="acme/tiny", tokenizer=None,
                                 _trained_config=lambda stage, hybrid=False: step3_train_config(settings, 1, stage,
                                                                                               hybrid))
        reads.clear()
        with pytest.raises(Loaded):
            DeepSpeedRLHFEngine._init_actor(engine)
        assert reads == read, (hybrid, reads)
    assert unreachable_hub == []  # (in the cache: the hub not even probed)


def test_head_counts_that_do_not_split_over_the_group_fail_before_loading():
    settings = step3_args({"enable_hybrid_engine": True, "inference_tp_size": 8,
                           "actor_model_name_or_path": "tiny-llama"})  # 4 attention heads
    with pytest.raises(UsageError, match="--inference_tp_size 8: .*model type 'llama'.* cannot be split over "
                                         "inference_tp_size=8"):
        check_step3_settings(settings, 8)


def test_an_actor_not_written_yet_is_left_to_the_step_that_loads_it(tmp_path):
    # train.py checks step 3's flags before step 1 writes the actor: the plan is checked when the engine builds it
    settings = step3_args({"enable_hybrid_engine": True, "inference_tp_size": 2,
                           "actor_model_name_or_path": str(tmp_path / "step1_sft")})
    check_step3_settings(settings, 2)


# --- flags only the hybrid engine reads ---------------------------------------------------------------------------

HYBRID_ONLY = [({"unpin_actor_parameters": True}, "--unpin_actor_parameters"),
               ({"release_inference_cache": True}, "--release_inference_cache"),
               ({"inference_tp_size": 2}, "--inference_tp_size 2"),
               ({"tp_gather_partition_size": 4}, "--tp_gather_partition_size 4"),
               ({"enable_cuda_graph": True}, "--enable_cuda_graph"),
               ({"no-enable_cuda_graph": True}, "--no-enable_cuda_graph"),
               ({"compile_decode_step": "default"}, "--compile_decode_step default"),
               ({"logprobs_from_generation": True}, "--logprobs_from_generation"),
               ({"decode_attention": "sdpa"}, "--decode_attention sdpa"),
               ({"fuse_projections": "on"}, "--fuse_projections on")]


@pytest.mark.parametrize("setting,flag", HYBRID_ONLY, ids=[flag for _, flag in HYBRID_ONLY])
def test_a_hybrid_engine_flag_without_the_hybrid_engine_is_a_usage_error(setting, flag):
    with pytest.raises(UsageError, match=rf"^{flag}: read by the hybrid engine only, which is off .* add "
                                         "--enable_hybrid_engine"):
        check_step3_settings(step3_args(setting), 1)
    if flag != "--inference_tp_size 2":  # one rank: a group of 2 is its own error
        check_step3_settings(step3_args({**setting, "enable_hybrid_engine": True}), 1)


def test_every_flag_of_the_hybrid_engine_group_is_covered():
    from dschat.args import hybrid_engine_only_flags

    parser = step3_parser()
    group = next(g for g in parser._action_groups if g.title == "hybrid engine")
    dests = {a.dest for a in group._group_actions} - {"enable_hybrid_engine"}
    assert dests == {next(iter(setting)).removeprefix("no-") for setting, _ in HYBRID_ONLY}
    several = step3_args({"inference_tp_size": 2, "release_inference_cache": True})
    assert hybrid_engine_only_flags(several) == ["--release_inference_cache", "--inference_tp_size 2"]
    with pytest.raises(UsageError, match="^--release_inference_cache, --inference_tp_size 2: .* leave them out"):
        check_step3_settings(several, 1)


def test_the_critics_own_flags_are_listed_when_set_and_not_when_given_at_their_defaults():
    from dschat.args import CRITIC_ONLY_FLAGS, critic_only_flags

    parser = step3_parser()
    assert critic_only_flags(parser.parse_args(["--critic_learning_rate", "5e-6", "--critic_weight_decay", "0"])) == []
    given = parser.parse_args(["--critic_learning_rate", "1e-4", "--disable_critic_dropout",
                               "--critic_gradient_checkpointing", "--critic_zero_stage", "3"])
    assert critic_only_flags(given) == ["--critic_learning_rate 0.0001", "--critic_gradient_checkpointing",
                                        "--critic_dropout 0.0"]  # (the stage is the reward model's too)
    assert set(CRITIC_ONLY_FLAGS) <= {a.dest for a in parser._actions}


def test_flags_read_only_when_another_setting_is_on_are_listed_when_it_is_off():
    """A PPO script switched to GRPO kept GAE's --lam/--whiten_advantages, an --ema_beta without --enable_ema, ...: all
    silently ignored (the critic's own flags were said)."""
    from dschat.args import CONDITIONAL_FLAGS, unread_conditional_flags

    parser = step3_parser()
    # (--unsup_coef is read without --unsupervised_dataset_name too: a notebook's train_rollout(unsup_batches=...))
    grpo = parser.parse_args(["--advantage_estimator", "grpo", "--n_samples_per_prompt", "2", "--lam", "0.5",
                              "--whiten_advantages", "--grpo_norm_by_std", "0", "--ema_beta", "0.9", "--unsup_coef",
                              "5", "--lora_alpha", "16", "--print_answers_interval", "5"])
    assert unread_conditional_flags(grpo) == [
        "--lam 0.5 (read only with --advantage_estimator gae)",
        "--whiten_advantages (read only with --advantage_estimator gae)",
        "--ema_beta 0.9 (read only with --enable_ema)",
        "--lora_alpha 16.0 (read only with --actor_lora_dim or --critic_lora_dim)",
        "--print_answers_interval 5 (read only with --print_answers)"]
    on = parser.parse_args(["--lam", "0.5", "--whiten_advantages", "--enable_ema", "--ema_beta", "0.9",
                            "--unsupervised_dataset_name", "tiny", "--unsup_coef", "5", "--actor_lora_dim", "4",
                            "--lora_alpha", "16", "--print_answers", "--print_answers_interval", "5",
                            "--reward_fn", "tiny", "--reward_fn_weight", "2"])
    assert unread_conditional_flags(on) == []
    assert unread_conditional_flags(parser.parse_args(["--grpo_norm_by_std", "0", "--reward_fn_weight", "2"])) == [
        "--grpo_norm_by_std none (read only with --advantage_estimator grpo)",
        "--reward_fn_weight 2.0 (read only with --reward_fn)"]
    # greedy answers are neither drawn nor scored at --temperature (scored at 1): it went unsaid
    greedy = ["--temperature", "0.7", "--top_k", "5", "--top_p", "0.9"]
    assert unread_conditional_flags(parser.parse_args(["--greedy", *greedy])) == [
        "--temperature 0.7 (read only with sampled answers, not --greedy)",
        "--top_k 5 (read only with sampled answers, not --greedy)",
        "--top_p 0.9 (read only with sampled answers, not --greedy)"]
    assert unread_conditional_flags(parser.parse_args(greedy)) == []
    # the hybrid engine's unpinning is of ZeRO-3's partitions: below it, whole weights (it went unsaid)
    unpin = ["--enable_hybrid_engine", "--unpin_actor_parameters"]
    assert unread_conditional_flags(parser.parse_args([*unpin, "--actor_zero_stage", "2"])) == [
        "--unpin_actor_parameters (read only with --actor_zero_stage 3)"]
    assert unread_conditional_flags(parser.parse_args(unpin)) == [
        "--unpin_actor_parameters (read only with --actor_zero_stage 3)"]
    assert unread_conditional_flags(parser.parse_args([*unpin, "--actor_zero_stage", "3"])) == []
    assert unread_conditional_flags(parser.parse_args([*unpin, "--zero_stage", "3"])) == []
    assert {name for names, _, _ in CONDITIONAL_FLAGS for name in names} <= {a.dest for a in parser._actions}


def test_a_warmup_is_said_to_be_ignored_by_the_constant_schedule():
    """transformers' "constant" schedule takes no warmup (constant_with_warmup does): --num_warmup_steps went unread."""
    from dschat.args import step1_parser, supervised_conditional_flags, unread_conditional_flags

    said = ["--num_warmup_steps 5 (read only with --lr_scheduler_type other than constant)"]
    given = ["--lr_scheduler_type", "constant", "--num_warmup_steps", "5"]
    assert unread_conditional_flags(step3_parser().parse_args(given)) == said
    assert unread_conditional_flags(step1_parser().parse_args(given), step1_parser(),
                                    supervised_conditional_flags(1)) == said
    warmed = ["--lr_scheduler_type", "constant_with_warmup", "--num_warmup_steps", "5"]
    assert unread_conditional_flags(step3_parser().parse_args(warmed)) == []
    # (an explicit 0 with constant asks for no warmup: nothing to say)
    assert unread_conditional_flags(step3_parser().parse_args(given[:2] + ["--num_warmup_steps", "0"])) == []


def test_step_1s_own_data_flag_is_said_to_be_ignored_by_the_other_steps(tmp_path, distributed, monkeypatch, capsys):
    """Every step parses --sft_only_data_path (its data flags are one group); steps 2, 3 and DPO ignored it silently."""
    from dschat.args import (step1_parser, step2_dpo_parser, step2_parser, supervised_conditional_flags,
                             unread_conditional_flags)

    said = ["--sft_only_data_path jsonl:extra.jsonl tiny (read only with step 1)"]
    given = ["--sft_only_data_path", "jsonl:extra.jsonl", "tiny"]
    assert unread_conditional_flags(step3_parser().parse_args(given)) == said
    for parser, phase in ((step2_parser(), 2), (step2_dpo_parser(), 2)):
        assert unread_conditional_flags(parser.parse_args(given), step1_parser(),
                                        supervised_conditional_flags(phase)) == said
    assert unread_conditional_flags(step1_parser().parse_args(given), step1_parser(),
                                    supervised_conditional_flags(1)) == []
    # and the steps say it: step 2 (its run stopped once it has said what it ignores) and DPO, not step 1
    from dschat.steps import common, dpo, reward, sft

    class Said(Exception):
        pass

    def stop(*given):
        raise Said

    monkeypatch.setattr(common, "check_writable_folder", stop)
    for step, main in (("step2", reward.main), ("step2_dpo", dpo.main), ("step1", sft.main)):
        capsys.readouterr()
        with pytest.raises(Said):
            main(["--model_name_or_path", "tiny-llama", "--dtype", "fp32", "--sft_only_data_path", "tiny",
                  "--output_dir", str(tmp_path / step), "--data_output_path", str(tmp_path / "data")])
        out = capsys.readouterr().out
        assert (f"[{step}] --sft_only_data_path tiny (read only with step 1): ignored" in out) == (step != "step1"), \
            (step, out)


def test_a_reward_clip_is_said_to_be_ignored_where_the_group_compares_raw_scores():
    """GRPO and RLOO take each answer's raw score (the clipped per-token rewards are not read): a --clip_reward_value
    given with them was silently ignored."""
    from dschat.args import unread_conditional_flags

    parser = step3_parser()
    for estimator in ("grpo", "rloo"):
        args = parser.parse_args(["--advantage_estimator", estimator, "--n_samples_per_prompt", "2",
                                  "--clip_reward_value", "1"])
        assert unread_conditional_flags(args) == [
            "--clip_reward_value 1.0 (read only with --advantage_estimator gae or reinforce_pp)"]
    for estimator in ("gae", "reinforce_pp"):
        args = parser.parse_args(["--advantage_estimator", estimator, "--clip_reward_value", "1"])
        assert unread_conditional_flags(args) == []


# DeepSpeed-Chat's step-3 scripts (training_scripts/opt/single_node/run_13b.sh, opt/multi_node/run_66b.sh,
# single_node/run_7b_llama.sh, opt/single_node/sweep/run_single.sh without its hybrid engine switch, here with the
# defaults of two hybrid-engine flags given explicitly), flags only: none gives a hybrid-engine flag a value of its
# own without --enable_hybrid_engine
DS_CHAT_STEP3 = {
    "run_13b": ("--num_padding_at_beginning 1 --per_device_generation_batch_size 16 --per_device_training_batch_size 16 "
                "--generation_batches 1 --ppo_epochs 1 --max_answer_seq_len 256 --max_prompt_seq_len 256 "
                "--actor_learning_rate 5e-4 --critic_learning_rate 5e-6 --num_train_epochs 1 --lr_scheduler_type "
                "cosine --gradient_accumulation_steps 1 --num_warmup_steps 100 --deepspeed --seed 1234 "
                "--enable_hybrid_engine --inference_tp_size 2 --actor_zero_stage 3 --critic_zero_stage 3 "
                "--actor_gradient_checkpointing --disable_actor_dropout --actor_lora_dim 128 "
                "--actor_lora_module_name decoder.layers.", 2),
    "run_66b": ("--num_padding_at_beginning 1 --per_device_train_batch_size 4 --per_device_mini_train_batch_size 4 "
                "--generation_batch_numbers 1 --ppo_epochs 1 --max_answer_seq_len 256 --max_prompt_seq_len 256 "
                "--actor_learning_rate 5e-4 --critic_learning_rate 5e-6 --actor_weight_decay 0.1 "
                "--critic_weight_decay 0.1 --num_train_epochs 1 --lr_scheduler_type cosine "
                "--gradient_accumulation_steps 1 --num_warmup_steps 100 --deepspeed --seed 1234 "
                "--enable_hybrid_engine --inference_tp_size 4 --tp_gather_partition_size 4 --actor_zero_stage 3 "
                "--critic_zero_stage 3 --actor_gradient_checkpointing --disable_actor_dropout --actor_lora_dim 128 "
                "--actor_lora_module_name decoder.layers.", 8),  # 8 in the script: tiny-opt has 4 heads
    "run_7b_llama": ("--num_padding_at_beginning 0 --per_device_train_batch_size 4 --per_device_mini_train_batch_size "
                     "4 --generation_batch_numbers 1 --ppo_epochs 1 --max_answer_seq_len 256 --max_prompt_seq_len 256 "
                     "--deepspeed --seed 1234 --offload_reference_model --actor_gradient_checkpointing "
                     "--critic_gradient_checkpointing --actor_lora_dim 128 --actor_lora_module_name .layers. "
                     "--critic_lora_dim 128 --critic_lora_module_name .layers. --actor_zero_stage 2 "
                     "--critic_zero_stage 3 --enable_ema", 4),
    "sweep_without_hybrid_engine": ("--per_device_generation_batch_size 4 --per_device_training_batch_size 4 "
                                    "--actor_dropout 0.0 --print_answers --actor_zero_stage 2 --critic_zero_stage 2 "
                                    "--actor_lora_dim 0 --inference_tp_size 1 --tp_gather_partition_size 8", 1),
}


@pytest.mark.parametrize("name", list(DS_CHAT_STEP3))
def test_deepspeed_chat_step3_scripts_pass_the_checks(name):
    flags, world_size = DS_CHAT_STEP3[name]
    args = step3_args(step3_parser().parse_args(shlex.split(flags) + ["--actor_model_name_or_path", "tiny-opt"]))
    check_step3_settings(args, world_size)


# --- --offload_reward_model with a critic-free advantage estimator ------------------------------------------------

class _Built(Exception):
    pass


def _reward_config(monkeypatch, capsys, **settings):
    """The DeepSpeed config ``_init_reward`` builds the reward model with, and what it printed."""
    from dschat.rlhf import engine as engine_module

    def capture(path, tokenizer, ds_config, *args, **kwargs):
        raise _Built(ds_config)

    monkeypatch.setattr(engine_module, "create_critic_model", capture)
    engine = SimpleNamespace(args=step3_args({"offload_reward_model": True, **settings}), world_size=1,
                             reward_path="rm", tokenizer=None, _check_token_ids=lambda *args: None)
    engine._eval_config = lambda *args, **kwargs: DeepSpeedRLHFEngine._eval_config(engine, *args, **kwargs)
    capsys.readouterr()
    with pytest.raises(_Built) as built:
        DeepSpeedRLHFEngine._init_reward(engine)
    zero = built.value.args[0]["zero_optimization"]
    return zero["stage"], zero["offload_param"]["device"], capsys.readouterr().out


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_without_a_critic_the_reward_models_stage_and_offload_follow_critic_zero_stage(monkeypatch, capsys, estimator):
    # --critic_zero_stage is train.py's --reward-zero-stage: it keeps setting the reward model's sharding
    assert _reward_config(monkeypatch, capsys, advantage_estimator=estimator, critic_zero_stage=3,
                          actor_zero_stage=2)[:2] == (3, "cpu")
    stage, device, said = _reward_config(monkeypatch, capsys, advantage_estimator=estimator, actor_zero_stage=3,
                                         critic_zero_stage=2)
    assert (stage, device) == (0, "none")
    assert "--offload_reward_model: parameter offload is a ZeRO-3 feature" in said
    assert f"only with --critic_zero_stage 3 (--advantage_estimator {estimator} trains no critic" in said
    assert "like the critic" not in said


def test_reward_model_offload_follows_the_critic_under_gae(monkeypatch, capsys):
    assert _reward_config(monkeypatch, capsys, critic_zero_stage=3, actor_zero_stage=2)[:2] == (3, "cpu")
    stage, device, said = _reward_config(monkeypatch, capsys, critic_zero_stage=2, actor_zero_stage=3)
    assert (stage, device) == (0, "none")
    assert "only with --critic_zero_stage 3 (it is sharded like the critic; now 2): not offloaded" in said


def test_train_py_checks_the_plan_on_the_model_step1_starts_from_not_an_earlier_runs_output(tmp_path, monkeypatch):
    # before step 1 runs, <output-dir>/step1_sft may hold an earlier run's model (here 4 heads: no split over 8)
    import runpy

    from transformers import LlamaConfig

    from dschat import pipeline
    from dschat.args import step1_parser, step2_parser
    from dschat.utils import dist
    from launch import REPO

    def llama(folder, heads):
        LlamaConfig(vocab_size=64, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=heads, num_key_value_heads=heads).save_pretrained(folder)

    llama(tmp_path / "out" / "step1_sft", heads=4)
    llama(tmp_path / "start", heads=8)
    # (the modules that copy get_world_size, imported before it is patched: imported during the test, they kept the
    # patched one past it, and the test failed alone)
    import dschat.rlhf.checkpointing, dschat.rlhf.evaluation, dschat.steps.ppo, dschat.steps.resume  # noqa: E401,F401
    dist.ensure_distributed()  # (rank 0's decisions broadcast in the group: not one an earlier test left)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    args = runpy.run_path(str(REPO / "train.py"))["parse_args"](
        ["--actor-model", str(tmp_path / "start"), "--output-dir", str(tmp_path / "out"),
         "--step3-args", "--enable_hybrid_engine --inference_tp_size 8"])
    parsers = {1: step1_parser, 2: step2_parser, 3: step3_parser}
    pipeline.check_step_args([1, 2, 3], args, True, parsers)  # the 8-head model step 1 starts from splits
    with pytest.raises(UsageError, match="step1_sft .*4 attention heads"):  # step 3 alone reads the folder
        pipeline.check_step_args([3], args, True, parsers)


def test_actor_and_critic_write_their_deepspeed_tensorboard_events_to_runs_of_their_own():
    """Both engines' TensorBoard monitors wrote Train/Samples/lr into one run (job step3_tensorboard), so the actor's
    and the critic's learning-rate curves interleaved in it; DeepSpeed-Chat names them step3_actor and step3_critic."""
    args = step3_args({"enable_tensorboard": True, "tensorboard_path": "tb"})
    runs = {role: step3_train_config(args, 1, 0, role=role, quiet=True)["tensorboard"] for role in ("actor", "critic")}
    assert all(run["enabled"] for run in runs.values())
    assert [run["job_name"] for run in runs.values()] == ["step3_actor_tensorboard", "step3_critic_tensorboard"]


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_lora_module_name_that_matches_no_layer_is_an_error_naming_step3s_flag(role):
    """The error named --lora_module_name, steps 1 and 2's flag, which step 3 does not have (DeepSpeed-Chat's
    "decoder.layers." of its OPT scripts matches no layer of other families)."""
    from dschat.models.loading import load_tokenizer

    args = step3_args({f"{role}_lora_dim": 4, f"{role}_lora_module_name": "decoder.layers.", "dtype": "fp32"})
    engine = SimpleNamespace(args=args, world_size=1, actor_path="tiny-llama", critic_path="tiny-llama",
                             tokenizer=load_tokenizer("tiny-llama"), _check_token_ids=lambda *given: None,
                             _check_sequence_fits=lambda model: None, load_universal=frozenset())
    engine._train_config = lambda *given, **kwargs: DeepSpeedRLHFEngine._train_config(engine, *given, **kwargs)
    engine._trained_config = lambda *given, **kwargs: DeepSpeedRLHFEngine._trained_config(engine, *given, **kwargs)
    build = DeepSpeedRLHFEngine._init_actor if role == "actor" else DeepSpeedRLHFEngine._init_critic
    with pytest.raises(UsageError, match=rf"^--{role}_lora_module_name 'decoder.layers.' matches no Linear module"):
        build(engine)


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_a_lora_module_name_that_matches_no_layer_fails_before_any_model_loads(role):
    # the name was only checked as the model loaded: after an actor of billions of parameters had loaded, and under
    # train.py after steps 1 and 2 had trained (DeepSpeed-Chat's OPT scripts' "decoder.layers." on a Llama actor)
    settings = {f"{role}_lora_dim": 4, "actor_model_name_or_path": "tiny-llama", "critic_model_name_or_path": "tiny-llama"}
    with pytest.raises(UsageError, match=rf"^--{role}_lora_module_name 'decoder.layers.' matches no Linear module"):
        check_step3_settings(step3_args({**settings, f"{role}_lora_module_name": "decoder.layers."}), 1)
    check_step3_settings(step3_args({**settings, f"{role}_lora_module_name": "layers."}), 1)


def test_a_model_that_cannot_be_built_on_the_meta_device_leaves_its_lora_name_to_its_load(monkeypatch):
    """DBRX's and Emu3's default configs raise AttributeError, Reformer's AssertionError when built on the meta
    device: the early check, a convenience, stopped step 3 with that traceback."""
    from transformers import AutoModelForCausalLM

    def unbuildable(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'ffn_hidden_size'")

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", unbuildable)
    check_step3_settings(step3_args({"actor_lora_dim": 4, "actor_lora_module_name": "decoder.layers.",
                                     "actor_model_name_or_path": "tiny-llama"}), 1)


def test_a_lora_module_name_is_checked_on_the_model_step1_starts_from_under_train_py():
    args = step3_args({"actor_lora_dim": 4, "actor_lora_module_name": "decoder.layers.",
                       "actor_model_name_or_path": "/no/step1_sft/yet"})
    check_step3_settings(args, 1)  # the actor step 1 writes later: checked when step 3 loads it
    with pytest.raises(UsageError, match="^--actor_lora_module_name 'decoder.layers.' matches no Linear module"):
        check_step3_settings(args, 1, actor_architecture="tiny-llama")


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_an_actor_or_critic_training_with_its_configs_dropout_is_said(role, monkeypatch, capsys):
    """OPT's config has dropout 0.1: the rollout's log-probs and values come from eval-mode forwards, the PPO step's
    from training-mode ones, so the ratio / value clip would measure dropout noise. Said unless the flag is given."""
    from dschat.models.loading import load_tokenizer
    from dschat.rlhf import engine as rlhf_engine

    def stop(*given, **kwargs):
        raise RuntimeError("stopped before DeepSpeed")

    monkeypatch.setattr(rlhf_engine, "initialize_engine", stop)
    for flag, said in ((None, True), (0.0, False), (0.1, False)):
        args = step3_args({f"{role}_dropout": flag, "dtype": "fp32"})
        engine = SimpleNamespace(args=args, world_size=1, actor_path="tiny-opt", critic_path="tiny-opt",
                                 tokenizer=load_tokenizer("tiny-opt"), _check_token_ids=lambda *given: None,
                                 _check_sequence_fits=lambda model: None, load_universal=frozenset(),
                                 actor_total_iters=1, num_total_iters=1)
        engine._train_config = lambda *given, **kwargs: DeepSpeedRLHFEngine._train_config(engine, *given, **kwargs)
        engine._trained_config = lambda *given, **kwargs: DeepSpeedRLHFEngine._trained_config(engine, *given,
                                                                                               **kwargs)
        build = DeepSpeedRLHFEngine._init_actor if role == "actor" else DeepSpeedRLHFEngine._init_critic
        with pytest.raises(RuntimeError, match="stopped before DeepSpeed"):
            build(engine)
        out = capsys.readouterr().out
        assert (f"the {role} trains with its config's dropout (dropout 0.1)" in out) is said, (flag, out)
        if said:
            assert f"give --{role}_dropout 0.0" in out and ("ratio" if role == "actor" else "value clip") in out


@pytest.mark.parametrize("flags, said", [
    ({"advantage_estimator": "grpo"}, "--advantage_estimator grpo compares each answer .* not 1 .*reinforce_pp"),
    ({"advantage_estimator": "rloo", "n_samples_per_prompt": 1}, "--advantage_estimator rloo compares each answer"),
    ({"advantage_estimator": "grpo", "n_samples_per_prompt": 4, "greedy": True},
     "--greedy with --advantage_estimator grpo: the 4 answers .* every advantage is 0"),
    ({"advantage_estimator": "rloo", "n_samples_per_prompt": 4, "top_k": 1},
     "--top_k 1 with --advantage_estimator rloo: .* greedy, so the 4 answers .* every advantage is 0"),
])
def test_group_estimators_refuse_groups_that_cannot_train(flags, said):
    """GRPO / RLOO compare an answer with the other answers to its prompt: one answer (TRL refuses GRPO so too) or
    greedy answers (all the same text; --top_k 1 samples greedily too) would train on raw scores or on nothing,
    silently."""
    from dschat.rlhf.config import check_advantage_estimator

    with pytest.raises(UsageError, match=said):
        check_advantage_estimator(step3_args(flags))
    check_advantage_estimator(step3_args({**flags, "n_samples_per_prompt": 2, "greedy": False, "top_k": 2}))
    check_advantage_estimator(step3_args({**flags, "advantage_estimator": "reinforce_pp", "n_samples_per_prompt": 1}))


REWARD_FN_NODES_SCRIPT = """
import os, sys, torch
from types import SimpleNamespace
from dschat.steps.ppo import check_same_reward_fn_on_every_rank
from dschat.utils.dist import ensure_distributed
rank, _ = ensure_distributed()
seen = []
for name in ("same.py", "other.py"):  # each 'node' reads its own copy in its working directory
    try:
        check_same_reward_fn_on_every_rank(SimpleNamespace(reward_fn=os.path.abspath(name) + ":score"), "cpu")
        seen.append("ok")
    except Exception as error:
        seen.append(type(error).__name__ + ": " + str(error).split(": ", 1)[1])
# step 3 checks them before it loads anything (the tokenizer first)
from dschat.steps import ppo


class Loaded(Exception):
    pass


def loaded(*given, **kw):
    raise Loaded


ppo.load_tokenizer = loaded
for name in ("same.py", "other.py"):
    try:
        ppo.main(["--actor_model_name_or_path", "tiny-llama", "--advantage_estimator", "grpo", "--n_samples_per_prompt",
                  "2", "--reward_model_weight", "0", "--reward_fn", name + ":score", "--dtype", "fp32", "--output_dir",
                  "out"])
    except Loaded:
        seen.append("loaded")
    except Exception as error:
        seen.append(type(error).__name__ + ": " + str(error).split(": ", 1)[1])
""" + WRITE_SEEN_AND_END


def test_nodes_reading_copies_of_a_reward_function_that_differ_stop_with_an_error(tmp_path):
    """Each node reads a --reward_fn file from its own disk: a copy that differs rewarded the ranks' answers by
    different functions, silently (the ranks compare their flags, not the files)."""
    from launch import run_as_two_nodes

    nodes = [tmp_path / f"node{rank}" for rank in range(2)]
    for rank, node in enumerate(nodes):
        node.mkdir()
        (node / "same.py").write_text("def score(prompts, answers):\n    return [1.0] * len(answers)\n")
        (node / "other.py").write_text(f"def score(prompts, answers):\n    return [{rank}.0] * len(answers)\n")
    run_as_two_nodes(tmp_path, REWARD_FN_NODES_SCRIPT, nodes)
    for node in nodes:
        differ = "UsageError: its file differs between the ranks (each node's own copy): give every node the same file"
        assert (node / "seen").read_text().splitlines() == ["ok", differ, "loaded", differ]


def test_step3_says_which_generation_config_settings_apply_to_its_rollouts_and_evaluation(capsys):
    """The actor's generation_config settings that no step-3 flag sets (a no_repeat_ngram_size) were applied by HF's
    generate to the rollouts, and its repetition_penalty to the held-out evaluation's greedy answers (the rollouts
    sample at --repetition_penalty), unsaid. Said where they apply; the sampling settings the flags give are not."""
    from transformers import GenerationConfig

    from dschat.rlhf.engine import say_generation_config_settings

    config = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                              no_repeat_ngram_size=3, eos_token_id=[1, 2], max_length=4096)
    actor = SimpleNamespace(generation_config=config)
    for hybrid in ("--enable_hybrid_engine", "--no-enable_hybrid_engine"):
        say_generation_config_settings(actor, step3_args(step3_parser().parse_args([hybrid])))
        said = capsys.readouterr().out
        assert "applies no_repeat_ngram_size=3 to the rollouts (no step-3 flag sets it" in said
        assert "applies repetition_penalty=1.05, no_repeat_ngram_size=3 to the held-out evaluation" in said
        assert "temperature" not in said and "top_k" not in said and "max_length" not in said
    config.no_repeat_ngram_size = 0
    say_generation_config_settings(actor, step3_args(step3_parser().parse_args(["--eval_prompts", "0"])))
    assert capsys.readouterr().out == ""  # (the rollouts' settings are all the flags')


def test_cliprange_high_reaches_the_actor_loss(monkeypatch):
    """--cliprange_high (DAPO's clip-higher) is the upper side of the ratio clip the actor trains with; --cliprange
    alone keeps it symmetric. (A TRL user's epsilon_high=0.28 had no flag: the ratio was clipped at 1.2.)"""
    from types import SimpleNamespace

    from dschat.rlhf import trainer as trainer_module

    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.25, 1.25]])).requires_grad_()  # ratio 1.25, positive advantages
    monkeypatch.setattr(trainer_module, "answer_token_stats", lambda *args, **kwargs: logp)

    def actor_loss(flags):
        args = step3_args(flags)
        fake = SimpleNamespace(args=args, cliprange=args.cliprange, stats={}, actor_model=None,
                               _kl_loss_settings=lambda: (0.0, "k3"))
        return trainer_module.DeepSpeedPPOTrainer._actor_loss(fake, None, None, 0, None, old, old, torch.ones(1, 2),
                                                             torch.ones(1, 2), {"loss_agg": "token_mean"}).item()

    assert actor_loss({}) == pytest.approx(-1.2)  # (clipped at 1 + --cliprange)
    assert actor_loss({"cliprange_high": 0.28}) == pytest.approx(-1.25)
    assert actor_loss({"cliprange": 0.1, "cliprange_high": 0.28}) == pytest.approx(-1.25)
    assert actor_loss({"cliprange": 0.1}) == pytest.approx(-1.1)


def test_grpo_norm_by_std_help_points_dr_grpo_users_to_its_loss():
    """--grpo_norm_by_std 0 is Dr. GRPO's advantage; its help said the loss "stays the mean over the micro-batch's
    tokens, not Dr. GRPO's sum over a constant length", written before --loss_agg seq_mean_token_sum_norm made that
    loss: a TRL user with loss_type="dr_grpo" read that dschat had none."""
    from dschat.args import step3_parser

    action = next(a for a in step3_parser()._actions if "--grpo_norm_by_std" in a.option_strings)
    assert "--loss_agg seq_mean_token_sum_norm" in action.help and "not Dr. GRPO's" not in action.help
    assert "seq_mean_token_sum_norm" in next(a for a in step3_parser()._actions if "--loss_agg" in a.option_strings).choices


def test_sampling_flags_help_says_what_the_trained_log_probs_are_taken_under():
    """Step 3 scores its answers at --temperature and without the top-k / top-p filters that drew them (as TRL,
    OpenRLHF and verl do; trainer.scoring_temperature): --repetition_penalty's help said its part, the three flags'
    said nothing of it: a user of --top_p 0.9 had no word that the KL and ratio are of the unfiltered policy (a token
    the filter made likelier scored at its unfiltered probability)."""
    helps = {option: a.help for a in step3_parser()._actions for option in a.option_strings}
    assert "log-probs" in helps["--temperature"] and "taken at it" in helps["--temperature"]
    for flag in ("--top_k", "--top_p"):
        assert "unfiltered distribution" in helps[flag], flag


def test_grpo_norm_by_std_takes_the_batch_scope_and_its_old_values(monkeypatch):
    """TRL's scale_rewards takes group, batch (the std of the whole batch's rewards over all processes) and none;
    --grpo_norm_by_std took only 1 (group) and 0 (none). Those stay, read as group and none; batch reaches GRPO's
    advantages with the world's process group, so every rank divides by the std of every rank's scores."""
    from dschat.rlhf import trainer as trainer_module

    parse = lambda *given: step3_parser().parse_args(list(given)).grpo_norm_by_std  # noqa: E731
    assert (parse(), parse("--grpo_norm_by_std", "1"), parse("--grpo_norm_by_std", "0")) == ("group", "group", "none")
    assert parse("--grpo_norm_by_std", "batch") == "batch"
    with pytest.raises(SystemExit):
        parse("--grpo_norm_by_std", "2")
    world = object()
    monkeypatch.setattr(trainer_module, "_world_group", lambda: world)
    calls = []
    monkeypatch.setattr(trainer_module.algo, "grpo_advantages",
                        lambda scores, n, mask, norm_by_std, process_group=None: calls.append(
                            (norm_by_std, process_group)))
    trainer = SimpleNamespace(stats={}, args=SimpleNamespace(advantage_estimator="grpo", n_samples_per_prompt=2,
                                                             grpo_norm_by_std="batch"))
    DeepSpeedPPOTrainer.critic_free_advantages(trainer, torch.tensor([1.0, 2.0, 3.0, 5.0]), None, torch.ones(4, 2))
    assert calls == [("batch", world)]


def test_a_notebooks_grpo_norm_by_std_1_0_true_or_false_is_read_as_group_or_none():
    """A notebook's args dict took --grpo_norm_by_std as 1/0 (the flag's int) or True/False before the batch scope; the
    scope names' choices refused them all ("1 is not one of ['group', 'batch', 'none']"), where the command line's
    "1" and "0" still ran."""
    read = lambda value: step3_args({"grpo_norm_by_std": value}).grpo_norm_by_std  # noqa: E731
    assert [read(value) for value in (1, True, 0, False, "batch")] == ["group", "group", "none", "none", "batch"]
    for wrong in (2, 0.5, "2"):
        with pytest.raises(UsageError, match="grpo_norm_by_std"):
            read(wrong)


def test_kl_estimator_low_var_kl_is_a_flag_value_and_bounds_the_kl_loss_term(monkeypatch):
    """verl's GRPO recipes take kl_loss_type=low_var_kl (k3 clamped to 10 per token); dschat's algorithms had it but
    --kl_estimator refused it, so a verl user's run could only take the unclamped k3, whose exp(ref - logp) grows
    without bound on a token the policy has made unlikely."""
    from dschat.args import step3_parser
    from dschat.rlhf import algorithms as algo

    args = step3_args(vars(step3_parser().parse_args(["--advantage_estimator", "grpo", "--n_samples_per_prompt", "2",
                                                      "--kl_estimator", "low_var_kl"])))
    assert args.kl_estimator == "low_var_kl"
    logp, ref = torch.tensor([[-30.0, -1.0]]), torch.tensor([[-1.0, -1.0]])
    mask = torch.ones(1, 2)
    assert algo.kl_loss_term(logp, ref, mask, args.kl_estimator).item() == pytest.approx(10.0 / 2)
    assert algo.kl_loss_term(logp, ref, mask, "k3").item() > 1e11


# --- --mask_truncated_answers: the flag's ways in (its effect on the loss: test_ppo) -------------------------------

def test_mask_truncated_answers_reaches_step3_from_train_py_and_defaults_off_in_the_notebook_api():
    import runpy

    from dschat import pipeline
    from launch import REPO

    parse = runpy.run_path(str(REPO / "train.py"))["parse_args"]
    for recipe in ([], ["--recipe", "grpo"]):
        argv = pipeline.step_argv(3, parse(recipe + ["--step3-args", "--mask_truncated_answers"]), True)
        assert step3_parser().parse_args(argv).mask_truncated_answers is True, argv
        assert step3_parser().parse_args(pipeline.step_argv(3, parse(recipe), True)).mask_truncated_answers is False
    assert step3_args({}).mask_truncated_answers is False  # (DeepSpeedPPOTrainer's args namespace)
    assert step3_args({"mask_truncated_answers": True}).mask_truncated_answers is True


def test_the_iteration_line_says_the_loss_left_the_truncated_answers_out():
    """truncated_answers is the count the loss left out under the flag; the line says so, says a loss of 0 where
    every answer was cut, and the optimizer steps skipped for no token in the loss (train_rollout's
    "<model>_no_token_steps"), which a line saying "no gradient" alone left to guess."""
    from dschat.steps.ppo import truncated_left_out_said

    on, off = step3_args({"mask_truncated_answers": True}), step3_args({})
    assert truncated_left_out_said({"truncated_answers": 3}, off, 8) == ""
    assert truncated_left_out_said({"truncated_answers": 0}, on, 8) == ""
    assert truncated_left_out_said({"truncated_answers": 3}, on, 8) == \
        " (truncated answers left out of the loss: --mask_truncated_answers)"
    assert truncated_left_out_said({"truncated_answers": 3, "actor_no_token_steps": 1, "critic_no_token_steps": 1},
                                   on, 8) == (" (truncated answers left out of the loss: --mask_truncated_answers; "
                                              "optimizer steps skipped for no token in the loss: actor 1 of 1, "
                                              "critic 1 of 1)")
    all_cut = truncated_left_out_said({"truncated_answers": 8, "actor_no_token_steps": 0, "critic_no_token_steps": 1},
                                      on, 8)
    assert all_cut == (" (all 8 answers truncated and left out of the loss by --mask_truncated_answers: a loss of 0, "
                       "no gradient; optimizer steps skipped for no token in the loss: critic 1 of 1)")
