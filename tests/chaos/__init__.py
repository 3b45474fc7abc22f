"""The chaos run (issue 8): ``python -m tests.chaos``; see tests/chaos/run.py (the run),
faults.py (what it injects) and report.py (what it checks)."""
