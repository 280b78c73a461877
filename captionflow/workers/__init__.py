"""Code that runs inside Ray workers: no Prefect, no Ray imports (tests/test_architecture.py checks it)."""
