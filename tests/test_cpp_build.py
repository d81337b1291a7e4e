"""kernels/cpp_build.py: a cached build is imported without the builder; an unusable one (a
build cut short) is rebuilt, never a failure; a lock left by a killed build does not hang the
next one."""

from __future__ import annotations

import pytest

from specserve.kernels import cpp_build

pytestmark = pytest.mark.slow  # a real compile, tens of seconds on 2 cores

SOURCE = """#include <torch/extension.h>
int two() { return 2; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("two", &two); }
"""


def test_cached_build_is_imported_and_a_broken_one_rebuilt(tmp_path, monkeypatch):
    src = tmp_path / "two.cpp"
    src.write_text(SOURCE)
    build = tmp_path / "build"
    build.mkdir()
    (build / "specserve_test_two.so").write_bytes(b"not a shared object")
    (build / "lock").write_text("")  # torch's lock file, as a killed build leaves it
    module = cpp_build.load_extension("specserve_test_two", [src], build, ["-O1"])
    assert module.two() == 2  # rebuilt over the broken file, past the stale lock
    assert not (build / "lock").exists()

    from torch.utils import cpp_extension

    def no_builder(*_a, **_k):
        raise AssertionError("a current cached build must be imported, not rebuilt")

    monkeypatch.setattr(cpp_extension, "load", no_builder)
    (build / "other.so").write_bytes(b"")  # unrelated files in the folder do not matter
    again = cpp_build.load_extension("specserve_test_two", [src], build, ["-O1"])
    assert again.two() == 2
    with pytest.raises(AssertionError, match="must be imported"):
        cpp_build.load_extension("specserve_test_missing", [src], build, ["-O1"])
