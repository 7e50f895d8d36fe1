"""The executor as a process and its ranks: the socket loop, the engine-side client, standby,
tensor-parallel replies, the in-process executor.
"""
