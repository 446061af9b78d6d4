"""The method comparison (tools/compare_methods.py): its methods, the protocol, launches, the
alignment measure, records, per-method stats, the claims and their verdict rules, the scheduling of
the phases, and the report."""
