"""Executors drive the workers: one in-process worker now, one process per device with tensor parallelism."""
