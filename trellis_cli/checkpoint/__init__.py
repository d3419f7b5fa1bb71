"""The checkpoint model: dialect detection and a normalized, lazy description of a checkpoint."""
