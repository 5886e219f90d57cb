"""Helpers shared by users, tests and benchmarks: checkpoints made locally."""
