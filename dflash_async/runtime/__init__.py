"""The concurrency runtime the stages run on: one thread per device worker (devices.py), bounded
channels (channels.py), the slot rings between targets and drafters (rings.py), the meters of
their busy time (meters.py) and torch's CPU thread setting (cpu_threads.py). It knows nothing of
the run itself (pipeline/).
"""
