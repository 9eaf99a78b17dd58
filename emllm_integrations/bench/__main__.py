"""``python -m emllm_integrations.bench --child``: one bench cell in a process of its own (run_bench starts it)."""

import sys

from .harness import child_main

if sys.argv[1:] == ["--child"]:
    sys.exit(child_main())
print("Run the benchmark with `emllm bench` or emllm_integrations.bench.run_bench(...).", file=sys.stderr)
sys.exit(2)
