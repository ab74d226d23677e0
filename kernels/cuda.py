"""Hand-written CUDA kernels (`kernels/*.cu`): compiled at run time with NVRTC, launched through
the driver API with ctypes, so they need neither a compiler toolchain nor a torch extension.

Used where a kernel must control its shared memory across the programmatic-dependent-launch
wait (kernels.gemv, kernels.mla_decode) or share it within a cluster of programs
(kernels.mla_decode), which Triton cannot express. A launch goes on torch's current stream, so
it is captured in CUDA graphs like any other kernel; `pdl=True` sets the launch attribute that
lets it start while the kernel before it still runs (kernels.pdl explains the chain's rules).
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
from pathlib import Path

import torch

_PDL_ATTRIBUTE = 6           # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_MAX_DYNAMIC_SHARED = 8      # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


class _Attribute(ctypes.Structure):   # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):      # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("n_attrs", ctypes.c_uint)]


def _load(names: list[str], pattern: str) -> ctypes.CDLL:
    """The first of `names` the loader finds, else a file matching `pattern` under the
    nvidia/ wheels beside torch."""
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    roots = {str(Path(torch.__file__).parents[1] / "nvidia"), "/usr/local/cuda/lib64"}
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", pattern), recursive=True)):
            return ctypes.CDLL(path)
    raise OSError(f"no {names[0]} found")


@functools.lru_cache(maxsize=None)
def _nvrtc() -> ctypes.CDLL:
    major = (torch.version.cuda or "12").split(".")[0]
    return _load([f"libnvrtc.so.{major}", "libnvrtc.so"], "libnvrtc.so*")


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    lib = _load(["libcuda.so.1", "libcuda.so"], "libcuda.so*")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _check(rc: int, what: str) -> None:
    if rc:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what}: CUDA error {rc} ({(msg.value or b'?').decode()})")


def _use_primary_context(index: int) -> None:
    """Make device `index`'s primary context (torch's) current on this thread if none is."""
    lib, ctx = _driver(), ctypes.c_void_p()
    _check(lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    if not ctx.value:
        dev = ctypes.c_int()
        _check(lib.cuDeviceGet(ctypes.byref(dev), index), "cuDeviceGet")
        _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


@functools.lru_cache(maxsize=None)
def cubin(source: str, defines: tuple[tuple[str, int], ...], arch: str) -> bytes:
    """Compile `kernels/<source>` for `arch` (e.g. "sm_90") with the given -D defines."""
    lib = _nvrtc()
    text = (Path(__file__).parent / source).read_bytes()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), text, source.encode(), 0, None, None):
        raise RuntimeError(f"nvrtcCreateProgram failed for {source}")
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "-default-device", f"--include-path={Path(__file__).parent}"]
    opts += [f"-D{k}={v}" for k, v in defines]
    c_opts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), c_opts)
    if rc:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        raise RuntimeError(f"NVRTC could not compile {source} {opts}:\n{log.value.decode()}")
    size = ctypes.c_size_t()
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetCUBIN(prog, out)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return out.raw


class Kernel:
    """One `extern "C"` kernel of a .cu file, compiled with `defines`, on one device, for the
    device's architecture with `arch_suffix` appended ("a": sm_90a, the architecture-specific
    features such as wgmma)."""

    def __init__(self, source: str, name: str, defines: dict[str, int], device: torch.device, arch_suffix: str = ""):
        cap = torch.cuda.get_device_capability(device)
        binary = cubin(source, tuple(sorted(defines.items())), f"sm_{cap[0]}{cap[1]}{arch_suffix}")
        with torch.cuda.device(device):
            _use_primary_context(device.index if device.index is not None else torch.cuda.current_device())
            module, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
            _check(_driver().cuModuleLoadData(ctypes.byref(module), binary), f"loading {source}")
            _check(_driver().cuModuleGetFunction(ctypes.byref(self.fn), module, name.encode()), name)
        self.module, self.name, self.shared = module, name, 0

    def __call__(self, grid: int | tuple[int, int], threads: int, shared: int, args: list, pdl: bool = False) -> None:
        """Launch a grid of `grid` programs ((x, y) for two dimensions) on torch's current
        stream. args: tensors (passed as pointers), None (a null pointer), ints (int32),
        floats (fp32)."""
        if shared > self.shared:
            _check(_driver().cuFuncSetAttribute(self.fn, _MAX_DYNAMIC_SHARED, shared), self.name)
            self.shared = shared
        values = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_void_p(None)
                  if a is None else ctypes.c_float(a) if isinstance(a, float) else ctypes.c_int(a) for a in args]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        attr = _Attribute(id=_PDL_ATTRIBUTE, value=1)
        gx, gy = grid if isinstance(grid, tuple) else (grid, 1)
        cfg = _Config((gx, gy, 1), (threads, 1, 1), shared, torch.cuda.current_stream().cuda_stream,
                      ctypes.pointer(attr), 1 if pdl else 0)
        _check(_driver().cuLaunchKernelEx(ctypes.byref(cfg), self.fn, params, None), self.name)


def occupancy(kernel: Kernel, threads: int, shared: int) -> int:
    """Programs of `kernel` one SM holds at once with `threads` threads and `shared` bytes of
    dynamic shared memory (cuOccupancyMaxActiveBlocksPerMultiprocessor)."""
    if shared > kernel.shared:
        _check(_driver().cuFuncSetAttribute(kernel.fn, _MAX_DYNAMIC_SHARED, shared), kernel.name)
        kernel.shared = shared
    n = ctypes.c_int()
    _check(_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), kernel.fn, threads,
                                                                 ctypes.c_size_t(shared)), kernel.name)
    return n.value
