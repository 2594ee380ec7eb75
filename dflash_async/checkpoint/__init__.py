"""Checkpoints: the training state (state.py), where a run resumes (resume.py) and the servable
export (export.py)."""
