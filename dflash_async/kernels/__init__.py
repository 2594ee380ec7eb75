"""Hand-written Triton kernels and the FP8 row format, below both the target and the drafter.

Each kernel module imports triton at its top, so it is imported lazily and only on a GPU; its
contract and torch reference live beside the code that calls it (the CPU runs the reference).
`fp8_format.py` is plain torch: the row-wise e4m3 format both sides' FP8 matmuls share.
"""
