"""What tests, benchmarks and examples build on, not the runtime.

Holds: emulated devices (``emulate``), blocks whose compute is a set wait, for measuring schedules without
accelerators.

May import: nothing of the package (a user's model, not the runtime). Imported by: nothing of the package.
"""
