"""Per-family input/output processing and the offline chat templates of tiny models."""
