"""What exists only on the CPU: the C kernels (kernels.c, built on first use) and their ctypes
bindings, the CPU backend, the one-call decode step, thread policy, CPU features.
"""
