"""The decoder's shared layers: rotary tables, the layer record, MLPs and mixtures of experts.
Families differ only in which of these a layer has (`core/model_families.py`'s facts)."""
