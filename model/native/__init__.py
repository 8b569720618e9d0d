"""The native CPU library: its build for this machine (build.py, from csrc/), and the serving step
whose layers run in one native call (step.py)."""
