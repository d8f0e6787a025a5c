"""docs/planner.md's examples plan PipeDream's profile of GNMT (large) as graph.txt."""
import os
import shutil

from _multiprocess import ROOT

import pipedream_ext as pd

shutil.copy(os.path.join(ROOT, "tests", "data", "profiles", "gnmt_large.txt"), "graph.txt")
