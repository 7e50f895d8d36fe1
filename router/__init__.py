"""Data-parallel replicas behind one front: the router, its policies, its log and its replay."""
