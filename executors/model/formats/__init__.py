"""Each checkpoint format's tensor names for each family, and how they become memstep's."""
