"""A model zoo for the predictor benchmark: eleven architectures as vramtune tasks."""

from bench.zoo.tasks import ZOO, ZooTask

__all__ = ["ZOO", "ZooTask"]
