"""OpenEnv: the echo environment that OpenEnv's own `openenv init` writes, played in process and
over OpenEnv's HTTP server started by the run, for three RL steps each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import weir

pytest.importorskip("openenv.core.env_server")

CONFIG = str(Path(__file__).parents[2] / "examples" / "openenv_echo.yaml")


@pytest.fixture(scope="module")
def echo_env(tmp_path_factory):
    """`openenv init echo_env`: the environment template OpenEnv ships (an echo with reward
    0.1 per character), importable as `echo_env`."""
    root = tmp_path_factory.mktemp("openenv")
    subprocess.run(
        [sys.executable, "-m", "openenv.cli", "init", "echo_env"],
        cwd=root,
        check=True,
        capture_output=True,
        timeout=120,
    )
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in_process", "http"])
def test_the_echo_environment_trains_for_three_steps(tmp_path, echo_env, mode):
    result = weir.run(
        CONFIG,
        [f"run.dir={tmp_path}", "run.steps=3", f"openenv.mode={mode}", "rollout.batch_prompts=2"],
    )
    steps = [h for h in result.history if "reward/mean" in h]
    assert len(steps) == 3
    for h in steps:
        assert h["rollout/failed"] == 0 and h["agent/turns_mean"] == 2  # the echo never ends
        # reward = 0.1 per character echoed, summed over the two steps: positive and varied
        assert h["reward/mean"] > 0 and h["reward/std"] > 0
        assert h["mismatch/abs_logp_diff"] < 1e-4


def test_a_bad_section_is_refused_at_start_in_one_line(echo_env):
    from weir.adapters.openenv import env_factory
    from weir.config.adapter_sections import OpenEnvConfig

    with pytest.raises(ValueError, match="has no attribute"):
        env_factory(OpenEnvConfig(env="echo_env.server.echo_env_environment:Nope"))
    with pytest.raises(ValueError, match="action_field"):
        env_factory(
            OpenEnvConfig(
                env="echo_env.server.echo_env_environment:EchoEnvironment",
                action="echo_env.models:EchoAction",
                action_field="missing",
            )
        )
