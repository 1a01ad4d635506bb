import os

import pytest

# Keep CPU tests single-threaded per process and off any real hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread per test process, and per process a test starts (they inherit the variable), unless the caller set
# OMP_NUM_THREADS: set before torch is imported, which reads it. pytest-xdist's workers on 2 cores each ran torch on a
# thread per core; so oversubscribed, OpenMP's threads waited on each other's time slices and a test of 150 SFT
# micro-batches took 149 s in place of 7 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def _dschat_cache(tmp_path_factory):
    """Tiny presets are built into a per-session cache, never the user's ~/.cache."""
    if "DSCHAT_CACHE" not in os.environ:
        os.environ["DSCHAT_CACHE"] = str(tmp_path_factory.mktemp("dschat_cache"))
    yield


@pytest.fixture(scope="session", autouse=True)
def _small_zero_buckets():
    """ZeRO's gradient buckets sized for the tests' tiny models: DeepSpeed's default (5e8 elements) allocates 2 GB of
    address space per bucket per engine, untouched but counted. The engines of a step run in a test's own process
    outlived it (before ``release_engine``): after a few step-3 runs a pytest worker held 40 GB, and its next fork
    (datasets' num_proc, a subprocess) failed with 'Cannot allocate memory'. Step runs now release theirs, but a test
    that builds a notebook engine (``DeepSpeedRLHFEngine``) and never calls its ``release()`` still keeps it."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for name in ("reduce_bucket_size", "allgather_bucket_size"):
        DeepSpeedZeroConfig.model_fields[name].default = int(5e6)
    DeepSpeedZeroConfig.model_rebuild(force=True)
    yield


# dschat's notices said once per process are kept in these module sets (a dict, for reward_fn's): each test starts
# as a fresh process does, nothing said yet. Else a test that checks a notice failed after another test had said the
# same one (test_prompt_eval_prints_both_models_answers after test_prompt_eval_rule_scores_the_tiny_held_out_prompts:
# "--top_k 4: no effect on greedy decoding" said by the earlier one, not again).
SAID_ONCE_MEMORIES = (("dschat.utils.cli", "_SAID"), ("dschat.utils.dist", "_SAID_ONCE"),
                      ("dschat.args", "_REPORTED_UNKNOWN"), ("dschat.models.loading", "_WARNED_EOT"),
                      ("dschat.models.left_padding", "_WARNED_LEFT_PADDING"), ("dschat.data.pipeline", "_RENAMES_SAID"),
                      ("dschat.rlhf.reward_fn", "_RENAMED_SAID"))


@pytest.fixture(autouse=True)
def nothing_said_yet():
    """The memories of SAID_ONCE_MEMORIES emptied, of the modules imported so far (one imported later starts empty)."""
    import sys

    for module_name, name in SAID_ONCE_MEMORIES:
        if module_name in sys.modules:
            getattr(sys.modules[module_name], name).clear()


@pytest.fixture(scope="session")
def distributed():
    from dschat.utils.dist import ensure_distributed

    return ensure_distributed()


@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path, monkeypatch):
    """Keep datasets' Arrow cache of test files (and dschat's kept file hashes) out of ~/.cache: this process's, and
    that of the processes a test starts (train.py, the deepspeed launcher's ranks), which read the variable."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


@pytest.fixture
def transformers_log():
    """The messages transformers logs during the test (its "LOAD REPORT"s): its library logger does not propagate
    to the root logger that caplog reads, unless some earlier test in the process turned propagation on."""
    import logging

    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    yield logged
    logging.getLogger("transformers").removeHandler(handler)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A Hugging Face hub cache holding models saved by the test, read offline as the hub client reads a download:
    ``hub_cache(name, save)`` calls ``save(folder)`` to fill the snapshot of the hub model ``name``."""
    from huggingface_hub import constants

    root = tmp_path / "hub_cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))  # (train.py's steps in other processes)

    def add(name, save):
        repo = root / f"models--{name.replace('/', '--')}"
        commit = "0" * 40
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
        save(repo / "snapshots" / commit)
        return repo / "snapshots" / commit

    return add


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded tiny tokenizer (pad != eos)."""
    from dschat.tiny import load_tiny_tokenizer

    return load_tiny_tokenizer()


@pytest.fixture
def reachable_hub(monkeypatch):
    """The hub client online (HF_HUB_OFFLINE unset, the tests' 1 undone) and the hub answering dschat's one short
    request (``hub_probe_failure``); nothing else of the hub's is mocked."""
    from types import SimpleNamespace

    from huggingface_hub import constants

    from dschat.models.loading import hub_probe_failure

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr("huggingface_hub.utils.get_session", lambda: SimpleNamespace(head=lambda url, **kw: None))
    hub_probe_failure.cache_clear()
    yield
    hub_probe_failure.cache_clear()


@pytest.fixture
def unreachable_hub(monkeypatch):
    """The hub client online (HF_HUB_OFFLINE unset) with no network: each request fails at once, counted. The offline
    mode dschat then turns on (``read_hub_cache_only_if_unreachable``) is undone after the test."""
    import datasets
    from huggingface_hub import constants

    from dschat.models.loading import HUB_UNREACHABLE_ENV, hub_probe_failure

    requests = []

    class NoNetwork:
        def head(self, url, **kwargs):
            requests.append(url)
            raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # (set, not deleted: monkeypatch undoes a later setting of a set one)
    monkeypatch.setenv(HUB_UNREACHABLE_ENV, "")
    monkeypatch.setattr("huggingface_hub.utils.get_session", NoNetwork)
    hub_probe_failure.cache_clear()
    yield requests
    hub_probe_failure.cache_clear()


def _library_mend_undone(monkeypatch, mend):
    """The library's own methods in place of ``mend``'s fix (a test before may have put it in) and ``mend`` not yet
    probed; both as they were after the test."""
    for cls, name in mend.fixes():
        monkeypatch.setattr(cls, name, mend.replaced.get((cls, name), getattr(cls, name)))
    monkeypatch.setattr(mend, "replaced", {})
    monkeypatch.setattr(mend, "answer", None)


@pytest.fixture
def transformers_rwkv_steps(monkeypatch):
    """transformers' own RWKV one-token step methods in place and the probe not yet run (``_library_mend_undone``)."""
    from dschat import compat

    _library_mend_undone(monkeypatch, compat._RWKV_DECODE_MEND)


@pytest.fixture
def transformers_xlstm_cache(monkeypatch):
    """transformers' own ``xLSTMCache.__init__`` in place (``_library_mend_undone``)."""
    from dschat import compat

    _library_mend_undone(monkeypatch, compat._XLSTM_CACHE_MEND)


_TESTS_FOLDER = os.path.dirname(os.path.abspath(__file__))
_LEAKS_SAID = set()


def _test_functions_bound_in_dschat():
    """{"module.name": "file:line"} of dschat module globals bound to a function written in a test file."""
    import sys
    import types

    bound = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "dschat" or module_name.startswith("dschat.")):
            continue
        for name, value in list(vars(module).items()):
            if type(value) is types.FunctionType and value.__code__.co_filename.startswith(_TESTS_FOLDER):
                bound[f"{module_name}.{name}"] = f"{value.__code__.co_filename}:{value.__code__.co_firstlineno}"
    return bound


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Fails the test that left a dschat module holding one of the tests' functions once its fixtures (monkeypatch's
    undo) are done: a module first imported while a patch was in place copied the patched name (``from dschat.x
    import f``) and keeps it, so a later test, in some orders only, calls the replacement (a step 3 raised another
    test's exception). Each leak is said once (after the leaking test, the later ones would see it too)."""
    result = yield
    leaks = {name: where for name, where in _test_functions_bound_in_dschat().items() if name not in _LEAKS_SAID}
    if leaks:
        _LEAKS_SAID.update(leaks)
        raise AssertionError(f"{item.nodeid} left a patched function behind: " + "; ".join(
            f"{name} is {where}" for name, where in leaks.items()) + " (import the module that copies the name "
            "before patching it, or patch it there too)")
    return result
