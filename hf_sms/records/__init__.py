"""A run's records: its results table, log lines and model card / Hub upload."""
