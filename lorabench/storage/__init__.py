"""Files: a run's Parquet rows, and a tune folder's configs."""
