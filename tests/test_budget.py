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
