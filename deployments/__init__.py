"""Prefect deployments of captionflow and the checkpoint watcher."""
