"""Real vs fake output storage bytes over PyTorch's OpInfo ops (bench/opinfo_storage.py).

A real kernel whose output keeps a larger storage than its fake counterpart would be an
under-prediction no accuracy benchmark sees. Every mismatch must be listed, with its reason,
in tests/worker/opinfo_allowlist.txt. By default a fixed sample of 80 ops runs (seconds); set
VRAMTUNE_OPINFO_ALL=1 for every op, or run the script (it writes bench/results/).
"""

from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("expecttest", reason="torch's OpInfo database needs expecttest (dev extra)")

from bench import opinfo_storage  # after the skip: it imports torch's tests

SAMPLE = 80


def test_every_storage_mismatch_is_explained() -> None:
    ops = opinfo_storage.op_db()
    if os.environ.get("VRAMTUNE_OPINFO_ALL") != "1":
        ops = random.Random(0).sample(ops, SAMPLE)
    found, compared = opinfo_storage.run(ops)
    assert compared > SAMPLE  # both dtypes of most ops ran
    known = opinfo_storage.allowlist()
    unexplained = [f"{m.key}: real {m.real} fake {m.fake}" for m in found if m.key not in known]
    assert not unexplained, "storage mismatches not in opinfo_allowlist.txt:\n" + "\n".join(
        unexplained
    )


def test_a_mismatch_is_found_where_there_is_one() -> None:
    class Stub:
        """An 'op' whose real call returns a 0-d view of a whole buffer, as the fake does not."""

        name, variant_test_name, supports_autograd = "stub", "", False

        def sample_inputs(self, device: str, dtype: object, requires_grad: bool) -> object:
            import torch
            from torch.testing._internal.opinfo.core import SampleInput

            return iter([SampleInput(torch.ones(64))])

        def __call__(self, x: object) -> object:
            import torch
            from torch._subclasses.fake_tensor import FakeTensor

            assert isinstance(x, torch.Tensor)
            if isinstance(x, FakeTensor):
                return x.sum()
            return (x * 2)[0]  # 0-d, but its storage holds all 64 elements

    import torch

    mismatches = list(opinfo_storage.compare(Stub(), torch.float32))
    assert [(m.key, m.real, m.fake, m.under) for m in mismatches] == [
        ("stub float32 forward", [256], [4], True)
    ]
