"""Default exit layers have one definition (`exitplane.wire.default_exit_layers`): a
deployment created without exit layers, the runtime serving the same model without exit heads,
head training and the CLI help all agree, so a deployment of the tiny model created without
exit layers is served by its own runtime, and a deployment of the default model created without
exit layers by the exit heads the package ships."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from controlplane.deployments.schemas import DeploymentCreate
from exitplane.wire import (
    DEFAULT_EXIT_LAYERS_RULE,
    ThresholdSetWire,
    default_exit_layers,
)


@pytest.mark.parametrize(("num_layers", "expected"), [
    (2, [1]), (3, [2]), (6, [2, 4]), (11, [2, 4, 6, 8, 10]), (12, [6, 9]),
    (15, [6, 9, 12]), (20, [8, 11, 14, 17]), (30, [12, 15, 18, 21, 24, 27]),
    (32, [12, 15, 18, 21, 24, 27, 30])])
def test_the_rule(num_layers, expected):
    assert default_exit_layers(num_layers) == expected
    created = DeploymentCreate(name="d", model_ref="m", num_layers=num_layers)
    assert created.exit_layers == expected


@pytest.mark.parametrize("num_layers", [2, 4, 6, 12, 30])
def test_the_runtime_without_heads_exits_where_the_deployment_does(num_layers):
    from runtime.engine import Engine
    from runtime.model import tiny_llama

    engine = Engine(tiny_llama(num_layers=num_layers))
    deployment = DeploymentCreate(name="tiny", model_ref="tiny-llama", num_layers=num_layers)
    assert engine.exit_layers == deployment.exit_layers
    # The set the control plane publishes for that deployment is one this runtime applies.
    wire = ThresholdSetWire.build(deployment="tiny", version=1, signal="maxprob",
                                  thresholds=dict.fromkeys(deployment.exit_layers, 0.9))
    engine.set_thresholds(wire)
    assert engine.policy.version == 1


def test_a_deployment_of_the_default_model_fits_the_shipped_heads():
    """The shipped heads apply every set the control plane publishes for a deployment of their
    model created without exit layers: none is refused for its exit layers."""
    from exitplane.client.thresholds import check_threshold_set
    from exitplane.demo import DEMO_HEADS
    from runtime.heads import ExitHeads, read_metadata

    shipped = read_metadata(DEMO_HEADS)
    deployment = DeploymentCreate(name="chat", model_ref="smollm2-135m",
                                  num_layers=shipped["num_layers"])
    heads = ExitHeads.load(DEMO_HEADS)
    assert deployment.exit_layers == heads.exit_layers == shipped["exit_layers"]
    for version, threshold in ((1, 1.0), (2, 0.9)):  # the never-exit start, a calibrated set
        wire = ThresholdSetWire.build(deployment="chat", version=version, signal="maxprob",
                                      thresholds=dict.fromkeys(deployment.exit_layers, threshold))
        check_threshold_set(wire, deployment="chat", exit_layers=heads.exit_layers)


def test_the_cli_help_states_the_rule():
    from exitplane.cli import main

    runner = CliRunner()
    for command in (["deployment", "ensure", "--help"], ["runtime", "train-heads", "--help"],
                    ["runtime", "provision", "--help"]):
        result = runner.invoke(main, command, terminal_width=400)
        assert result.exit_code == 0, result.output
        assert DEFAULT_EXIT_LAYERS_RULE in " ".join(result.output.split()), command


def test_runtime_serve_takes_threads_defaulting_to_the_usable_cores():
    import torch

    from exitplane.cli import main
    from runtime.cli import _threads, usable_cores

    result = CliRunner().invoke(main, ["runtime", "serve", "--help"], terminal_width=400)
    assert "--threads" in result.output
    assert usable_cores() == len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        _threads(None)
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
        _threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
