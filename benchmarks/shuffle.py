"""``python -m benchmarks.shuffle``: the same benchmark as ``gpushuffle bench``."""

from gpushuffle.cli import bench

if __name__ == "__main__":
    bench()
