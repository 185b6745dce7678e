"""Turn MLX's generated Metal source into a C++ translation unit for the shim and runtime.

Three source rewrites make Metal semantics hold in C++ (everything else is the shim header):
- ``threadgroup T name[N];`` declarations become references into the threadgroup's shared arena
  (a no-op address space would make them per-thread locals);
- vector constructors and conversions (``float4(a.xy, b, c)``, ``float4(h4)``,
  ``static_cast<float4>(h4)``) become ``__mtl_make<float, 4>(...)`` (clang has no multi-argument
  ext-vector constructors, and its vector casts reinterpret bits instead of converting);
- MLX's explicit template instantiation is replaced by an entry point the runtime calls per thread.

Known gaps: vector constructors spelled through a template parameter (``T(x)`` with ``T`` a vector
type) and C-style vector casts are not rewritten; ``simdgroup_matrix`` is not emulated (kernels
here do not use it); several declarators in one ``threadgroup`` statement are not supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlx_infer.metal_kernels.emulator.errors import KernelCompileError

_VECTOR_ELEMS = {
    "float": "float", "half": "half", "bfloat": "bfloat16_t", "int": "int", "uint": "uint",
    "short": "short", "ushort": "ushort", "char": "char", "uchar": "uchar", "bool": "bool",
}
_VEC = "|".join(_VECTOR_ELEMS)
_VECTOR_CALL = re.compile(rf"(?<![\w.])(?:static_cast<\s*({_VEC})([234])\s*>|({_VEC})([234]))\s*\(")
_THREADGROUP_DECL = re.compile(
    r"\bthreadgroup\s+((?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?)\s+([A-Za-z_]\w*)\s*((?:\[[^\]]+\]\s*)*);"
)
_INSTANTIATION = re.compile(r"^template\s*\[\[host_name.*?decltype\((\w+)(<.*>)?\)\s*\w+(?:<.*>)?;\s*$", re.M)
_SIGNATURE = re.compile(r"\[\[kernel\]\]\s+void\s+(\w+)\s*\((.*?)\)\s*\{", re.S)
_PARAM = re.compile(r"^(?P<type>.+?)\s*(?P<name>\w+)\s*\[\[(?P<attr>\w+)(?:\((?P<index>\d+)\))?\]\]$")

_UINT3_ATTRS = {
    "grid_size", "threads_per_threadgroup", "threadgroups_per_grid", "thread_position_in_grid",
    "thread_position_in_threadgroup", "threadgroup_position_in_grid", "threads_per_grid",
    "dispatch_threads_per_threadgroup",
}
_ALIASES = {"threads_per_grid": "grid_size", "dispatch_threads_per_threadgroup": "threads_per_threadgroup",
            "thread_execution_width": "threads_per_simdgroup",
            "dispatch_simdgroups_per_threadgroup": "simdgroups_per_threadgroup",
            "dispatch_quadgroups_per_threadgroup": "quadgroups_per_threadgroup"}


@dataclass(frozen=True)
class Param:
    """One kernel parameter: a buffer (``index`` set) or a thread-position attribute."""

    name: str
    type: str
    attr: str
    index: int | None

    @property
    def is_reference(self) -> bool:
        return self.type.rstrip().endswith("&")


@dataclass(frozen=True)
class Translation:
    cpp: str
    params: tuple[Param, ...]
    source_lines: tuple[str, ...]  # the rewritten Metal source, for naming lines in reports


def translate(generated: str) -> Translation:
    match = _SIGNATURE.search(generated)
    if match is None:
        raise KernelCompileError("no [[kernel]] function in the generated source")
    function, param_text = match.group(1), match.group(2)
    params = tuple(_parse_param(p.strip()) for p in param_text.split(",\n") if p.strip())
    inst = _INSTANTIATION.search(generated)
    template_args = (inst.group(2) or "") if inst else ""
    source = _INSTANTIATION.sub("", generated)
    source = _rewrite_threadgroup_decls(source)
    source = _VECTOR_CALL.sub(_vector_call, source)
    buffers = sorted((p for p in params if p.index is not None), key=lambda p: p.index or 0)
    if [p.index for p in buffers] != list(range(len(buffers))):
        raise KernelCompileError("buffer indices are not 0..n-1")
    args = ", ".join(_argument(p) for p in params)
    cpp = (
        '#include "metal_shim.h"\n#include "thread_ids.h"\n#line 1 "kernel.metal"\n'
        f"{source}\n"
        "static inline uint3 __mtl_u3(const unsigned* v) { return uint3{v[0], v[1], v[2]}; }\n"
        'extern "C" void __mtl_kernel_entry(void* const* b, const ThreadIds* t) {\n'
        f"  {function}{template_args}({args});\n}}\n"
    )
    return Translation(cpp=cpp, params=params, source_lines=tuple(source.splitlines()))


def _parse_param(text: str) -> Param:
    match = _PARAM.match(" ".join(text.split()))
    if match is None:
        raise KernelCompileError(f"cannot parse kernel parameter {text!r}")
    index = match.group("index")
    return Param(match.group("name"), match.group("type"), match.group("attr"),
                 int(index) if index is not None else None)


def _argument(p: Param) -> str:
    if p.index is not None:
        if p.is_reference:
            return f"*({p.type.rstrip()[:-1]}*)b[{p.index}]"
        return f"({p.type})b[{p.index}]"
    field = _ALIASES.get(p.attr, p.attr)
    if p.attr in _UINT3_ATTRS:
        return f"__mtl_u3(t->{field})"
    return f"t->{field}"


def _rewrite_threadgroup_decls(source: str) -> str:
    counter = iter(range(1 << 30))

    def replace(m: re.Match[str]) -> str:
        type_, name, dims = m.group(1), m.group(2), "".join(m.group(3).split())
        pointer = f"{type_}(*){dims}" if dims else f"{type_}*"
        return (f"auto& {name} = *reinterpret_cast<{pointer}>(__mtl_threadgroup_alloc("
                f"{next(counter)}, sizeof({type_}{dims}), alignof({type_})));")

    return _THREADGROUP_DECL.sub(replace, source)


def _vector_call(m: re.Match[str]) -> str:
    base = m.group(1) or m.group(3)
    width = m.group(2) or m.group(4)
    return f"__mtl_make<{_VECTOR_ELEMS[base]}, {width}>("
