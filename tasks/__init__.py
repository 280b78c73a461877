"""The four pipeline stages, one module each; every stage is a Prefect task and a plain function."""
