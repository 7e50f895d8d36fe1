"""Speculative decoding: proposers (n-gram, draft model, EAGLE), the EAGLE head, verification and
the accept rule, the trained heads (drafts/).
"""
