"""The shuffle engine: spec, run, store and the task functions."""

from gpushuffle.engine.run import GPUShuffleRun
from gpushuffle.engine.spec import GPUShuffleSpec
from gpushuffle.engine.store import ShardStore, StoreStatistics

__all__ = ["GPUShuffleRun", "GPUShuffleSpec", "ShardStore", "StoreStatistics"]
