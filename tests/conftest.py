import os

import pytest

# Keep CPU tests single-threaded per process and off any real hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _dschat_cache(tmp_path_factory):
    """Tiny presets are built into a per-session cache, never the user's ~/.cache."""
    if "DSCHAT_CACHE" not in os.environ:
        os.environ["DSCHAT_CACHE"] = str(tmp_path_factory.mktemp("dschat_cache"))
    yield


@pytest.fixture(scope="session")
def distributed():
    from dschat.utils.dist import ensure_distributed

    return ensure_distributed()
