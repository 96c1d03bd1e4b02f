"""Test utilities that run inside digen's own processes (fault injection)."""
