"""refimpl.simulator (SPEC.md section 8): what the conformance section does not cover.

Calibration (the fit and the command, which runs gloo ranks), the Simulator reused over
orders, and argument errors. Costs and timelines are conformance cases
(conformance/cases/test_simulator.py).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from conformance import memory_programs as mp
from refimpl.simulator import (
    CostModel,
    HardwareProfile,
    LinkCost,
    Simulator,
    _fit_link,
    main,
    simulate,
)


@pytest.fixture(scope="module")
def world4():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    elif dist.get_world_size() != 4:
        pytest.fail(f"these tests need a world of 4, found {dist.get_world_size()}")
    yield dist.new_group([0, 1]).group_name
    if created:
        dist.destroy_process_group()


def test_fit_recovers_alpha_and_beta():
    link, n = LinkCost(alpha_us=40.0, beta_bytes_per_us=500.0), 4
    sizes = [1000, 10_000, 100_000]
    times = [(n - 1) * link.alpha_us + (n - 1) / n * s * n / link.beta_bytes_per_us
             for s in sizes]
    fitted = _fit_link(sizes, times, n)
    assert fitted.alpha_us == pytest.approx(40.0)
    assert fitted.beta_bytes_per_us == pytest.approx(500.0)


def test_calibrate_command_writes_a_profile(tmp_path):
    out = tmp_path / "profile.json"
    assert main(["calibrate", "--repeat", "3", "--out", str(out)]) == 0
    profile = HardwareProfile.load(out)
    assert profile.link(2).alpha_us >= 0 and profile.link(2).beta_bytes_per_us > 0
    assert profile.flops_per_us["default"] > 0 and profile.memory_bytes_per_us > 0
    assert "calibrate" in profile.source and json.loads(out.read_text())["name"]


def test_simulator_is_reused_across_orders(world4):
    gm = mp.traced_layered(world4)
    simulator = Simulator(gm, CostModel())
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    first = simulator.run(body)
    again = simulator.run()
    assert first.step_time_us == again.step_time_us == simulate(gm).step_time_us


def test_argument_errors(world4):
    gm = mp.traced_layered(world4)
    with pytest.raises(TypeError, match=r"profile: expected a HardwareProfile.*\[SIM-1\]"):
        CostModel(profile="h100")
    with pytest.raises(TypeError, match=r"cost_model: expected a CostModel.*\[SIM-1\]"):
        simulate(gm, "fast")


def test_unregistered_group_is_named(world4):
    gm = mp.traced_layered(world4)
    rs = next(n for n in gm.graph.nodes if "reduce_scatter" in str(n.target))
    rs.target = torch.ops.refimpl_c10d.all_reduce.default
    rs.args = (rs.args[0], "sum", "no-such-group")
    with pytest.raises(ValueError, match=rf"node '{rs.name}' names group 'no-such-group'"):
        simulate(gm)
