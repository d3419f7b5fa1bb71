"""The lab builds of the kernel library (lab.py) and the Python twins of its device algorithms (oracle.py)."""
