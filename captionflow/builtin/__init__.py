"""The offline defaults: the tiny built-in model, full-size stand-ins, the demo set, synthetic images."""
