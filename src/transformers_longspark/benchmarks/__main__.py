"""`python -m transformers_longspark.benchmarks ...`: the same as `longspark bench ...`."""

from .cli import main

main()
