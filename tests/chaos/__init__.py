"""The chaos run (issue 8): ``python -m tests.chaos``.

run.py runs it, faults.py injects the faults, report.py checks the outcome.
"""
