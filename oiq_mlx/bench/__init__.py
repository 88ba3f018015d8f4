"""Speed and memory: decode latency and KV bytes, traced dispatches per step, server load, the
sharded benchmark, and the Metal check a Mac user runs."""
