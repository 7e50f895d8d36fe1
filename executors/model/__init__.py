"""The model as math, backend-free: the decoder, the attention and linear backends' interface, the
torch reference backend, weights and their layouts, quantized weights.
"""
