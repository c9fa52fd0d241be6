"""Attention metadata and backends: how the attention layers find this step's K/V."""
