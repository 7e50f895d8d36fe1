"""Training what serving loads: the EAGLE-style draft head, fitted by self-distillation on the
target's own answers (`memstep train-draft` is the command; this room holds the work)."""
