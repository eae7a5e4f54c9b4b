"""Controlled experiments on the method itself, apart from the benchmarks of the shipped paths: the needle-recall task
of the long-range ablation (`needle_recall.py`, run by `scripts/long_range_ablation.py`)."""
