"""Checkpoints: when to save, and resuming (checkpointer.py); files and folders on disk (files.py,
folder.py); sharded checkpoints of any layout (sharded.py); object storage (storage.py); the resume
choice and random states (resume.py); exports (export.py, `python -m` this package).

Imports nothing itself: config.py imports storage.py, which must not bring the rest along."""
