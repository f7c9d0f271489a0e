"""Check what `python -m build` made: a platform wheel with every piece (patch
module, compiled module, stub, twin) and py.typed; an sdist with the .pyx
sources and no generated C."""

import sys
import tarfile
import zipfile
from pathlib import Path


def main(dist: Path) -> None:
    (wheel,) = dist.glob("fastbatch-*.whl")
    (sdist,) = dist.glob("fastbatch-*.tar.gz")
    assert "-none-any" not in wheel.name, f"{wheel.name} is not a platform wheel"
    names = zipfile.ZipFile(wheel).namelist()
    # The pieces, as fastbatch.registry finds them: the public patch modules.
    package = Path(__file__).parent.parent / "fastbatch"
    pieces = sorted(p.stem for p in (package / "patches").glob("[!_]*.py"))
    assert pieces, "no piece found beside this script's project"
    for required in ("fastbatch/py.typed", "fastbatch/vllm_plugin.py", "fastbatch/registry.py",
                     "fastbatch/__main__.py", "fastbatch/model_runner.py", "fastbatch/_verify.py",
                     "fastbatch/patches/_patch.py", "fastbatch/patches/_releases.py",
                     *(f"fastbatch/{folder}/{piece}{suffix}" for piece in pieces
                       for folder, suffix in (("patches", ".py"), ("_kernels", ".pyi"),
                                              ("_reference", ".py")))):
        assert required in names, f"{required} missing from {wheel.name}"
    for piece in pieces:
        assert any(n.startswith(f"fastbatch/_kernels/{piece}.") and n.endswith(".so")
                   for n in names), f"no compiled {piece} in {wheel.name}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "vllm.general_plugins" in zipfile.ZipFile(wheel).read(entry_points).decode()
    with tarfile.open(sdist) as archive:
        members = archive.getnames()
    for piece in pieces:
        assert any(m.endswith(f"fastbatch/_kernels/{piece}.pyx") for m in members), \
            f"no {piece}.pyx in sdist"
    assert any(m.endswith("fastbatch/_kernels/_common.pxd") for m in members), "no .pxd in sdist"
    assert not any(m.endswith((".c", ".so")) for m in members), "build output in sdist"
    print(f"ok: {wheel.name} ({len(names)} files), {sdist.name} ({len(members)} members)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
