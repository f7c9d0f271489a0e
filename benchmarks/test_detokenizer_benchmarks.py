"""benchmarks/detokenizer.py runs, on a small grid: the two sides give the
same texts and token ids (the script exits otherwise) and a row per length."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "detokenizer.py"


def test_the_detokenizer_benchmark_runs_and_compares(tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), "--requests", "3", "--lengths", "16", "200",
                    "--timed", "8", "--rounds", "1", "--out", str(tmp_path)], check=True,
                   capture_output=True)
    report = json.loads((tmp_path / "detokenizer.json").read_text())
    assert [row["length"] for row in report["results"]] == [16, 200]
    for row in report["results"]:
        assert row["characters"] > row["length"] // 2
        assert row["stock"]["median_us"] > 0 and row["fastbatch"]["median_us"] > 0
