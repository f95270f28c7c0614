"""The budget forms the API and CLI accept, and the malformed ones they reject."""

import pytest

from planner.common.budget import format_bytes, parse_budget


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (123456, 123456),
        ("4GB", 4 * 10**9),
        ("4GiB", 4 * 2**30),
        ("512MB", 512 * 10**6),
        ("512MiB", 512 * 2**20),
        ("64KB", 64_000),
        ("64KiB", 65_536),
        ("1000B", 1000),
        ("1.5GiB", int(1.5 * 2**30)),
        (" 2 gb ", 2 * 10**9),
        ("60%", 600),
        ("100%", 1000),
    ],
)
def test_accepted_forms(text, expected):
    assert parse_budget(text, baseline_peak_bytes=1000) == expected


@pytest.mark.parametrize("text", ["", "4", "GB", "4XB", "-1GB", "4 G B", "0%", "120%", "abc", "4GB!", "0GB", 0, -5,
                                  2.5, True, None])
def test_malformed_budgets_name_the_accepted_forms(text):
    with pytest.raises(ValueError, match="4GiB"):
        parse_budget(text, baseline_peak_bytes=1000)


def test_percentage_needs_a_baseline():
    with pytest.raises(ValueError, match="un-checkpointed peak"):
        parse_budget("50%")


def test_format_bytes():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**20) == "3.00 MiB"


@pytest.mark.parametrize(("text", "expected"), [("device", 2000), (" Device ", 2000), ("90% of device", 1800),
                                                ("12.5 % of  DEVICE", 250)])
def test_device_forms(text, expected):
    assert parse_budget(text, baseline_peak_bytes=1000, device_bytes=2000) == expected


@pytest.mark.parametrize("text", ["0% of device", "120% of device", "90% device", "of device", "devices"])
def test_malformed_device_budgets_are_refused(text):
    with pytest.raises(ValueError, match="of device"):
        parse_budget(text, baseline_peak_bytes=1000, device_bytes=2000)


def test_a_device_budget_needs_the_device():
    with pytest.raises(ValueError, match="what the device can hold"):
        parse_budget("device", baseline_peak_bytes=1000)


def test_device_means_what_the_device_can_hold_for_the_step():
    """On this CPU: what the process may still allocate plus what the model and inputs hold already, less the
    reserve; on a spec: its memory less the CUDA context and the reserve."""
    import torch

    from planner import optimize
    from planner.profiling.devices import load_device
    from planner.profiling.fitting import resident_bytes
    from planner.profiling.headroom import RESERVE_SHARE, capacity_bytes, headroom_bytes, spec_capacity_bytes

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    plan = optimize(model, "device", inputs=(x,))
    from planner.capture.inputs import as_inputs

    held = resident_bytes(model, as_inputs(model, (x,)))
    room = headroom_bytes(torch.device("cpu"))
    assert room is not None
    assert plan.budget_bytes == pytest.approx((room + held) * (1 - RESERVE_SHARE), rel=0.01)  # the room moves a bit
    assert not plan.segments  # it fits: no checkpoint
    assert capacity_bytes(torch.device("cpu"), held_bytes=held) <= (room + held)
    with torch.device("meta"):
        big = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    half = optimize(big, "50% of device", inputs=(torch.randn(32, 64, device="meta"),), device="h100")
    h100 = load_device("h100")
    assert half.budget_bytes == spec_capacity_bytes(h100.memory_bytes, gpu=True) // 2


def test_a_gpu_plan_says_what_the_caching_allocator_reserves_for_it(monkeypatch):
    """On a GPU the summary and the CLI's header give what the caching allocator is predicted to reserve, under
    the process's expandable-segments setting (``docs/memory-model.md``), which the budget bounds by default;
    where it is not predicted, what the budget bounds and the setting that keeps the reserve near it."""
    import torch
    from torch import nn

    from planner import optimize
    from planner.profiling.headroom import ALLOC_CONF, reserve_note
    from planner.report.render import header

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                                for _ in range(4)])
    monkeypatch.delenv(ALLOC_CONF, raising=False)
    plan = optimize(model, "60%", inputs=(torch.randn(4096, 256, device="meta"),), device="h100", offload=False)
    assert plan.predicted_peak_bytes < plan.reserved.needed_bytes <= plan.budget_bytes
    line = "predicted at the device's limit without expandable segments"
    assert line in plan.summary()
    assert any(line in str(cell) for column in header(plan, model_file="m.py", solver="cpsat").columns
               for cell in column.cells)
    advice = f"set {ALLOC_CONF}=expandable_segments:True"
    assert advice in reserve_note("cuda:0")
    monkeypatch.setenv(ALLOC_CONF, "expandable_segments:True,max_split_size_mb:128")
    assert advice not in reserve_note("cuda:0") and "has expandable_segments:True" in reserve_note("cuda:0")
    assert reserve_note("cpu") is None and reserve_note("cuda:0") is not None
