"""Data: the world-size-independent sample order, read-ahead, Parquet datasets."""
