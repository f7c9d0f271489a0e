"""The vLLM plugin: switches, idempotence, version/shape guard, activation check.

Runs on the real vLLM 0.33.0 (tox -e vllm); nothing of vLLM is mocked.  The
"changed target" and "wrong kernel" cases are simulated by putting another
function in place of vLLM's code or of fastbatch's kernel.
"""

import importlib
import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from vllm.v1.sample import rejection_sampler, sampler
from vllm.v1.sample.ops import penalties
from vllm.v1.worker.gpu_input_batch import InputBatch

import fastbatch
from batches import vllm_0_21_method
from fastbatch import _runner_report, registry, vllm_plugin
from fastbatch.patches import _releases
from fastbatch.patches import async_output_token_ids as patch
from fastbatch.patches import async_spec_token_ids as spec_patch
from fastbatch.patches import penalty_output_tokens as penalty_patch
from subprocesses import OUTSIDE_THE_CHECKOUT

pytestmark = pytest.mark.vllm
PIECES = {piece.name: piece for piece in registry.pieces()}
# Every patch of every piece, in the order the plugin applies them, and
# vLLM's code at each target.
ALL_PATCHES = [patch for piece in PIECES.values() for patch in piece.patches]
STOCK = {patch.target: patch.current() for patch in ALL_PATCHES}
STOCK_METHOD = InputBatch.update_async_output_token_ids
STOCK_SPEC_METHOD = InputBatch.update_async_spec_token_ids
STOCK_CONVERT = penalties._convert_to_tensors
STOCK_APPLY_ALL = penalties.apply_all_penalties
BINDINGS = (sampler, rejection_sampler, penalties)  # where apply_all_penalties is called from


def _stock_everywhere():
    return (all(patch.current() is STOCK[patch.target] for patch in ALL_PATCHES)
            and not any(piece.is_applied() for piece in PIECES.values())
            and all(binding.apply_all_penalties is STOCK_APPLY_ALL for binding in BINDINGS))


def _masking_skipped_at():
    """The modules whose apply_all_penalties is fastbatch's (no masking)."""
    return {binding.__name__ for binding in BINDINGS
            if binding.apply_all_penalties is penalty_patch.apply_all_penalties}


@pytest.fixture(autouse=True)
def stock_vllm(monkeypatch):
    """Every test starts and ends with vLLM's own code in place.

    vLLM 0.33.0's GPU wheel on this GPU-less machine says PIN_MEMORY=True, so
    stock penalties would fail (and the penalties patch's activation check
    with them, see test_penalties_stay_stock_where_stock_cannot_pin): off here.
    """
    for piece in PIECES.values():
        piece.revert()
    assert _stock_everywhere()
    monkeypatch.setattr(penalties, "PIN_MEMORY", False)
    monkeypatch.delenv("FASTBATCH_DISABLE", raising=False)
    yield
    for piece in PIECES.values():
        piece.revert()  # monkeypatch then undoes the test's own replacements
    _runner_report.PATCH.revert()


@pytest.mark.parametrize("value", [None, "", "0", "false", "No", "off"])
def test_switch_off_leaves_vllm_stock(monkeypatch, logs, value):
    if value is None:
        monkeypatch.delenv("FASTBATCH", raising=False)
    else:
        monkeypatch.setenv("FASTBATCH", value)
    vllm_plugin.register()
    assert _stock_everywhere()
    assert logs.records == []


@pytest.mark.parametrize("value", ["1", "true", "YES", " on ", "force", "FORCE"])
def test_switch_on_installs_once(monkeypatch, logs, value):
    monkeypatch.setenv("FASTBATCH", value)
    vllm_plugin.register()

    def current():
        return tuple(patch.current() for patch in ALL_PATCHES)

    installed = current()
    for patch_, value_ in zip(ALL_PATCHES, installed, strict=True):
        replacement = getattr(patch_.replacement, "__func__", patch_.replacement)
        assert patch_.is_applied() and value_ is replacement, patch_.target
        assert value_ is not STOCK[patch_.target] and value_.__fastbatch__
    assert {p.target: p.original() for p in ALL_PATCHES} == STOCK
    vllm_plugin.register()  # vLLM loads plugins more than once
    vllm_plugin.register()
    assert current() == installed
    assert patch.PATCH.original() is STOCK_METHOD
    assert _masking_skipped_at() == {binding.__name__ for binding in BINDINGS}
    infos = logs.at(logging.INFO)
    # one line per patch, in the registry's order (after_schedule installs
    # AsyncScheduler's method first, the penalties' masking comes after the
    # conversion), then the runner report's hook
    targets = [patch_.target for patch_ in ALL_PATCHES] + [_runner_report.PATCH.target]
    assert len(infos) == len(targets)
    for info, target in zip(infos, targets, strict=True):
        for expected in (fastbatch.__version__, "vLLM 0.33.0", target):
            assert expected in info
    status = vllm_plugin.status()
    assert status["installed"] is True
    assert status["patches"] == dict.fromkeys(PIECES, True)


