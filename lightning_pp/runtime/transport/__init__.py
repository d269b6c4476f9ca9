"""Stage-boundary transfers (p2p) and the one bounded wait every in-step communication goes through (waits).
"""
