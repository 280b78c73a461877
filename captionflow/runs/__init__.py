"""A run's bookkeeping: the commit ledger and its pass loop, the stall watchdog, the capacity plan,
fan-out of a compare, the verdict's baseline. Beside the stages, above the engines; it imports neither the
stages nor the warm engine service."""