@pytest.mark.parametrize(("value", "stock"), [
    ("penalty_output_tokens", {"penalty_output_tokens"}),
    ("ASYNC_SPEC_TOKEN_IDS", {"async_spec_token_ids"}),
    ("async_output_token_ids,penalty_output_tokens",
     {"async_output_token_ids", "penalty_output_tokens"}),
    (" async_spec_token_ids  async_output_token_ids ",
     {"async_spec_token_ids", "async_output_token_ids"}),
    (",".join(PIECES), set(PIECES)),
    *[(name, {name}) for name in PIECES],
])
def test_disable_leaves_single_pieces_stock(monkeypatch, logs, value, stock):
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", value)
    vllm_plugin.register()
    assert vllm_plugin.status()["patches"] == {name: name not in stock for name in PIECES}
    for name, piece in PIECES.items():
        for patch_ in piece.patches:
            assert (patch_.current() is STOCK[patch_.target]) == (name in stock), patch_.target
    assert bool(_masking_skipped_at()) == ("penalty_output_tokens" not in stock)
    left_stock = [info for info in logs.at(logging.INFO) if "left stock" in info]
    assert len(left_stock) == len(stock)
    assert logs.at(logging.WARNING) == []


@pytest.mark.parametrize(("old", "new"), sorted(registry.DEPRECATED_NAMES.items()))
def test_deprecated_disable_names_still_work_and_warn(monkeypatch, logs, old, new):
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", old.upper())
    vllm_plugin.register()
    assert vllm_plugin.status()["patches"] == {name: name != new for name in PIECES}
    assert all(patch_.current() is STOCK[patch_.target] for patch_ in PIECES[new].patches)
    (warning,) = logs.at(logging.WARNING)
    assert f"FASTBATCH_DISABLE={old} is deprecated" in warning and repr(new) in warning


def test_disable_with_an_unknown_name_warns(monkeypatch, logs):
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", "penalty, async_spec_token_ids")
    vllm_plugin.register()
    assert vllm_plugin.status()["patches"] == {name: name != "async_spec_token_ids"
                                               for name in PIECES}
    (warning,) = logs.at(logging.WARNING)
    assert "'penalty'" in warning and ", ".join(registry.NAMES) in warning


@pytest.mark.parametrize("value", ["2", "maybe", "enable"])
def test_garbage_value_warns_and_stays_stock(monkeypatch, logs, value):
    monkeypatch.setenv("FASTBATCH", value)
    vllm_plugin.register()
    assert _stock_everywhere()
    (warning,) = logs.at(logging.WARNING)
    assert repr(value) in warning and "stock" in warning


