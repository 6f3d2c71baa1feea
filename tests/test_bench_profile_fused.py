"""bench/profile_fused.py names the numba functions ``perf`` samples: its symbol map and its
reading of numba's mangled names (``perf`` itself is not on every machine, so the profile is
not run here)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numba

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("profile_fused",
                                                  ROOT / "bench" / "profile_fused.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mangled_numba_names_read_as_module_and_function():
    short_name = _module().short_name
    mangled = ("_ZN9attention10_cpu_fused12_probs_ratioB4v139B92c8tJTIeFIjxB2IKSgI4Crv"
               "E5ArrayIfLi2E1C7mutable7alignedE")
    assert short_name(mangled) == "attention._cpu_fused._probs_ratio"
    assert short_name("sgemm_small_kernel_nn_SKYLAKEX") == "sgemm_small_kernel_nn_SKYLAKEX"


def test_the_symbol_map_holds_a_function_compiled_in_this_process(tmp_path):
    @numba.njit(cache=False)
    def twice_plus_one(x):
        return 2 * x + 1

    assert twice_plus_one(3) == 7
    (cres,) = twice_plus_one.overloads.values()
    address = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    path = tmp_path / "perf.map"
    assert _module().write_symbol_map(str(path)) >= 1
    entries = {}
    for line in path.read_text().splitlines():
        start, size, name = line.split(" ", 2)
        entries[int(start, 16)] = (int(size, 16), name)
    size, name = entries[address]
    assert name == cres.fndesc.llvm_func_name and 0 < size <= 1 << 20
