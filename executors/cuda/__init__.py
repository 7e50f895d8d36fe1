"""What exists only on CUDA: the Triton kernels, the CUDA backend, the decode step's graphs,
piecewise graphs, decode-ahead.
"""