def test_switch_off_imports_nothing_of_vllm():
    """Unset, the plugin does not even import vLLM (or fastbatch's patches)."""
    script = textwrap.dedent("""
        import os, sys
        os.environ.pop("FASTBATCH", None)
        from fastbatch import vllm_plugin
        vllm_plugin.register()
        assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), "vllm"
        assert "fastbatch.patches" not in sys.modules
        print("untouched")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=False, cwd=OUTSIDE_THE_CHECKOUT)
    assert result.returncode == 0, result.stderr
    assert "untouched" in result.stdout


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    (entry_point,) = [ep for ep in entry_points(group="vllm.general_plugins")
                      if ep.name == "fastbatch"]
    assert entry_point.load() is vllm_plugin.register


def test_plugin_loaded_by_vllm_itself(monkeypatch):
    """vLLM's own plugin loader finds and runs fastbatch."""
    script = textwrap.dedent("""
        import os
        os.environ["FASTBATCH"] = "1"
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.v1.worker.gpu_input_batch import InputBatch
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        assert getattr(InputBatch.update_async_output_token_ids, "__fastbatch__", False)
        assert getattr(GPUModelRunner._bookkeeping_sync, "__fastbatch__", False)
        assert getattr(GPUModelRunner._prepare_input_ids, "__fastbatch__", False)
        print("patched by vLLM's loader")
    """)
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", script],
                            capture_output=True, text=True, check=False,
                            cwd=OUTSIDE_THE_CHECKOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "patched by vLLM's loader" in result.stdout


@pytest.mark.parametrize("patch_", ALL_PATCHES, ids=lambda patch_: patch_.target)
def test_guard_accepts_the_installed_vllm(patch_):
    import vllm

    assert patch_.check_target(vllm.__version__, STOCK[patch_.target]) is None


@pytest.mark.parametrize("patch_", [p for p in ALL_PATCHES if p.requires is None],
                         ids=lambda patch_: patch_.target)
def test_guard_refuses_any_changed_target(monkeypatch, logs, patch_):
    """Every target: a function with other code in its place (here one that
    calls vLLM's) is not a verified variant; that piece stays stock, the
    others are installed."""
    stock = STOCK[patch_.target]

    def changed(*args, **kwargs):
        return stock(*args, **kwargs)

    owner = importlib.import_module(patch_.module)
    *parents, attribute = patch_.qualname.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    monkeypatch.setattr(owner, attribute, changed)
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert patch_.current() is changed and not patch_.is_applied()
    piece = PIECES[patch_.name]
    status = vllm_plugin.status()["patches"]
    assert all(status[name] for name in PIECES if name != piece.name)
    # a piece's other patch (AsyncScheduler's override) may stand without it
    assert status[piece.name] is (patch_ is not piece.main)
    warnings = logs.at(logging.WARNING)
    assert warnings and all("not a verified variant" in w for w in warnings)
    assert any(f"the code of {patch_.target} is not a verified variant" in w for w in warnings)


@pytest.mark.parametrize("piece", PIECES.values(), ids=lambda piece: piece.name)
def test_revert_restores_each_piece_alone(monkeypatch, piece):
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    piece.revert()
    assert not piece.is_applied()
    for patch_ in ALL_PATCHES:
        assert (patch_.current() is STOCK[patch_.target]) == (patch_ in piece.patches)
        assert (patch_.original() is None) == (patch_ in piece.patches)
    assert vllm_plugin.status()["patches"] == {name: name != piece.name for name in PIECES}
    piece.revert()  # idempotent
    assert piece.apply()
    assert all(patch_.current() is getattr(patch_.replacement, "__func__", patch_.replacement)
               for patch_ in piece.patches)


def test_guard_refuses_a_changed_spec_method(monkeypatch, logs):
    def changed(self, draft_token_ids):  # vLLM's loop minus the draft cut
        for req_id, spec_ids in zip(self.req_ids, self.sampling_metadata.spec_token_ids,
                                     strict=False):
            prev_index = self.prev_req_id_to_index.get(req_id)
            if spec_ids and prev_index is not None:
                spec_ids[:] = draft_token_ids[prev_index]

    monkeypatch.setattr(InputBatch, "update_async_spec_token_ids", changed)
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert InputBatch.update_async_spec_token_ids is changed
    assert vllm_plugin.status()["patches"] == {name: name != "async_spec_token_ids"
                                               for name in PIECES}
    (warning,) = logs.at(logging.WARNING)
    assert spec_patch.PATCH.target in warning and "not a verified variant" in warning


def test_guard_refuses_penalties_whose_masking_moved(monkeypatch, logs):
    """The replacement folds in apply_all_penalties' -1 masking: if that
    function changes, the patch is not applied, though its target is intact."""
    def without_masking(logits, prompt_token_ids, presence_penalties,
                        frequency_penalties, repetition_penalties, output_token_ids):
        _, vocab_size = logits.shape
        output_tokens_t = penalties._convert_to_tensors(output_token_ids, vocab_size,
                                                        logits.device)
        return penalties.apply_penalties(logits, prompt_token_ids, output_tokens_t,
                                         presence_penalties, frequency_penalties,
                                         repetition_penalties)

    monkeypatch.setattr(penalties, "apply_all_penalties", without_masking)
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert penalties._convert_to_tensors is STOCK_CONVERT
    (warning,) = logs.at(logging.WARNING)
    assert "apply_all_penalties is not a verified variant" in warning
    assert penalty_patch.PATCH.target in warning


def test_masking_is_never_skipped_without_fastbatchs_conversion(logs):
    """The apply_all_penalties without masking is refused unless fastbatch's
    conversion is applied, and reverted with it."""
    for masking in penalty_patch.MASKING_PATCHES:
        assert not masking.apply()
    assert _stock_everywhere()
    errors = logs.at(logging.ERROR)
    assert len(errors) == 3
    assert all("_convert_to_tensors is not applied" in error for error in errors)
    assert PIECES["penalty_output_tokens"].apply()
    assert len(_masking_skipped_at()) == 3
    PIECES["penalty_output_tokens"].revert()
    assert _stock_everywhere()


def test_guard_refuses_a_changed_caller_binding(monkeypatch, logs):
    """A binding that is not vLLM's verified function keeps what it has; the
    other bindings and the conversion are still installed."""
    def changed(*args):  # not vLLM's apply_all_penalties
        return STOCK_APPLY_ALL(*args)

    monkeypatch.setattr(sampler, "apply_all_penalties", changed)
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert sampler.apply_all_penalties is changed
    assert _masking_skipped_at() == {"vllm.v1.sample.rejection_sampler",
                                     "vllm.v1.sample.ops.penalties"}
    assert penalties._convert_to_tensors is penalty_patch._convert_to_tensors
    (warning,) = logs.at(logging.WARNING)
    assert "vllm.v1.sample.sampler.apply_all_penalties" in warning
    assert "not a verified variant" in warning


def test_penalties_stay_stock_where_stock_cannot_pin(monkeypatch, logs):
    """PIN_MEMORY=True without an accelerator: stock would fail on its first
    use, so does the activation check (the flag really reaches torch), and
    the penalties stay stock; the other patches are unaffected."""
    monkeypatch.setattr(penalties, "PIN_MEMORY", True)
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert penalties._convert_to_tensors is STOCK_CONVERT
    assert vllm_plugin.status()["patches"] == {name: name != "penalty_output_tokens"
                                               for name in PIECES}
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and penalty_patch.PATCH.target in error


def test_patched_penalties_pin_as_stock_pins(monkeypatch):
    """Once installed, the replacement reads PIN_MEMORY at call time, as stock does."""
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    rows = [[1, -1, 3]]
    assert not penalties._convert_to_tensors(rows, 10, "cpu").is_pinned()
    monkeypatch.setattr(penalties, "PIN_MEMORY", True)
    with pytest.raises(RuntimeError):  # no accelerator here to pin with
        STOCK_CONVERT(rows, 10, "cpu")
    with pytest.raises(RuntimeError):
        penalties._convert_to_tensors(rows, 10, "cpu")


@pytest.mark.parametrize("broken", ["async_spec_token_ids", "penalty_output_tokens",
                                    "bookkeeping_sync"])
def test_activation_check_refuses_wrong_new_kernels(monkeypatch, logs, broken):
    if broken == "bookkeeping_sync":
        def wrong(req_ids, requests, num_sampled, valid, discarded, num_tokens, *rest):
            for req_id in req_ids[:num_sampled]:  # forgets the arrays
                requests[req_id].output_token_ids.append(-1)
        monkeypatch.setattr(fastbatch, "append_sampled_token_ids", wrong)
    elif broken == "async_spec_token_ids":
        def wrong(req_ids, prev, spec_token_ids, draft_token_ids):
            for ids in spec_token_ids or ():
                if ids:
                    ids[0] = 0
        monkeypatch.setattr(fastbatch, "update_async_spec_token_ids", wrong)
    else:
        def wrong(rows, vocab_size, pin_memory=False):  # forgets the masking
            import torch
            return torch.tensor([list(r) + [vocab_size] * (max(map(len, rows)) - len(r))
                                 for r in rows], dtype=torch.int64)
        monkeypatch.setattr(fastbatch, "output_tokens_tensor", wrong)
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert vllm_plugin.status()["patches"] == {name: name != broken for name in PIECES}
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and PIECES[broken].main.target in error


def test_guard_refuses_a_changed_method(monkeypatch, logs):
    monkeypatch.setattr(InputBatch, "update_async_output_token_ids", vllm_0_21_method)
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert InputBatch.update_async_output_token_ids is vllm_0_21_method
    (warning,) = logs.at(logging.WARNING)
    assert "not a verified variant" in warning and "FASTBATCH=force" in warning


# The release after the newest one the release tool read: no patch accepts it.
_NEWEST = max(_releases.PUBLISHED["vllm"], key=lambda v: tuple(map(int, v.split("."))))
UNKNOWN_VERSION = f"{_NEWEST.split('.')[0]}.{int(_NEWEST.split('.')[1]) + 1}.0"


def test_guard_refuses_an_unknown_version(monkeypatch, logs):
    import vllm

    monkeypatch.setattr(vllm, "__version__", UNKNOWN_VERSION)
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert _stock_everywhere()
    warnings = logs.at(logging.WARNING)
    # one per patch (the penalties' masking is not tried without its conversion),
    # and one for the runner report's hook
    assert len(warnings) == len([p for p in ALL_PATCHES if p.requires is None]) + 1
    assert all(f"vLLM {UNKNOWN_VERSION} is not a verified version" in w for w in warnings)


def test_guard_refuses_a_missing_method(monkeypatch, logs):
    monkeypatch.delattr(InputBatch, "update_async_output_token_ids")
    monkeypatch.setenv("FASTBATCH", "force")
    vllm_plugin.register()
    assert not hasattr(InputBatch, "update_async_output_token_ids")
    assert any("does not exist" in w for w in logs.at(logging.WARNING))


def test_force_patches_an_unknown_version(monkeypatch, logs):
    import vllm

    monkeypatch.setattr(vllm, "__version__", UNKNOWN_VERSION)
    monkeypatch.setenv("FASTBATCH", "force")
    vllm_plugin.register()
    assert InputBatch.update_async_output_token_ids is patch.update_async_output_token_ids
    assert vllm_plugin.status()["patches"] == dict.fromkeys(PIECES, True)
    assert _masking_skipped_at() == {binding.__name__ for binding in BINDINGS}
    # every patch, and the runner report's hook
    assert sum("patching anyway" in w for w in logs.at(logging.WARNING)) == (
        len(ALL_PATCHES) + 1)


def test_force_still_needs_the_activation_check(monkeypatch, logs):
    """The 0.21 forward scan disagrees with fastbatch on the synthetic batch."""
    monkeypatch.setattr(InputBatch, "update_async_output_token_ids", vllm_0_21_method)
    monkeypatch.setenv("FASTBATCH", "force")
    vllm_plugin.register()
    assert InputBatch.update_async_output_token_ids is vllm_0_21_method
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error


@pytest.mark.parametrize("broken", ["wrong result", "raises"])
def test_activation_check_refuses_a_wrong_kernel(monkeypatch, logs, broken):
    def wrong_kernel(req_ids, prev, outputs, sampled, copy_ready):
        if broken == "raises":
            raise ValueError("boom")
        for ids in outputs:
            if ids:
                ids[-1] = 0

    monkeypatch.setattr(fastbatch, "update_async_output_token_ids", wrong_kernel)
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert InputBatch.update_async_output_token_ids is STOCK_METHOD
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and "stock" in error


def test_revert_restores_the_original(monkeypatch):
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert vllm_plugin.status()["installed"] is True
    for piece in PIECES.values():
        piece.revert()
    assert _stock_everywhere()
    assert patch.PATCH.original() is None
    assert vllm_plugin.status()["installed"] is False


def test_patched_method_counts_its_work(monkeypatch):
    """The counters show that real placeholders were replaced by the fast path."""
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    (batch, *_) = patch._synthetic_batches(torch)
    InputBatch.update_async_output_token_ids(batch)
    stats = vllm_plugin.status()["stats"]["async_output_token_ids"]
    assert stats["calls"] == 1 and stats["requests_updated"] == 4
    assert stats["tokens_written"] == 4


def test_ray_workers_get_the_switch_from_the_driver(monkeypatch):
    """The README's Ray claim, checked on vLLM's own code (Ray itself is not installed).

    The Ray executor sends the driver's environment (both switches) minus worker-specific
    variables (get_driver_env_vars), and RayWorkerProc.initialize_worker
    applies it before the worker starts, which is when plugins are loaded.
    """
    import ast
    import pathlib

    import vllm
    from vllm.v1.executor.ray_env_utils import get_driver_env_vars
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", "penalty_output_tokens")
    sent = get_driver_env_vars(WORKER_SPECIFIC_ENV_VARS)
    assert sent["FASTBATCH"] == "1" and sent["FASTBATCH_DISABLE"] == "penalty_output_tokens"

    source = pathlib.Path(vllm.__file__).parent / "v1/executor/ray_executor_v2.py"
    (initialize_worker,) = [
        node for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "initialize_worker"]
    first_line = {}
    for node in ast.walk(initialize_worker):
        if isinstance(node, ast.Call):
            first_line.setdefault(ast.unparse(node.func), node.lineno)
    assert first_line["os.environ.setdefault"] < first_line["super().__init__"]
