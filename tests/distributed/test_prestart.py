"""The forkserver started at ``polytrain train``'s first moment (src/polytrain/distributed/prestart.py): which
command lines start it, and with what. That a command leaves no process behind, with it started or stopped while
starting, is tests/cli/test_signals.py's; that a run's workers train from it, every CLI test's."""

from __future__ import annotations

import pytest

from polytrain.distributed.prestart import guess_strategy


@pytest.mark.parametrize("argv,env,expected", [
    (["train"], {}, "sync"),
    (["train", "--strategy=fsdp", "--workers", "4"], {}, "fsdp"),
    (["train", "--strategy", "pipeline", "--device", "cpu:4"], {}, "pipeline"),
    (["train", "--strategy", "single"], {}, None),  # one worker, in this process
    (["train", "--workers", "1"], {}, None),
    (["train", "--device", "cpu:1"], {}, None),
    (["train", "--device", "cuda"], {}, None),  # (as many workers as GPUs: maybe one)
    (["train", "--strategy", "mine.module:Class"], {}, None),  # not one of polytrain's own
    (["train", "--help-all"], {}, None),
    (["train", "--print-config"], {}, None),
    (["plan"], {}, None),
    ([], {}, None),
    (["train"], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, None),  # torchrun's worker
    (["train"], {"SLURM_PROCID": "0"}, None),
    (["train"], {"POLYTRAIN_START_METHOD": "spawn"}, None),
])
def test_a_train_command_whose_workers_polytrain_forks_starts_the_forkserver_at_once(argv, env, expected):
    assert guess_strategy(argv, env) == expected


def test_the_config_files_keys_count_and_the_flags_win(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('strategy = "async"\nworkers = 3\n')
    assert guess_strategy(["train", "--config", str(config)], {}) == "async"
    assert guess_strategy(["train", "--config", str(config), "--strategy", "single"], {}) is None
    config.write_text('workers = 1\n')
    assert guess_strategy(["train", "--config", str(config)], {}) is None
    assert guess_strategy(["train", "--config", str(tmp_path / "missing.toml")], {}) is None  # (said later)
