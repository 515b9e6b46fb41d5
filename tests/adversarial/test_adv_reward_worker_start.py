"""A custom reward module that ends its worker at import names the file, the function and the
exit code (issue 24.8; the message used to be only 'reward worker exited at start (exit code 3)')."""

import pytest

from pfppo_mega.rewards.base import RewardSetupError
from pfppo_mega.rewards.custom import CustomReward


@pytest.mark.parametrize("body,said", [("import sys\nsys.exit(3)\n", r"importing the file raised SystemExit: 3"),
                                       ("import os\nos._exit(7)\n", r"the reward worker exited at start \(exit code 7\)")])
def test_a_module_that_exits_at_import_is_named(tmp_path, body, said):
    f = tmp_path / "exits.py"
    f.write_text(body + "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    with pytest.raises(RewardSetupError, match=rf"reward.custom_function: 'compute_score' in '{f}': {said}"):
        CustomReward(str(f), "compute_score", num_workers=1, timeout_s=5.0, log=lambda *_: None)
