"""The chaos run (issue 8): ``python -m tests.chaos``; see tests/chaos/run.py."""
