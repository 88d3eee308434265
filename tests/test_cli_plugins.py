"""`nexrl plugins`, through the installed console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

NEXRL = str(Path(sys.executable).with_name("nexrl"))  # the nexrl under test, not whichever is first on PATH


def run_nexrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([NEXRL, *args], capture_output=True, text=True, timeout=120)


def test_plugins_json_lists_grpo_with_everything_it_registers() -> None:
    completed = run_nexrl("plugins", "--json")
    assert completed.returncode == 0, completed.stderr
    rows = {row["name"]: row for row in json.loads(completed.stdout)}
    grpo = rows["grpo"]
    assert set(grpo) == {"name", "distribution", "version", "registers", "error"}
    assert grpo["distribution"] == "nexrl-grpo"
    assert grpo["error"] is None
    assert grpo["registers"] == {
        "advantage_estimators": ["dr_grpo", "grpo", "on_policy_distillation", "reinforce_plus_plus", "rloo"],
        "policy_losses": ["cispo", "cross_entropy", "dro", "gspo", "importance_sampling", "ppo"],
        "trainers": ["remote_api_grpo", "self_hosted_grpo"],
        "service_holders": [],
        "transports": [],
        "services": [],
        "placers": [],
        "group_engines": [],
        "tasks": [],
        "backends": [],
        "rollout_sources": [],
        "metrics_sinks": [],
    }


def test_plugins_table() -> None:
    completed = run_nexrl("plugins")
    assert completed.returncode == 0, completed.stderr
    assert "nexrl-grpo" in completed.stdout
    assert "importance_sampling" in completed.stdout


def test_serve_unknown_service_names_what_is_known() -> None:
    completed = run_nexrl("serve", "no-such-service")
    assert completed.returncode == 1
    assert "unknown service 'no-such-service'" in completed.stderr
