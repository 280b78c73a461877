"""The Prefect tasks: one per stage, each with its policy (retries, cache key, hooks) on its decorator."""
