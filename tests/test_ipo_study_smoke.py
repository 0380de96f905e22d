"""benchmarks/ipo_study.py --smoke: two real `tandem rl` runs (IPO and IcePop, async 1, bf16 inference against an
fp32 trainer) go through the study's code, record every step's series and draw its plots."""

from __future__ import annotations

import json
import sys

import pytest

from support.paths import REPO
from tandem.testing.progress import run_while_progressing


@pytest.mark.slow
def test_smoke_records_every_series_and_plots(tmp_path):
    pytest.importorskip("matplotlib", reason="the study's plots need matplotlib (the dev extra)")
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "benchmarks" / "ipo_study.py"), "--smoke", "--out-dir", str(out),
               "--work-dir", str(tmp_path / "work")]  # fmt: skip
    result = run_while_progressing(command, watch=[tmp_path / "work"])
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert [r["run"]["loss"] for r in results] == ["ipo-0.3", "icepop"]
    for r in results:
        assert not r["error"], r["error"]
        assert r["steps"] == [1, 2, 3]
        for series in ("reward", "masked_low", "masked_high", "off_policy_kl"):
            assert len(r[series]) == 3 and all(isinstance(v, float) for v in r[series]), (series, r[series])
        assert all(0.0 <= v <= 1.0 for v in r["reward"] + r["masked_low"] + r["masked_high"])
    for plot in ("reward.png", "masked.png", "kl.png"):
        assert (out / plot).stat().st_size > 5_000
    assert "ipo-0.3-async1-bf16" in result.stdout and "collapsed" in result.stdout
