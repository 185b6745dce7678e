"""Run a kernel spec on the CPU: capture MLX's source, translate, build, execute, read back.

``Emulator(...).launch`` has the signature of :func:`metal_kernels.launch.metal_launch`, so kernel
wrappers run unchanged under emulation (``launch=Emulator().launch``).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_infer.metal_kernels.emulator import errors
from mlx_infer.metal_kernels.emulator.build import kernel_executable
from mlx_infer.metal_kernels.emulator.capture import generated_source
from mlx_infer.metal_kernels.emulator.translate import Param, Translation, translate
from mlx_infer.metal_kernels.launch import KernelSpec, TemplateArgs

_ERROR_KINDS: dict[str, type[errors.EmulatorError]] = {
    "out_of_bounds": errors.OutOfBounds,
    "barrier_divergence": errors.BarrierDivergence,
}
_FLOATS = (mx.float16, mx.bfloat16, mx.float32)
Payload = tuple[Param, bytes, bool]  # a buffer parameter, its initial bytes, whether it is an output


@dataclass
class Emulator:
    """How to run: ``schedule`` "forward", "reverse" or "both" (run twice in opposite fiber orders and
    require equal outputs: a cheap race check); ``tsan`` builds with ThreadSanitizer;
    ``check_unwritten`` raises when float outputs keep the NaN they were filled with."""

    schedule: str = "forward"
    tsan: bool = False
    check_unwritten: bool = True
    workers: int = os.cpu_count() or 1
    timeout_s: float = 300.0

    def launch(
        self,
        spec: KernelSpec,
        *,
        inputs: Sequence[mx.array],
        template: TemplateArgs,
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        init_value: float | None = None,
    ) -> list[mx.array]:
        inputs = list(inputs)
        mx.eval(inputs)
        source = generated_source(spec, inputs, template, grid, threadgroup, output_shapes, output_dtypes,
                                  init_value)
        unit = translate(source)
        exe = kernel_executable(unit.cpp, self.tsan)
        payload = _buffers(spec, unit, inputs, output_shapes, output_dtypes, init_value)
        orders = {"forward": [False], "reverse": [True], "both": [False, True]}[self.schedule]
        runs = [self._execute(spec, unit, exe, payload, grid, threadgroup, reverse) for reverse in orders]
        outputs = [_from_bytes(b, s, d) for b, s, d in zip(runs[0], output_shapes, output_dtypes)]
        for other in runs[1:]:
            for name, first, second in zip(spec.output_names, runs[0], other):
                if first != second:
                    raise errors.DataRace(f"kernel {spec.name}: output {name!r} differs between forward and "
                                          "reverse thread schedules (a data race or an uninitialised read)")
        if self.check_unwritten and init_value is None:
            for name, out, dtype in zip(spec.output_names, outputs, output_dtypes):
                if dtype in _FLOATS:
                    holes = np.flatnonzero(np.isnan(np.asarray(out.astype(mx.float32))))
                    if holes.size:
                        raise errors.UnwrittenOutput(
                            f"kernel {spec.name}: output {name!r} has {holes.size} of {out.size} elements "
                            f"never written (first flat index {holes[0]})")
        return outputs

    def _execute(self, spec: KernelSpec, unit: Translation, exe: Path, payload: list[Payload],
                 grid: tuple[int, int, int], threadgroup: tuple[int, int, int], reverse: bool) -> list[bytes]:
        with tempfile.TemporaryDirectory(prefix="mtl-emu-") as tmp:
            data, out, manifest = Path(tmp, "data"), Path(tmp, "out"), Path(tmp, "manifest")
            lines = [f"grid {grid[0]} {grid[1]} {grid[2]}",
                     f"threadgroup {threadgroup[0]} {threadgroup[1]} {threadgroup[2]}",
                     f"reverse {int(reverse)}", f"workers {self.workers}", f"data {data}", f"out {out}",
                     f"buffers {len(payload)}"]
            offset = 0
            with data.open("wb") as f:
                for param, blob, is_output in payload:
                    lines.append(f"{param.name} {len(blob)} {offset} {int(is_output)}")
                    f.write(blob)
                    offset += len(blob)
            manifest.write_text("\n".join(lines) + "\n")
            env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1 exitcode=66 report_signal_unsafe=0")
            try:
                proc = subprocess.run([str(exe), str(manifest)], capture_output=True, text=True,
                                      timeout=self.timeout_s, env=env)
            except subprocess.TimeoutExpired as e:
                message = f"kernel {spec.name}: no result after {self.timeout_s:.0f} s"
                raise errors.KernelTimeout(message) from e
            if proc.returncode != 0:
                raise _failure(spec, unit, proc)
            blob = out.read_bytes()
        sizes = [len(b) for _, b, is_output in payload if is_output]
        return [blob[sum(sizes[:i]): sum(sizes[: i + 1])] for i in range(len(sizes))]


def _failure(spec: KernelSpec, unit: Translation, proc: subprocess.CompletedProcess[str]
             ) -> errors.EmulatorError:
    stderr = proc.stderr
    if "ThreadSanitizer: data race" in stderr:
        where = sorted({n for n in re.findall(r"kernel\.metal:(\d+)", stderr)
                        if int(n) <= len(unit.source_lines)}, key=int)
        lines = "; ".join(f"line {n}: {_line(unit, int(n))}" for n in where[:4])
        return errors.DataRace(f"kernel {spec.name}: ThreadSanitizer data race at {lines}")
    match = re.search(r"MTL-EMU-ERROR (\w+) (.*)", stderr)
    if match is None:
        tail = stderr.strip()[-2000:]
        return errors.KernelFault(f"kernel {spec.name}: exit status {proc.returncode}: {tail}")
    kind, message = match.groups()
    message = re.sub(r"line (\d+)", lambda m: f"line {m.group(1)} `{_line(unit, int(m.group(1)))}`", message)
    return _ERROR_KINDS.get(kind, errors.KernelFault)(f"kernel {spec.name}: {message}")


def _line(unit: Translation, number: int) -> str:
    return unit.source_lines[number - 1].strip() if 0 < number <= len(unit.source_lines) else "?"


def _buffers(spec: KernelSpec, unit: Translation, inputs: list[mx.array],
             output_shapes: Sequence[Sequence[int]], output_dtypes: Sequence[mx.Dtype],
             init_value: float | None) -> list[Payload]:
    by_name = dict(zip(spec.input_names, inputs))
    outputs = dict(zip(spec.output_names, zip(output_shapes, output_dtypes)))
    payload = []
    for p in sorted((p for p in unit.params if p.index is not None), key=lambda p: p.index or 0):
        if p.name in by_name:
            payload.append((p, _to_bytes(by_name[p.name]), False))
        elif p.name in outputs:
            shape, dtype = outputs[p.name]
            payload.append((p, _output_fill(shape, dtype, init_value), True))
        else:
            base, _, what = p.name.rpartition("_")
            arr = by_name[base]
            if what == "shape":
                payload.append((p, np.array(arr.shape, np.int32).tobytes(), False))
            elif what == "strides":
                strides = np.cumprod([1, *arr.shape[::-1]])[:-1][::-1] if arr.ndim else np.zeros(0)
                payload.append((p, np.asarray(strides, np.int64).tobytes(), False))
            else:
                payload.append((p, np.array(arr.ndim, np.int32).tobytes(), False))
    return payload


def _to_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def _output_fill(shape: Sequence[int], dtype: mx.Dtype, init_value: float | None) -> bytes:
    if init_value is not None:
        return _to_bytes(mx.full(tuple(shape), init_value, dtype=dtype))
    return b"\xff" * (int(np.prod(shape)) * dtype.size)  # NaN in every float format


def _from_bytes(blob: bytes, shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(np.frombuffer(blob, np.uint16).reshape(tuple(shape))).view(mx.bfloat16)
    np_dtype = np.dtype(str(dtype).split(".")[-1])
    return mx.array(np.frombuffer(blob, np_dtype).reshape(tuple(shape)))
