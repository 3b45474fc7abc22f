"""The chaos run (issue 8): ``python -m tests.chaos``.

run.py runs it, faults.py injects the faults, report.py gathers the figures, analysis.py
judges them (which overlaps a fault explains), and report.py checks and prints them.
"""
