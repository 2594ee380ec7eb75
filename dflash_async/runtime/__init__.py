"""The concurrency runtime the stages run on: one thread per device worker (devices.py), bounded
channels (channels.py), the slot rings between targets and drafters (rings.py), and the meters of
their busy time (meters.py). It knows nothing of the run itself (pipeline/).
"""
