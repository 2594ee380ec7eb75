"""dflash_async: train DFlash speculative-decoding drafters at the speed of the hardware."""

__version__ = "0.1.0"
