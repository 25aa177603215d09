"""Experts split between GPU and RAM: executors, placement, latency model, profiler, popularity."""
