"""tools/plan.py's model of a run, apart from its command line: the model's shard shapes (`shards`), what each rank
syncs (`synced`), memory per rank (`memory`), bytes per outer sync (`sync_bytes`), the idealised wall-clock
(`wall_clock`), the plan that puts them together (`plan`) and its markdown (`report`). The formulas are stated in
tools/plan.py's docstring (its --help)."""
