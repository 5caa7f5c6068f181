"""Facts about the card a worker drives, from NVML; the only module that imports pynvml.

pynvml comes from the `nvidia-ml-py` distribution. A machine without the library, without a
driver or without a GPU is a normal case: the functions then answer None or 0. `--device cpu
--memory-limit SIZE` gives a simulated card instead (DESIGN.md section 5).
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from vramtune.service.wire import CardInfo
from vramtune.worker.device import alloc_conf

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
T = TypeVar("T")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


class DeviceError(ValueError):
    """The device named on the command line cannot be used."""


def parse_size(text: str) -> int:
    """Bytes in a size such as '512MiB', '2GiB', '8GB', '1.5G' (bare K/M/G/T are binary)."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 512MiB, 2GiB or 8GB)")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return size


def format_size(size: int) -> str:
    """A byte count in the largest binary unit that divides it, e.g. 536870912 → '512MiB'."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        scale = _UNITS[unit.lower()]
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


@functools.cache
def _nvml() -> ModuleType | None:
    """pynvml, initialised once; None without the library, a driver or a GPU."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    module: ModuleType = pynvml
    return module


def gpu_count() -> int:
    """How many GPUs NVML sees (0 without NVML)."""
    nvml = _nvml()
    if nvml is None:
        return 0
    try:
        return int(nvml.nvmlDeviceGetCount())
    except nvml.NVMLError:
        return 0


def _ask(device_index: int, question: Callable[[Any, Any], T]) -> T | None:
    """question(nvml, handle) for GPU `device_index`; None without NVML, that GPU or an answer."""
    nvml = _nvml()
    if nvml is None or not 0 <= device_index < gpu_count():
        return None
    try:
        return question(nvml, nvml.nvmlDeviceGetHandleByIndex(device_index))
    except nvml.NVMLError:
        return None


def card_info(device_index: int) -> CardInfo | None:
    """Name, uuid, memory and versions of GPU `device_index`; None when there is no such GPU."""

    def facts(nvml: Any, handle: Any) -> CardInfo:
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
        return CardInfo(
            model=_text(nvml.nvmlDeviceGetName(handle)),
            total_bytes=int(memory.total),
            free_bytes=int(memory.free),
            device_index=device_index,
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            driver_version=_text(nvml.nvmlSystemGetDriverVersion()),
            cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
            torch_version=torch_version(),
            alloc_conf=allocator_conf(),
        )

    return _ask(device_index, facts)


def free_bytes(device_index: int) -> int | None:
    """Free memory of GPU `device_index` now, or None without NVML."""
    return _ask(device_index, lambda nvml, handle: int(nvml.nvmlDeviceGetMemoryInfo(handle).free))


def process_used_bytes(device_index: int) -> int | None:
    """Memory NVML charges to this process on GPU `device_index` (None when it cannot say).

    NVML's per-process figure can be missing inside containers (no PID namespace mapping); it
    is reported beside torch's own counters, never instead of them.
    """

    def own(nvml: Any, handle: Any) -> int | None:
        for process in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid() and process.usedGpuMemory is not None:
                return int(process.usedGpuMemory)
        return None

    return _ask(device_index, own)


def simulated_card(memory_limit: int) -> CardInfo:
    """The simulated card of `--device cpu --memory-limit SIZE`."""
    return CardInfo(
        model=f"simulated-cpu-{format_size(memory_limit)}",
        total_bytes=memory_limit,
        free_bytes=memory_limit,
        torch_version=torch_version(),
        simulated=True,
        alloc_conf=allocator_conf(),
    )


def device_index(device: str) -> int:
    """N of 'cuda:N' (0 for 'cuda' and 'cpu')."""
    _, _, index = device.partition(":")
    return int(index) if index else 0


def card_for_device(device: str, memory_limit: int | None = None) -> CardInfo:
    """The card behind `device`; a memory limit caps what a real card offers."""
    if device == "cpu":
        if memory_limit is None:
            raise DeviceError("--device cpu needs --memory-limit SIZE (the simulated card)")
        return simulated_card(memory_limit)
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise DeviceError(f"unknown device {device!r}: use cpu or cuda:N")
    info = card_info(device_index(device))
    if info is None:
        raise DeviceError(f"no GPU {device} (NVML sees {gpu_count()}); use --device cpu")
    if memory_limit is not None:
        capped = min(info.free_bytes, memory_limit)
        info = info.model_copy(
            update={"free_bytes": capped, "total_bytes": min(info.total_bytes, memory_limit)}
        )
    return info


def allocator_conf() -> str | None:
    """This process's `PYTORCH_CUDA_ALLOC_CONF`, checked; DeviceError names a bad key.

    Checked here, at the worker's start, so a typo fails once with the key's name instead of
    at the first trial's first CUDA allocation.
    """
    try:
        alloc_conf.from_environ()
    except alloc_conf.AllocConfError as error:
        raise DeviceError(str(error)) from None
    return alloc_conf.raw_from_environ()


def torch_version() -> str | None:
    """The installed torch's version, read without importing torch."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _text(value: str | bytes) -> str:
    # Older pynvml releases return bytes.
    return value.decode() if isinstance(value, bytes) else value
