"""Workarounds for particular environments; each module says what it works around and when it can go."""
