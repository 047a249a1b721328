"""Operations: metrics, tracing, health, drain on shutdown, correlation ids in logs, and
the watch on stalled streams."""
