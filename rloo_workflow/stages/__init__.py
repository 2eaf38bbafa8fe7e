"""One module per pipeline stage; each exposes `run(...)` and holds orchestration only."""
