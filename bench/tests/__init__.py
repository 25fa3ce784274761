"""The tests of the benchmarks' own code: the noisy-neighbour showcase."""
