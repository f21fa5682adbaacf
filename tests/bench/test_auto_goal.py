"""The judge of ``benchmarks.auto_goal``: auto against the best fixed option within the
time limit, and the absolute goal against autograd, on rows made up here."""

from __future__ import annotations

from benchmarks.auto_goal import absolute, judge


def _row(per_sample: float, times: list[float]) -> dict:
    return {"per_sample": {"bytes_per_sample": per_sample}, "time_ms": {"samples": times}}


ROWS = {
    "autograd": _row(1600.0, [10.0, 10.0, 10.0]),
    "ours:nocompress": _row(1600.0, [10.0, 10.0, 10.0]),
    "ours:quant": _row(400.0, [11.0, 11.0, 11.0]),
    "ours:quant+blocks+pieces": _row(50.0, [13.0, 13.0, 13.0]),  # 32x, over 1.15x
    "ours:auto": _row(100.0, [11.4, 11.5, 11.6]),  # 16x at 1.15x
    "checkpoint": _row(10.0, [10.0, 10.0, 10.0]),  # not ours: never counted
}


def test_auto_against_the_best_fixed_option_within_the_limit():
    found = judge(ROWS, 1.2, 1.1)
    assert found["best"] == "ours:quant"  # blocks+pieces is over the limit
    assert found["met"] is True and found["auto"] == (100.0, 1.15)
    slower = {**ROWS, "ours:auto": _row(100.0, [12.5, 12.5, 12.5])}
    assert judge(slower, 1.2, 1.1)["met"] is False


def test_the_absolute_goal_takes_the_least_within_autograds_time():
    assert absolute(ROWS, 1.15) == ("ours:auto", 16.0, 1.15)
    assert absolute(ROWS, 1.3) == ("ours:quant+blocks+pieces", 32.0, 1.3)
    assert absolute(ROWS, 1.0) == ("ours:nocompress", 1.0, 1.0)
    assert absolute({k: v for k, v in ROWS.items() if k != "autograd"}, 1.2) is None
