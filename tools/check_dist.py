"""Check what `python -m build` made: a platform wheel with the compiled kernel,
its stub and py.typed; an sdist with the .pyx source and no generated C."""

import sys
import tarfile
import zipfile
from pathlib import Path


def main(dist: Path) -> None:
    (wheel,) = dist.glob("fastbatch-*.whl")
    (sdist,) = dist.glob("fastbatch-*.tar.gz")
    assert "-none-any" not in wheel.name, f"{wheel.name} is not a platform wheel"
    names = zipfile.ZipFile(wheel).namelist()
    for required in ("fastbatch/py.typed", "fastbatch/_kernel.pyi", "fastbatch/vllm_plugin.py",
                     "fastbatch/__main__.py", "fastbatch/model_runner.py",
                     "fastbatch/patches/_patch.py",
                     "fastbatch/patches/async_output_token_ids.py",
                     "fastbatch/patches/async_spec_token_ids.py",
                     "fastbatch/patches/penalty_output_tokens.py"):
        assert required in names, f"{required} missing from {wheel.name}"
    assert any(n.startswith("fastbatch/_kernel.") and n.endswith(".so") for n in names), \
        f"no compiled kernel in {wheel.name}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "vllm.general_plugins" in zipfile.ZipFile(wheel).read(entry_points).decode()
    with tarfile.open(sdist) as archive:
        members = archive.getnames()
    assert any(m.endswith("fastbatch/_kernel.pyx") for m in members), "no .pyx in sdist"
    assert not any(m.endswith((".c", ".so")) for m in members), "build output in sdist"
    print(f"ok: {wheel.name} ({len(names)} files), {sdist.name} ({len(members)} members)")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
