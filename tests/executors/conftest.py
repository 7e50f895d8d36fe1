"""The executors' tests, in rooms as executors/ is (cpu, cuda, model, process, runtime, spec).

This folder holds no package: pytest puts it on sys.path for this conftest, so a helper shared
by two rooms' tests (`half_schemas`: the CPU's and the GPU's constrained-memory tests) lives
here and is imported by name."""
