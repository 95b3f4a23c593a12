"""What-if analysis: training throughput under failures for ReCycle and the recovery strategies it is
compared against (checkpoint-restart, shrink, Oobleck-style, Bamboo-style), from one job spec.

- `whatif.strategies`: one model per strategy, each mapping a failure set to a steady iteration time.
- `whatif.scenarios`: normalized failure sets up to k failures, with how many placements each stands for.
- `whatif.table`: the `recycle whatif` table (worst case and average over placements).
- `whatif.trace` / `whatif.events`: failure/rejoin traces and the event-driven `recycle simulate`.
- `whatif.precompute` / `whatif.cache`: the resumable on-disk plan cache (`recycle precompute`).
"""
