"""Card facts: sizes, the simulated card, and machines without NVML or without a GPU."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from vramtune.worker.device import gpu


@pytest.fixture
def fresh_nvml() -> Iterator[None]:
    """Forget the cached NVML handle before and after a test that changes what it finds."""
    gpu._nvml.cache_clear()
    yield
    gpu._nvml.cache_clear()


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512MiB", 512 * 1024**2),
        ("2GiB", 2 * 1024**3),
        ("8GB", 8 * 1000**3),
        ("1.5G", int(1.5 * 1024**3)),
        ("  64 kib ", 64 * 1024),
        ("4096", 4096),
        ("1TiB", 1024**4),
    ],
)
def test_parse_size_reads_binary_and_decimal_units(text: str, size: int) -> None:
    assert gpu.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "12 parsecs", "-1GiB", "0MiB", "GiB", "1.2.3G"])
def test_parse_size_refuses_what_is_not_a_size(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        gpu.parse_size(text)


def test_format_size_uses_the_largest_exact_unit() -> None:
    assert gpu.format_size(512 * 1024**2) == "512MiB"
    assert gpu.format_size(3 * 1024**3) == "3GiB"
    assert gpu.format_size(1000) == "1000B"


def test_simulated_card_is_named_by_its_size_and_fully_free() -> None:
    card = gpu.card_for_device("cpu", gpu.parse_size("768MiB"))
    assert card.model == "simulated-cpu-768MiB"
    assert card.simulated
    assert card.total_bytes == card.free_bytes == 768 * 1024**2


def test_cpu_device_needs_a_memory_limit() -> None:
    with pytest.raises(gpu.DeviceError, match="--memory-limit"):
        gpu.card_for_device("cpu")


def test_unknown_device_is_refused() -> None:
    with pytest.raises(gpu.DeviceError, match="unknown device"):
        gpu.card_for_device("tpu:0", 1024)


def test_device_index_of_cuda_names() -> None:
    assert gpu.device_index("cuda:3") == 3
    assert gpu.device_index("cuda") == 0
    assert gpu.device_index("cpu") == 0


def test_without_the_library_there_is_no_gpu(
    monkeypatch: pytest.MonkeyPatch, fresh_nvml: None
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert gpu.gpu_count() == 0
    assert gpu.card_info(0) is None
    assert gpu.free_bytes(0) is None
    assert gpu.process_used_bytes(0) is None
    with pytest.raises(gpu.DeviceError, match="no GPU cuda:0"):
        gpu.card_for_device("cuda:0")


@pytest.mark.skipif(gpu.gpu_count() > 0, reason="this machine has a GPU")
def test_library_without_a_driver_or_gpu_is_a_normal_case(fresh_nvml: None) -> None:
    assert gpu.gpu_count() == 0
    assert gpu.card_info(0) is None
    assert gpu.process_used_bytes(0) is None


@pytest.mark.gpu
@pytest.mark.skipif(gpu.gpu_count() == 0, reason="needs a GPU")
def test_real_card_facts() -> None:
    card = gpu.card_info(0)
    assert card is not None
    assert 0 < card.free_bytes <= card.total_bytes
    assert card.uuid and card.uuid.startswith("GPU-")
    assert card.driver_version and card.cuda_version
    assert gpu.card_info(gpu.gpu_count()) is None
    capped = gpu.card_for_device("cuda:0", 1024**3)
    assert capped.free_bytes <= 1024**3
