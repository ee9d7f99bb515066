"""Keeping long runs alive: pre-restart diagnostics that name the bad nodes (`diagnose`), and the
supervisor that detects a fault, runs them, excludes those nodes and restarts."""
