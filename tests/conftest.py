import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_model():
    from tiny import build_tiny
    model, tok = build_tiny("treasure", seed=0)
    return model.eval(), tok
