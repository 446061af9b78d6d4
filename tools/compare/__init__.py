"""The method comparison (tools/compare_methods.py): protocol, run records, launches, the alignment
measure, the sweeps' scheduling, verdicts and the report."""
