"""Consistent initial snapshot in CTID page chunks."""
