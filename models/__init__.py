"""The model zoo: one module per family, each registering an adapter on import.

`mmrl.registry.discover()` imports every module here the first time a lookup needs
it; adding a family is adding a file (see docs/adding_a_model.md).
"""
