"""The benchmarks that run on this machine, each run as `lmserve bench NAME` (the registry and the
harness are in lmserve.client.bench), and what they share: served.py starts servers, engine_wave.py
sends a wave through the engine, machine.py loads the model the shared flags name, bounds.py and
machine_peaks.py compute what the hardware allows. Not imported by the serving path."""
