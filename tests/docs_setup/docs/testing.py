"""docs/testing.md's examples: tests/_multiprocess.py's names, and what a check uses."""
import os

import torch
import torch.nn.functional as F
from _multiprocess import ROOT, CaseRef, Cases, Launch, parametrize_cases, worker_main
from torch.testing import assert_close

import pipedream_ext as pd

HERE = os.path.join(ROOT, "tests", "test_my_feature.py")


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
