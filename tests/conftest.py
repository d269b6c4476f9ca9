import os

import pytest
import torch

# One intra-op thread in every process of the suite, whatever the shell says: each rank of a
# multi-process test runs one (tests/distributed.py), and the one-process references computed in
# the test process itself must sum in the same order, or results that are equal to 1e-9 in float64
# with one thread drift past it with two. Scripts the tests launch inherit the variable.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
