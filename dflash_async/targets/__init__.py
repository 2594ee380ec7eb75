"""The frozen target: loading, the built-in tiny target, and its forward."""
