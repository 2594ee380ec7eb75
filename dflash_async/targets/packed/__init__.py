"""The packed target forwards, one module per kind of decoder layer (targets/paths.py chooses)."""
