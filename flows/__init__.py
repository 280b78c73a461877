"""The Prefect flows (the DAG of one checkpoint, a comparison of several) and the command line."""
