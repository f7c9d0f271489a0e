"""benchmarks/host_path.py once, small and untimed: each workload runs on the
stand-in engine stock and with ``FASTBATCH=1`` (at a simulated forward time
too), with the same outputs, and the report's figures are filled in."""

import warnings

import host_path
import pytest

import standin_executor as standin

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return standin.make_model_dir(tmp_path_factory.mktemp("host-path-model"))


@pytest.mark.parametrize("workload", host_path.WORKLOADS)
def test_host_path_matches_stock(model, workload):
    stock = host_path.measure(model, workload, 16, 8, 0.0, fast=False)
    fast = host_path.measure(model, workload, 16, 8, 2.0, fast=True)
    assert fast["outputs"] == stock["outputs"]
    assert len(stock["outputs"]) == 16
    assert all(len(ids) == 8 for ids, _ in stock["outputs"].values())
    assert all((logprobs is not None) == (workload == "logprobs")
               for _, logprobs in stock["outputs"].values())
    for report in (stock, fast):
        assert report["request_steps"] >= 16 * 8 / (4 if workload == "spec" else 1)
        assert report["host_us_per_request_step"] > 0
    assert 0.0 <= fast["gpu_wait_share"] <= 1.0
    assert "gpu_wait_share" not in stock
