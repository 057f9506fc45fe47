"""Whether a kernel fits a device: the device's limits, a kernel configuration's footprint, and the
kernels turned off after a compile failure. Every Triton / TileLang / DeepGEMM path asks here
before it is chosen (``docs/architecture.md``, "Kernels chosen by fit")."""
