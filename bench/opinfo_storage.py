"""Real vs fake output storage bytes over PyTorch's OpInfo database (CPU; float32 and bf16).

The predictor counts the storages fake tensors report. A kernel whose real output keeps a
larger storage than its fake counterpart (a 0-d result viewing a whole buffer, a workspace kept
alive with the output) would be an under-prediction the accuracy benchmark cannot see, since
both sides of that benchmark count with the same tracker. This compares, for the first sample
input of every OpInfo op, the storage size of each output (forward) and of each input's
gradient (backward, float32) between a real call and the same call under FakeTensorMode.

Each sample uses one dtype: mixed calls (a bf16 input with float32 weights, as autocast makes
them) are not covered; worker/predictor/opmodel.py lists what the family benchmark found there.

Used by tests/worker/test_opinfo_storage.py (a fixed sample of ops, every run) and as a script
(every op, results to bench/results/opinfo_storage.{md,json}):

    python bench/opinfo_storage.py [--limit N]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves, tree_map_only

REPO = Path(__file__).resolve().parents[1]
ALLOWLIST = REPO / "tests" / "worker" / "opinfo_allowlist.txt"
DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Mismatch:
    """One op whose real and fake storages differ: which, where, and the sizes."""

    key: str
    real: list[int | None]
    fake: list[int | None]

    @property
    def under(self) -> bool:
        """Whether the real run keeps more bytes than the fake one (an under-prediction)."""
        return sum(r or 0 for r in self.real) > sum(f or 0 for f in self.fake)


def _storage_sizes(outputs: Any, inputs: Any) -> list[int | None]:
    """Bytes of each output's storage; None where it is an input's storage (a view, in-place)."""
    owned = {
        StorageWeakRef(t.untyped_storage())
        for t in tree_leaves(inputs)
        if isinstance(t, torch.Tensor)
    }
    sizes: list[int | None] = []
    for leaf in tree_leaves(outputs):
        if not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided:
            continue
        storage = leaf.untyped_storage()
        sizes.append(None if StorageWeakRef(storage) in owned else storage.nbytes())
    return sizes


def _call(op: Any, sample: Any) -> Any:
    return op(sample.input, *sample.args, **sample.kwargs)


def _grads(op: Any, sample: Any) -> list[int | None]:
    """Storage bytes of each input gradient after a backward of the outputs' sum."""
    out = _call(op, sample)
    floats = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not floats:
        return []
    inputs = [t for t in tree_leaves((sample.input, sample.args)) if isinstance(t, torch.Tensor)]
    wanted = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(sum(t.sum() for t in floats), wanted, allow_unused=True)
    return _storage_sizes([g for g in grads if g is not None], inputs)


UNTRACEABLE: list[str] = []
"""(op dtype) pairs whose real or fake call raised: the predictor probes such models."""


def compare(op: Any, dtype: torch.dtype) -> Iterator[Mismatch]:
    """Mismatches of `op`'s first sample at `dtype`, forward and (float32) backward."""
    backward = dtype == torch.float32 and op.supports_autograd
    sample = _first_multi_element_sample(op, dtype, backward)
    if sample is None:
        return
    runs: dict[str, tuple[Any, Any]] = {}
    for mode in ("real", "fake"):
        try:
            runs[mode] = _sizes(op, sample, backward, fake=mode == "fake")
        except Exception:  # an op fake tensors cannot run falls back to the probe: not compared
            UNTRACEABLE.append(f"{op.name} {dtype}")
            return
    (real_out, real_grad), (fake_out, fake_grad) = runs["real"], runs["fake"]
    name = f"{op.name}{'.' + op.variant_test_name if op.variant_test_name else ''}"
    dt = str(dtype).removeprefix("torch.")
    if real_out != fake_out:
        yield Mismatch(f"{name} {dt} forward", real_out, fake_out)
    if real_grad != fake_grad:
        yield Mismatch(f"{name} {dt} backward", real_grad, fake_grad)


def _first_multi_element_sample(op: Any, dtype: torch.dtype, backward: bool) -> Any:
    """The first of the op's first few samples whose input has several elements (else the
    first): a reduction of a 0-d input cannot show a 0-d output that keeps its whole
    elementwise buffer (CPU mse_loss, smooth_l1_loss: issue 29)."""
    samples = itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=backward), 8)
    first = None
    for sample in samples:
        first = sample if first is None else first
        if isinstance(sample.input, torch.Tensor) and sample.input.numel() > 1:
            return sample
    return first


def _sizes(op: Any, sample: Any, backward: bool, fake: bool) -> tuple[Any, Any]:
    if not fake:
        out = _call(op, sample)
        return _storage_sizes(out, (sample.input, sample.args, sample.kwargs)), (
            _grads(op, sample) if backward else []
        )
    mode = FakeTensorMode()
    converted = sample.transform(lambda t: tree_map_only(torch.Tensor, mode.from_tensor, t))
    with mode:
        out = _call(op, converted)
        forward = _storage_sizes(out, (converted.input, converted.args, converted.kwargs))
        return forward, (_grads(op, converted) if backward else [])


def op_db() -> list[Any]:
    """PyTorch's OpInfo database (a test-only module of torch; slow to import)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db as ops
    return list(ops)


def allowlist() -> dict[str, str]:
    """'op dtype direction' -> why its real and fake storages differ (or why it is harmless)."""
    entries = {}
    for line in ALLOWLIST.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, reason = line.partition(":")
            entries[key.strip()] = reason.strip()
    return entries


def run(ops: list[Any]) -> tuple[list[Mismatch], int]:
    """Every mismatch of `ops` over DTYPES, and how many (op, dtype) pairs were compared."""
    found: list[Mismatch] = []
    compared = 0
    for op in ops:
        for dtype in DTYPES:
            if dtype not in op.supported_dtypes("cpu"):
                continue
            compared += 1
            found.extend(compare(op, dtype))
    return found, compared


def main(argv: list[str] | None = None) -> int:
    """Compare every op and write bench/results/opinfo_storage.{md,json}."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--limit", type=int, default=None, help="only the first N ops")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.process_time()
    ops = op_db()[: args.limit]
    found, compared = run(ops)
    known = allowlist()
    unexplained = [m for m in found if m.key not in known]
    seconds = time.process_time() - started
    load = os.getloadavg()[0]
    lines = [
        "# OpInfo: real vs fake output storage bytes (CPU)",
        "",
        f"torch {torch.__version__} · {len(ops)} ops, {compared} (op, dtype) pairs · "
        f"{seconds:.0f} CPU s · load average {load:.2f} at the end · "
        "`python bench/opinfo_storage.py`",
        "",
        f"- mismatches: {len(found)} ({sum(m.under for m in found)} where real keeps more); "
        f"not in tests/worker/opinfo_allowlist.txt: {len(unexplained)}; not compared (the "
        f"real or the fake call raised: such a model is probed, not traced): {len(UNTRACEABLE)}",
        "",
        "| op dtype direction | real bytes | fake bytes | real > fake | reason |",
        "|---|---|---|:---:|---|",
        *(
            f"| {m.key} | {m.real} | {m.fake} | {'yes' if m.under else ''} | "
            f"{known.get(m.key, '**unexplained**')} |"
            for m in found
        ),
    ]
    out = REPO / "bench" / "results" / "opinfo_storage"
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    payload = {"torch": torch.__version__, "ops": len(ops), "compared": compared, "cpu_s": seconds}
    payload["not_compared"] = UNTRACEABLE
    payload["mismatches"] = [asdict(m) | {"reason": known.get(m.key)} for m in found]
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    print("\n".join(lines[:6]))
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
