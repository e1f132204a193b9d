"""Benchmarks: prompt sets, an interleaved runner, metrics from recorded events, reports and plots."""
