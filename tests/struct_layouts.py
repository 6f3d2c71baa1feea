"""Compile-time checks that C structs a kernel takes by value have their NumPy dtypes' layouts.

:func:`layout_asserts` turns :class:`abftgemm.cuda_structs.KernelStruct` declarations into
``static_assert``\\ s: each struct's size, the number of its fields (a structured binding of
exactly that many names), each field's offset (``__builtin_offsetof``) and its C type. Appended to
a kernel source, they compile only where the compiler lays every struct out as NumPy does: a field
added, dropped, moved, resized or retyped on either side fails to compile, naming the field. Both
compilers that build the kernels take them: the host C++ compiler of the CPU run and NVRTC.
"""
from __future__ import annotations

from abftgemm.cuda_structs import KernelStruct

_C_TYPES = {"int8": "signed char", "int16": "short", "int32": "int", "int64": "long long",
            "uint8": "unsigned char", "uint16": "unsigned short", "uint32": "unsigned int",
            "uint64": "unsigned long long", "float32": "float", "float64": "double"}
_TRAITS = """
namespace layout_check {
template <typename A, typename B> struct same { static constexpr bool value = false; };
template <typename A> struct same<A, A> { static constexpr bool value = true; };
}  // namespace layout_check
"""


def layout_asserts(structs: tuple[KernelStruct, ...]) -> str:
    """C++ that compiles only where each of ``structs`` is laid out as its NumPy dtype."""
    lines = [_TRAITS]
    for s in structs:
        names = s.dtype.names
        lines.append(f'static_assert(sizeof({s.c_name}) == {s.dtype.itemsize}, '
                     f'"sizeof({s.c_name}) is not {s.dtype.itemsize}, its NumPy itemsize");')
        binding = ", ".join(f"f{i}" for i in range(len(names)))
        lines.append(f"[[maybe_unused]] inline void layout_check_{s.c_name.replace(':', '_')}"
                     f"({s.c_name} s) {{ auto [{binding}] = s; }}  // exactly {len(names)} fields")
        for name in names:
            dtype, offset = s.dtype.fields[name][:2]
            member = f"{s.c_name}::{name}"
            lines.append(f'static_assert(__builtin_offsetof({s.c_name}, {name}) == {offset}, '
                         f'"{member} is not at offset {offset}, as in NumPy");')
            kind = _C_TYPES[dtype.name]
            lines.append(f"static_assert(layout_check::same<decltype({member}), {kind}>::value, "
                         f'"{member} is not {kind}, as in NumPy");')
    return "\n".join(lines) + "\n"


def swapped(struct: KernelStruct, a: str, b: str) -> KernelStruct:
    """``struct`` with fields ``a`` and ``b`` swapped: a drifted declaration the checks must
    refuse."""
    names = list(struct.dtype.names)
    i, j = names.index(a), names.index(b)
    names[i], names[j] = names[j], names[i]
    return KernelStruct(struct.c_name, [(n, struct.dtype.fields[n][0].name) for n in names])
