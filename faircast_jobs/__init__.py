"""Runnable jobs (launched with the `deepspeed` runner)."""
