"""A model zoo for the predictor benchmarks: eleven architectures as vramtune tasks (`ZOO`),
and three more for bench/fit_peers.py (`EXTRAS`: frozen stages, LoRA, two inputs)."""

from bench.zoo.tasks import EXTRAS, ZOO, ZooTask

__all__ = ["EXTRAS", "ZOO", "ZooTask"]
