"""The run: event loop, device workers, channels and slot rings, and the stages."""
