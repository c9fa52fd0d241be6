"""Executors drive the workers: uni (every rank in this process) or mp (a process per rank)."""
