"""The roof: the controller that owns a run's actors and drives the training loop, and the
`rlsys` command. Nothing outside this package imports it (tests/architecture/test_layering.py)."""
