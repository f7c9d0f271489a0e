"""vLLM's own unit tests with fastbatch active (issue 52).

Fetches the pinned release's sdist from the package index (checked against
its sha256), extracts its ``tests/`` folder into a cache, writes the few
model files the selected tests read into a local Hugging Face cache (config
files and a tokenizer, no weights; the tests run with ``HF_HUB_OFFLINE=1``),
and runs pytest on the selected files with ``tools/vllm_unit_plugin.py``,
which activates fastbatch through vLLM's own plugin loader.

Modes (``--mode``, several allowed, run in order):

- ``stock``: no fastbatch; with ``--record`` the outcomes are written to
  ``tests/vllm_unit/stock-<release>.json`` (once per pinned release);
- ``fastbatch``: ``FASTBATCH=1``;
- ``verify``: ``FASTBATCH=1 FASTBATCH_VERIFY=1``.

The rule, checked for ``fastbatch`` and ``verify``: every test that passed
stock (the stored outcomes) passes, except those excused in
``tests/vllm_unit/excused.json``; the pieces' counters moved
(``fastbatch.stats()``, summed over the test processes: at least one of the
scheduler's pieces and one of the output processor's took work); under
``verify`` calls were checked and no divergence was found.

fastbatch must be installed where pytest runs, so that its
``vllm.general_plugins`` entry point exists (tox installs the wheel); for a
source checkout, ``--link-source`` registers this tree in the running
interpreter's site-packages (a ``.pth`` and a ``dist-info`` with the entry
point; use it in a virtualenv of your own).

    python tools/vllm_unit_tests.py --release 0.33.0 --mode fastbatch --mode verify
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import resource
import subprocess
import sys
import sysconfig
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "vllm_unit"

# The sdists, pinned by hash (the index's simple API gives both).
SDISTS = {
    "0.33.0": ("https://files.pythonhosted.org/packages/f7/25/"
               "aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz",
               "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"),
    "0.34.0": ("https://files.pythonhosted.org/packages/92/21/"
               "6e0b077dc4a0b28f5a8ce8bb352a38d7196650d681fd4faa87f8dc622eff/vllm-0.34.0.tar.gz",
               "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113"),
}

# Meta's llama-models wheel ships the Llama 3 tokenizer (tiktoken's format):
# the tokenizer that tests/v1/engine reads as meta-llama/Llama-3.2-1B.
LLAMA_MODELS_WHEEL = ("https://files.pythonhosted.org/packages/3e/da/"
                      "36302a2846e4123dc43cd913228ea3a5efd2a56e2f8942f4cf54114745ed/"
                      "llama_models-0.3.0-py3-none-any.whl",
                      "7f77f78ff13fca09f70d76a376aff6414cd901623fb9d57e69c2f8367a73032f")

# The files that run, per release: those of tests/v1/core/ in which a
# replaced function took work with FASTBATCH=1 (measured per file by the
# plugin's ``by_file``, 2026-12-07), less test_prefix_caching.py (83 s of CPU
# a mode for after_schedule alone, which test_scheduler.py reaches too), and
# the files the issue names.  Files whose only counter was allocate_slots'
# ``stock_allocations`` (the installed method handing every call to vLLM's:
# test_partial_prefix_cache_hits.py, test_kv_cache_utils.py,
# test_mamba_align_chunk_split.py, test_contiguous_kv_packing.py,
# prefix_cache/test_mamba_eagle_resume_checkpoint.py) are left out, as are
# those where nothing moved; docs/testing.md lists them.
SELECTION = {
    "0.33.0": [
        "tests/v1/core/test_scheduler.py",
        "tests/v1/core/test_async_scheduler.py",
        "tests/v1/core/test_deferred_block_free.py",
        "tests/v1/core/test_prefix_replay.py",
        "tests/v1/core/test_swa_inflight_window_free.py",
        "tests/v1/core/test_worker_slot_overflow.py",
        "tests/v1/engine/test_output_processor.py",
        "tests/v1/engine/test_logprobs_processor.py",
        "tests/v1/worker/test_gpu_input_batch.py",
    ],
}
SELECTION["0.34.0"] = [f for f in SELECTION["0.33.0"]
                       if f != "tests/v1/worker/test_gpu_input_batch.py"]

# Pieces of which at least one must have taken work, per group: a run in
# which nothing acted proves nothing.
MUST_MOVE = {
    "scheduler": {"schedule_running": "requests", "update_from_output": "fast_outputs",
                  "allocate_slots": "direct_allocations", "cached_requests": "requests",
                  "after_schedule": "requests"},
    "output processor": {"process_outputs": "handled", "update_sample_logprobs": "positions",
                         "detokenizer_update": "tokens"},
}

# config.json files (no weights) of the models the selected tests name.
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 128256,
}
OPT_125M = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_dropout": 0.0,
    "activation_function": "relu", "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072,
    "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
    "torch_dtype": "float16", "use_cache": True, "vocab_size": 50272,
    "word_embed_proj_dim": 768,
}
MODELS = {"meta-llama/Llama-3.2-1B": LLAMA_3_2_1B, "facebook/opt-125m": OPT_125M}
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                  "<|python_tag|>", "<|image|>"]


def log(message: str) -> None:
    print(f"[vllm-unit] {message}", flush=True)


def fetch(url: str, sha256: str | None, dest: Path) -> bytes:
    if dest.exists():
        data = dest.read_bytes()
    else:
        log(f"fetching {url}")
        with urllib.request.urlopen(url, timeout=300) as response:
            data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256:
        dest.unlink(missing_ok=True)
        raise SystemExit(f"{url}: sha256 {digest}, pinned {sha256}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if not dest.exists():
        dest.write_bytes(data)
    return data


def tests_tree(release: str, cache: Path) -> Path:
    """The release's sdist ``tests/`` (and ``pyproject.toml``, pytest's
    settings) under ``cache``; vLLM itself is the installed one."""
    root = cache / f"vllm-{release}"
    marker = root / ".extracted"
    if marker.exists():
        return root
    url, sha256 = SDISTS[release]
    data = fetch(url, sha256, cache / f"vllm-{release}.tar.gz")
    prefix = f"vllm-{release}/"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [m for m in tar.getmembers()
                   if m.name.startswith(prefix + "tests/") or m.name == prefix + "pyproject.toml"]
        tar.extractall(cache, members=members, filter="data")
    marker.write_text(sha256 + "\n")
    return root


def llama3_tokenizer(cache: Path) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json of the Llama 3 tokenizer, from
    llama-models' ``tokenizer.model`` (base64 token, rank a line)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    url, sha256 = LLAMA_MODELS_WHEEL
    wheel = fetch(url, sha256, cache / url.rsplit("/", 1)[1])
    with zipfile.ZipFile(io.BytesIO(wheel)) as zf:
        text = zf.read("llama_models/llama3/tokenizer.model").decode()
    ranks = {}
    for line in text.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    byte_encoder = bytes_to_unicode()

    def as_str(b: bytes) -> str:
        return "".join(byte_encoder[c] for c in b)

    # transformers' TikTokenConverter, without tiktoken
    merges = []
    for token, rank in ranks.items():
        local = [(token[:i], token[i:], rank) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        merges.extend(sorted(local, key=lambda x: (ranks[x[0]], ranks[x[1]])))
    merges.sort(key=lambda m: m[2])
    tokenizer = Tokenizer(BPE({as_str(t): r for t, r in ranks.items()},
                              [(as_str(a), as_str(b)) for a, b, _ in merges], fuse_unk=False))
    tokenizer.model.ignore_merges = True
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    special = LLAMA3_SPECIAL + [f"<|reserved_special_token_{2 + i}|>"
                                for i in range(256 - len(LLAMA3_SPECIAL))]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                  for t in special])
    bos = len(ranks)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<|end_of_text|>", "model_max_length": 131072,
              "clean_up_tokenization_spaces": True,
              "model_input_names": ["input_ids", "attention_mask"]}
    return {"tokenizer.json": tokenizer.to_str(), "tokenizer_config.json": json.dumps(config)}


def hf_cache(cache: Path) -> Path:
    """A Hugging Face cache with the models' config files (and Llama 3.2's
    tokenizer), laid out as the hub client lays it out."""
    home = cache / "hf"
    marker = home / ".written"
    if marker.exists():
        return home
    for name, config in MODELS.items():
        repo = home / "hub" / ("models--" + name.replace("/", "--"))
        revision = hashlib.sha1(name.encode()).hexdigest()
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
        files = {"config.json": json.dumps(config, indent=1)}
        if name == "meta-llama/Llama-3.2-1B":
            files.update(llama3_tokenizer(cache))
        for filename, content in files.items():
            (snapshot / filename).write_text(content)
    marker.write_text("1\n")
    return home


def link_source() -> None:
    """Register this source tree in the running interpreter's site-packages:
    a ``.pth`` and a ``dist-info`` with fastbatch's entry point, so that
    vLLM's plugin loader finds it as it finds an installed fastbatch."""
    if sys.prefix == sys.base_prefix:
        raise SystemExit("--link-source: run it with a virtualenv's python")
    site = Path(sysconfig.get_paths()["purelib"])
    info = site / "fastbatch-0.0.0+source.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fastbatch\n"
                                   "Version: 0.0.0+source\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nfastbatch = fastbatch.vllm_plugin:register\n")
    (info / "RECORD").write_text("")
    (site / "fastbatch-source.pth").write_text(f"{ROOT}\n")
    log(f"linked {ROOT} into {site}")


