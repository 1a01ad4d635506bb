"""tests/launch.py's guards for the modules whose fixtures compare one rank with two: on a one-GPU machine their
one-rank cases run and the two-rank cases skip, instead of every case failing in the fixture's launch; and the
conftest's isolation of the processes tests start."""
import os
import subprocess
import sys

import pytest
import torch

import launch


def test_two_ranks_start_on_the_cpu_and_need_two_gpus_under_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.too_few_gpus(2) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert launch.too_few_gpus(2) == "2 ranks need 2 GPUs; this machine has 1"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert launch.too_few_gpus(2) is None


def test_results_of_ranks_that_could_not_start_skip_the_test_that_reads_them(monkeypatch):
    monkeypatch.setattr(launch, "too_few_gpus", lambda num_gpus=2: "2 ranks need 2 GPUs; this machine has 1")
    monkeypatch.setattr(launch, "run_deepspeed", lambda *a, **k: pytest.fail("launched on too few GPUs"))
    two = launch.launch_and_load("script.py", load=lambda: pytest.fail("loaded results never written"))
    with pytest.raises(pytest.skip.Exception, match="this machine has 1"):
        two["every_answer_cut"]


def test_a_launch_that_can_start_loads_its_results(monkeypatch):
    launches = []
    monkeypatch.setattr(launch, "too_few_gpus", lambda num_gpus=2: None)
    monkeypatch.setattr(launch, "run_deepspeed", lambda *args, **kwargs: launches.append(args))
    assert launch.launch_and_load("script.py", "root", load=lambda: {"case": 1}) == {"case": 1}
    assert launches == [("script.py", "root")]


def test_a_process_a_test_starts_keeps_datasets_cache_in_the_tests_folder(tmp_path):
    """conftest set datasets' cache folder only in the test's process: train.py or a deepspeed rank started by a test
    wrote its Arrow caches and kept file hashes into the user's ~/.cache/huggingface/datasets, shared by every run."""
    import datasets

    code = "import datasets; print(datasets.config.HF_DATASETS_CACHE)"
    child = subprocess.run([sys.executable, "-c", code], env=os.environ, capture_output=True, text=True, timeout=120)
    assert child.stdout.strip() == datasets.config.HF_DATASETS_CACHE == str(tmp_path / "hf_cache"), child.stderr
