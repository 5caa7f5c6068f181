"""PYTORCH_CUDA_ALLOC_CONF parsing: the documented keys, their forms, and errors naming the key."""

from __future__ import annotations

import pytest

from vramtune.worker.device import gpu
from vramtune.worker.device.alloc_conf import (
    AllocatorSettings,
    AllocConfError,
    from_environ,
    parse,
)

MiB = 2**20


def test_unset_and_empty_are_the_defaults() -> None:
    assert parse("") == AllocatorSettings()
    assert from_environ({}).is_default
    assert not parse("expandable_segments:True").is_default


def test_the_documented_keys() -> None:
    settings = parse(
        "expandable_segments:True, max_split_size_mb:128,garbage_collection_threshold:0.6,"
        "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True,"
        "pinned_num_register_threads:8,max_non_split_rounding_mb:64,"
        "graph_capture_record_stream_reuse:False"
    )
    assert settings.expandable_segments
    assert settings.max_split_size == 128 * MiB
    assert settings.max_non_split_rounding == 64 * MiB
    assert settings.garbage_collection_threshold == 0.6
    assert settings.release_lock_on_cudamalloc


def test_roundup_power2_divisions_int_and_list_forms() -> None:
    assert parse("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16
    table = parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]").roundup_power2_divisions
    # the first size also covers the smaller ones; '>' every size above the last one named
    assert table == (1,) * 9 + (2, 4) + (8,) * 5
    # a size past the last interval (32 GiB and up) is clamped into it, as PyTorch does
    assert parse("roundup_power2_divisions:[65536:4]").roundup_power2_divisions[-1] == 4
    assert parse("max_split_size_mb:20").max_split_size == 20 * MiB
    settings = parse(
        "max_split_size_mb:64,roundup_power2_divisions:[1:2,>:4],expandable_segments:False"
    )
    assert settings.divisions(MiB) == 2
    assert settings.divisions(3 * MiB) == 4
    assert settings.max_split_size == 64 * MiB


def test_pytorch_alloc_conf_wins_over_the_cuda_name() -> None:
    environ = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": ""}
    assert from_environ(environ).expandable_segments


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("expandable_segment:True", "expandable_segment"),
        ("expandable_segments:yes", "expandable_segments"),
        ("max_split_size_mb:abc", "max_split_size_mb"),
        ("max_split_size_mb:19", "max_split_size_mb"),
        ("max_non_split_rounding_mb:8", "max_non_split_rounding_mb"),
        ("roundup_power2_divisions:3", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[256:3]", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[200:2]", "roundup_power2_divisions"),
        ("roundup_power2_divisions:0", "roundup_power2_divisions"),
        ("roundup_power2_divisions:[256:1", "roundup_power2_divisions"),
        ("garbage_collection_threshold:1.5", "garbage_collection_threshold"),
        ("max_split_size_mb:64,max_split_size_mb:128", "max_split_size_mb"),
        ("expandable_segments", "expandable_segments"),
    ],
)
def test_a_bad_key_or_value_is_named(text: str, key: str) -> None:
    with pytest.raises(AllocConfError, match=key):
        parse(text)


def test_settings_round_trip_through_json_form() -> None:
    settings = parse("expandable_segments:True,roundup_power2_divisions:[64:8,>:2]")
    assert AllocatorSettings.from_dict(settings.to_dict()) == settings


def test_the_card_records_the_conf_and_a_bad_one_stops_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert gpu.simulated_card(2**30).alloc_conf == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:1")
    with pytest.raises(gpu.DeviceError, match="max_split_size_mb"):
        gpu.simulated_card(2**30)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert gpu.simulated_card(2**30).alloc_conf is None