def _children_cpu() -> float:
    """CPU seconds (user and system) of the finished child processes."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_pytest(release: str, mode: str, tree: Path, hf_home: Path, out: Path,
               workers: int, extra: list[str], files: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.json"):
        old.unlink()
    env = dict(os.environ)
    for name in list(env):
        if name.startswith("FASTBATCH"):
            del env[name]
    env.update({
        "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "VLLM_TARGET_DEVICE": "cpu", "FASTBATCH_UNIT_OUT": str(out),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tools"),
                                                    env.get("PYTHONPATH")])),
    })
    if mode in ("fastbatch", "verify"):
        env["FASTBATCH"] = "1"
    if mode == "verify":
        env["FASTBATCH_VERIFY"] = "1"
        env["FASTBATCH_VERIFY_DIR"] = str(out / "reproducers")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "vllm_unit_plugin",
               "-q", "-rf", "--no-header", "-o", "addopts="]
    if workers > 1:
        command += ["-n", str(workers)]
    command += files + extra
    log(f"{release} {mode}: {' '.join(command[1:])}")
    start, cpu = time.monotonic(), _children_cpu()
    code = subprocess.call(command, cwd=tree, env=env)
    seconds, cpu = time.monotonic() - start, _children_cpu() - cpu
    log(f"{release} {mode}: pytest exit {code}, {seconds:.0f} s wall, {cpu:.0f} s CPU")
    path = out / "outcomes.json"
    if not path.exists():
        raise SystemExit(f"{mode}: pytest wrote no outcomes (exit {code})")
    result = json.loads(path.read_text())
    result["statuses"] = [json.loads(p.read_text()) for p in sorted(out.glob("status-*.json"))]
    result["seconds"], result["cpu_seconds"] = round(seconds), round(cpu)
    return result


def summed(statuses: list[dict], key: str) -> dict:
    total: dict = {}
    for status in statuses:
        for piece, counters in status[key].items():
            into = total.setdefault(piece, {})
            for name, value in counters.items():
                into[name] = into.get(name, 0) + value
    return total


def check(release: str, mode: str, result: dict, stock: dict, excused: dict) -> list[str]:
    problems = []
    outcomes = result["outcomes"]
    for test, was in stock["outcomes"].items():
        if was != "passed":
            continue
        now = outcomes.get(test, "not run")
        if now == "passed":
            continue
        if test in excused:
            log(f"excused ({now}): {test}: {excused[test]}")
            continue
        problems.append(f"{test}: passed stock, {now} with {mode}")
    new = sorted(set(outcomes) - set(stock["outcomes"]))
    if new:
        problems.append(f"{len(new)} tests not in the stock outcomes (record them again): "
                        f"{new[:5]}")
    statuses = [s for s in result["statuses"] if s.get("installed")]
    if not statuses:
        problems.append(f"{mode}: fastbatch was not installed in any test process")
        return problems
    stats = summed(statuses, "stats")
    moved = {piece: counters for piece, counters in stats.items() if any(counters.values())}
    log(f"{mode}: counters that moved: {json.dumps(moved, sort_keys=True)}")
    for group, pieces in MUST_MOVE.items():
        if not any(stats.get(piece, {}).get(counter, 0) for piece, counter in pieces.items()):
            problems.append(f"{mode}: no {group} piece took any work ({sorted(pieces)})")
    if mode == "verify":
        checked = {p: sum(s["verify"]["checked"][p] for s in statuses)
                   for p in statuses[0]["verify"]["checked"]}
        diverged = {p: sum(s["verify"]["divergences"][p] for s in statuses)
                    for p in statuses[0]["verify"]["divergences"]}
        log(f"verify: checked {json.dumps({p: n for p, n in checked.items() if n})}")
        if not any(checked.values()):
            problems.append("verify: no call was checked")
        if any(diverged.values()):
            problems.append(f"verify: divergences {({p: n for p, n in diverged.items() if n})}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--release", default=None,
                        help="the vLLM release whose tests run (default: the installed one)")
    parser.add_argument("--mode", action="append", choices=["stock", "fastbatch", "verify"])
    parser.add_argument("--record", action="store_true",
                        help="with --mode stock: store the outcomes in tests/vllm_unit/")
    parser.add_argument("--cache", default=os.environ.get(
        "FASTBATCH_UNIT_CACHE", str(Path.home() / ".cache" / "fastbatch-vllm-unit")))
    parser.add_argument("--out", default=None, help="where each mode's results go")
    parser.add_argument("-n", "--workers", type=int, default=2, help="pytest-xdist workers")
    parser.add_argument("--files", nargs="*", default=None,
                        help="run these files instead of the selection (no checks)")
    parser.add_argument("--link-source", action="store_true",
                        help="register this source tree's entry point in this interpreter")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args()
    if args.link_source:
        link_source()
        if not args.mode:
            return 0
    import vllm

    installed = vllm.__version__
    release = args.release or installed
    if release != installed:
        raise SystemExit(f"--release {release}, but vLLM {installed} is installed")
    if release not in SDISTS:
        raise SystemExit(f"no pinned sdist for vLLM {release}: add it to SDISTS")
    cache = Path(args.cache)
    tree = tests_tree(release, cache)
    hf_home = hf_cache(cache)
    files = args.files or SELECTION[release]
    out_root = Path(args.out or cache / "results" / release)
    stock_path = DATA / f"stock-{release}.json"
    excused = json.loads((DATA / "excused.json").read_text()).get(release, {})
    failed = False
    for mode in args.mode or ["fastbatch", "verify"]:
        result = run_pytest(release, mode, tree, hf_home, out_root / mode, args.workers,
                            args.pytest_args, files)
        counts: dict = {}
        for outcome in result["outcomes"].values():
            counts[outcome] = counts.get(outcome, 0) + 1
        log(f"{release} {mode}: {counts}, {result['seconds']} s wall, "
            f"{result['cpu_seconds']} s CPU")
        if mode == "stock":
            if args.record:
                sdist = SDISTS[release]
                stock_path.write_text(json.dumps({
                    "release": release, "sdist": sdist[0], "sha256": sdist[1],
                    "files": files, "outcomes": result["outcomes"]}, indent=1) + "\n")
                log(f"wrote {stock_path}")
            continue
        if args.files:
            continue
        stock = json.loads(stock_path.read_text())
        if stock["files"] != files:
            log(f"{stock_path.name} was recorded on other files: record it again")
            failed = True
        problems = check(release, mode, result, stock, excused)
        for problem in problems:
            log(f"FAIL {problem}")
        failed |= bool(problems)
        if not problems:
            log(f"{release} {mode}: the rule holds: every test that passed stock passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
